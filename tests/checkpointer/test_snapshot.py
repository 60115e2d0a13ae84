"""The snapshot (checkpointer/snapshot.py): reused buffers and leaves, and the warning about a
state dict passed unwrapped as hundreds of components."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ckptstore.checkpointer import ShardWriter, open_run
from ckptstore.checkpointer.snapshot import UNWRAPPED_COMPONENTS, Snapshotter, looks_unwrapped
from ckptstore.errors import ConfigError
from ckptstore.serialize.compare import first_difference


def _state_dict(n: int) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.weight": torch.full((3,), float(i)) for i in range(n)}


def _unwrapped_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "passed unwrapped" in r.getMessage()]


def test_hundreds_of_bare_tensors_warn_once_per_writer_naming_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ckptstore.checkpointer")
    sd = _state_dict(UNWRAPPED_COMPONENTS + 20)
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        run.save(1, sd)
        run.save(2, sd)
        (message,) = _unwrapped_warnings(caplog)
        assert f"{len(sd)} components" in message
        assert "'layers.0.weight'" in message
        assert "{'model': model.state_dict()}" in message
        # It is a warning, not a refusal: the checkpoint is whole.
        loaded = run.load(2).state
        assert first_difference(dict(sorted(loaded.items())), dict(sorted(sd.items()))) is None
    caplog.clear()
    with ShardWriter(tmp_path / "s") as writer:
        writer.save(sd).receipts()
    assert len(_unwrapped_warnings(caplog)) == 1


def test_a_wrapped_state_dict_or_few_components_do_not_warn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ckptstore.checkpointer")
    sd = _state_dict(UNWRAPPED_COMPONENTS + 20)
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        run.save(1, {"model": sd, "optimizer": {"step": 1}})
        run.save(2, _state_dict(UNWRAPPED_COMPONENTS - 1))
    assert _unwrapped_warnings(caplog) == []


def test_what_counts_as_unwrapped() -> None:
    n = UNWRAPPED_COMPONENTS
    assert looks_unwrapped(_state_dict(n))
    assert not looks_unwrapped(_state_dict(n - 1))
    # Components that are mostly structured states (shards of a sharded save) are fine.
    assert not looks_unwrapped({f"rank{i}": {"w": torch.ones(1)} for i in range(n * 2)})
    mixed = {**_state_dict(n), **{f"extra{i}": {"v": i} for i in range(n // 5)}}
    assert not looks_unwrapped(mixed)


def test_steady_state_snapshots_reuse_buffers_and_leaves() -> None:
    snap = Snapshotter()
    first = snap.take({"m": {"w": torch.ones(4)}})
    second = snap.take({"m": {"w": torch.zeros(4)}})
    (leaf1,), (leaf2,) = first["m"].leaves, second["m"].leaves
    assert leaf1 is leaf2  # same buffer, same leaf: no per-tensor work but the copy
    assert bytes(leaf2.data) == torch.zeros(4).numpy().tobytes()
    third = snap.take({"m": {"w": torch.zeros(5)}})  # a new shape gets a new buffer
    assert third["m"].leaves[0] is not leaf1


def test_run_save_refuses_kinds_for_components_it_does_not_have(tmp_path: Path) -> None:
    # The same rule as ShardWriter.save (one check): a typo is an error, not a silent no-op.
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        with pytest.raises(ConfigError, match=r"kinds names \['polcy'\].*components are"):
            run.save(1, {"policy": {"w": torch.ones(2)}}, kinds={"polcy": "policy"})
        assert run.latest() is None
