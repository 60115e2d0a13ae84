"""Issue 40 for the Megatron-Core load (``ckpt_megatron.load`` and Megatron's own
``dist_checkpointing.load`` through the registered ckptstore strategy): either every requested
tensor is filled from verified bytes, or the load refuses, naming the key, and no target changes.

The ckptstore strategy never writes the caller's ``ShardedTensor.data``: it returns new tensors
(as Megatron's load returns the loaded state dict), so a target Megatron accepts -- an expanded,
self-overlapping, meta or memory-sharing ``.data`` -- loads exactly into the returned state and
leaves every ``.data`` as it was. One whose dtype or shape differs from the stored tensor is
refused, naming the key, with every ``.data`` untouched. The loads run in a gloo world of one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lazy_imports import deferred

import ckptstore
from ckptstore.checkpointer import Run
from ckptstore.errors import ConfigError

# Megatron-Core takes seconds to import: on first use, not when pytest collects this module.
ShardedTensor = deferred("megatron.core.dist_checkpointing", "ShardedTensor")
dist_checkpointing = deferred("megatron.core.dist_checkpointing")
mcore = deferred("ckptstore.integrations.megatron")

SENTINEL = -7.0
#: The ``.data`` of target 'b' (4 x 4 float32), given target 'a''s data (16 float32).
BAD: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "expanded": lambda a: torch.full((4,), SENTINEL).expand(4, 4),
    "overlapping": lambda a: torch.full((16,), SENTINEL).as_strided((4, 4), (1, 1)),
    "meta": lambda a: torch.empty(4, 4, device="meta"),
    "shares-memory": lambda a: a[:16].view(4, 4),
}
#: The ``.data`` of target 'b' that the load must refuse, and what the error says.
WRONG: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "dtype": (lambda: torch.full((4, 4), SENTINEL, dtype=torch.float64), r"'b' is float32"),
    "shape": (lambda: torch.full((4, 5), SENTINEL), r"'b' is \[4, 4\]"),
}


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def run(tmp_path: Path, world_of_one: None) -> Iterator[Run]:
    with ckptstore.open_run("m", db=tmp_path / "m.db", store=tmp_path / "store") as opened:
        yield opened


def saved() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(16.0) + 1, "b": -torch.arange(16.0).view(4, 4), "c": torch.ones(8)}


def requested(datas: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {key: ShardedTensor.from_rank_offsets(key, data) for key, data in datas.items()}


def targets(b: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """'a' and 'c' filled with the sentinel, 'b' as given."""
    a = torch.full((16,), SENTINEL)
    return {"a": a, "b": b(a), "c": torch.full((8,), SENTINEL)}


def snapshot(datas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """Copies of every target that has memory (meta ones have none to change)."""
    return {k: None if t.device.type == "meta" else t.clone() for k, t in datas.items()}


def assert_untouched(datas: dict[str, torch.Tensor], before: dict[str, Any]) -> None:
    for key, tensor in datas.items():
        if before[key] is not None:
            assert torch.equal(tensor, before[key]), f"target {key!r} was written"


def assert_exact(loaded: dict[str, Any], datas: dict[str, torch.Tensor]) -> None:
    for key, value in saved().items():
        assert torch.equal(loaded[key], value), key
        assert loaded[key].device.type == "cpu"
    pointers = {loaded[key].data_ptr() for key in saved()}
    assert len(pointers) == len(saved()), "two loaded tensors share memory"
    assert not pointers & {t.data_ptr() for t in datas.values() if t.device.type != "meta"}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_target_megatron_accepts_loads_exactly_and_no_data_is_written(
    run: Run, kind: str
) -> None:
    mcore.save(requested(saved()), run, 1)
    datas = targets(BAD[kind])
    before = snapshot(datas)
    loaded = mcore.load(requested(datas), run, 1)
    assert_exact(loaded, datas)
    assert_untouched(datas, before)


@pytest.mark.parametrize("kind", sorted(WRONG))
def test_a_wrong_target_is_refused_by_key_and_no_data_is_written(run: Run, kind: str) -> None:
    mcore.save(requested(saved()), run, 1)
    make, message = WRONG[kind]
    datas = targets(lambda a: make())
    before = snapshot(datas)
    with pytest.raises(ConfigError, match=message):
        mcore.load(requested(datas), run, 1)
    assert_untouched(datas, before)


@pytest.mark.parametrize("kind", ["expanded", "shares-memory"])
def test_megatrons_own_load_through_the_registered_strategy_holds_too(
    run: Run, tmp_path: Path, kind: str
) -> None:
    """``dist_checkpointing.load`` with the registered ckptstore backend: the same strategy."""
    mcore.register(run)
    directory = tmp_path / "iter_0000003"
    directory.mkdir()
    dist_checkpointing.save(requested(saved()), str(directory), sharded_strategy=("ckptstore", 1))
    metadata = json.loads((directory / "metadata.json").read_text())
    metadata["common_backend"] = "ckptstore"
    (directory / "metadata.json").write_text(json.dumps(metadata))
    datas = targets(BAD[kind])
    before = snapshot(datas)
    loaded = dist_checkpointing.load(requested(datas), str(directory))
    assert_exact(loaded, datas)
    assert_untouched(datas, before)
    datas = targets(lambda a: WRONG["dtype"][0]())
    before = snapshot(datas)
    with pytest.raises(ConfigError, match=WRONG["dtype"][1]):
        dist_checkpointing.load(requested(datas), str(directory))
    assert_untouched(datas, before)
