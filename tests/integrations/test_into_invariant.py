"""Issue 40: every load path either fills every target from verified bytes or touches none,
refusing with an error that names the target and why. Run.load(into=) and the DCP load, with
targets that cannot be filled: expanded, self-overlapping, meta, and two sharing memory."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptstore.checkpointer import open_run
from ckptstore.errors import ConfigError
from ckptstore.integrations import dcp as ckpt_dcp

BAD: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "expanded": lambda other: torch.zeros(4).expand(4, 4),
    "overlapping": lambda other: torch.zeros(16).as_strided((4, 4), (1, 1)),
    "meta": lambda other: torch.empty(4, 4, device="meta"),
    "shares-memory": lambda other: other[:16].view(4, 4),
}
WHY = {"expanded": "overlap", "overlapping": "overlap", "meta": "meta", "shares-memory": "shares"}


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(16.0) + 1, "b": torch.ones(4, 4), "c": torch.full((8,), 3.0)}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_run_load_into_refuses_before_any_target_is_written(tmp_path: Path, kind: str) -> None:
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        run.save(1, {"m": _state()})
        a, c = torch.zeros(16), torch.zeros(8)
        targets = {"a": a, "b": BAD[kind](a), "c": c}
        with pytest.raises(ConfigError, match=rf"'b'.*{WHY[kind]}"):
            run.load(1, into={"m": targets})
    assert not a.any()
    assert not c.any()


@pytest.mark.parametrize("kind", sorted(BAD))
def test_dcp_load_refuses_before_any_target_is_written(tmp_path: Path, kind: str) -> None:
    """The expanded target made torch raise once 'a' and 'c' were filled; the overlapping
    and memory-sharing ones loaded with elements lost."""
    warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        ckpt_dcp.save(_state(), run, 1)
        a, c = torch.zeros(16), torch.zeros(8)
        state = {"a": a, "b": BAD[kind](a), "c": c}
        with pytest.raises(ConfigError, match=rf"'b'.*{WHY[kind]}"):
            ckpt_dcp.load(state, run, 1)
    assert not a.any()
    assert not c.any()


def test_disjoint_views_of_one_buffer_load_exactly(tmp_path: Path) -> None:
    """Columns of one matrix interleave without sharing a byte: both are filled."""
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        run.save(1, {"m": {"x": torch.arange(4.0), "y": -torch.arange(4.0)}})
        buffer = torch.zeros(4, 2)
        run.load(1, into={"m": {"x": buffer[:, 0], "y": buffer[:, 1]}})
    assert torch.equal(buffer, torch.stack([torch.arange(4.0), -torch.arange(4.0)], 1))


def test_dcp_load_fills_tied_weights(tmp_path: Path) -> None:
    """One tensor under two names (tied embedding and output weights, as a model's state dict
    lists them) is one target, not two sharing memory."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    warnings.simplefilter("ignore", UserWarning)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    saved = model[0].weight.detach().clone()
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        ckpt_dcp.save(get_model_state_dict(model), run, 1)
        with torch.no_grad():
            model[0].weight.zero_()
        ckpt_dcp.load(get_model_state_dict(model), run, 1)
    assert torch.equal(model[0].weight, saved)
    assert model[1].weight is model[0].weight


class _Holder:
    """A Stateful whose state DCP expands before planning (as an optimizer's is)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"x": self.x}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.x = state["x"]


def test_dcp_load_checks_the_targets_inside_stateful_states(tmp_path: Path) -> None:
    warnings.simplefilter("ignore", UserWarning)
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        ckpt_dcp.save({"a": torch.arange(16.0) + 1, "h": _Holder(torch.ones(4, 4))}, run, 1)
        a = torch.zeros(16)
        with pytest.raises(ConfigError, match=r"'h\.x'.*overlap"):
            ckpt_dcp.load({"a": a, "h": _Holder(torch.zeros(4).expand(4, 4))}, run, 1)
    assert not a.any()
