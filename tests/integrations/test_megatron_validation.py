"""Megatron checkpoints whose layout lies are refused before anything is allocated or read, and
the private directories of a killed rank are cleaned up by the next save.

The lying checkpoints are committed through the public API (crafted_checkpoints.py): healthy
blobs, valid digests, a wrong ``megatron/meta`` layout. Saves and loads run in this process, in
a gloo world of one; the killed ranks are child processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from crafted_checkpoints import (
    MEGATRON_LIES,
    MegatronCheckpoint,
    Shard,
    commit_megatron,
    nested,
    rows,
)
from lazy_imports import deferred

import ckptstore
from ckptstore.checkpointer import Run
from ckptstore.errors import IntegrityError

# Megatron-Core takes seconds to import: on first use, not when pytest collects this module.
ShardedTensor = deferred("megatron.core.dist_checkpointing", "ShardedTensor")
mcore = deferred("ckptstore.integrations.megatron")


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def run(tmp_path: Path, world_of_one: None) -> Iterator[Run]:
    with ckptstore.open_run("lies", db=tmp_path / "m.db", store=tmp_path / "store") as opened:
        yield opened


def wanted(shape: tuple[int, ...] = (256, 64)) -> dict[str, Any]:
    """A sharded state dict asking for all of tensor 'w' (filled with a sentinel)."""
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full(shape, -7.0))}


# -- a layout that lies -------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(MEGATRON_LIES))
def test_load_refuses_a_layout_that_lies(run: Run, case: str) -> None:
    checkpoint, needle = MEGATRON_LIES[case]
    commit_megatron(run, 1, checkpoint)
    with pytest.raises(IntegrityError) as caught:
        mcore.load(wanted(), run, 1)
    message = str(caught.value)
    assert message.startswith("run 'lies', step 1: tensor 'w'"), message
    assert needle in message, message
    assert "the checkpoint's metadata is wrong" in message, message
    assert caught.value.digest is None


def test_consolidation_refuses_a_layout_that_lies_before_allocating(run: Run) -> None:
    checkpoint, _ = MEGATRON_LIES["claims_2_to_the_40_rows"]
    info = commit_megatron(run, 1, checkpoint)
    with pytest.raises(IntegrityError, match="tensor 'w'"):
        mcore.iter_full_tensors(run.store, info)


def test_load_refuses_a_layout_nested_100000_deep(run: Run) -> None:
    shard = Shard("w", [128, 64], [0, 0], rows(128))
    commit_megatron(run, 1, MegatronCheckpoint([shard], layout_text=nested(100_000)))
    with pytest.raises(IntegrityError, match="nested deeper than any writer") as caught:
        mcore.load(wanted((128, 64)), run, 1)
    assert caught.value.digest is None


# -- private directories of killed ranks ------------------------------------------------------

#: A process that makes a private directory as a Megatron save does, puts a file in it (as
#: Megatron puts metadata.json), says so, and waits to be killed.
HOLDER = textwrap.dedent(
    """
    import pathlib, sys, time
    from ckptstore.integrations.megatron import _scratch as scratch
    directory = pathlib.Path(scratch.private_dir("save"))
    (directory / "metadata.json").write_text("{}")
    pathlib.Path(sys.argv[1]).write_text(str(directory))
    time.sleep(600)
    """
)


def hold_a_private_dir(tmp: Path, ready: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """A holder process, once its directory exists, and that directory."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(ready)], env=env)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, f"the holder exited {proc.returncode}"
        assert time.monotonic() < deadline, "the holder never made its directory"
        time.sleep(0.05)
    return proc, Path(ready.read_text())


def test_a_killed_ranks_private_dir_is_removed_by_the_next_save_a_live_ones_is_not(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    killed, killed_dir = hold_a_private_dir(tmp, tmp_path / "killed")
    alive, alive_dir = hold_a_private_dir(tmp, tmp_path / "alive")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert killed_dir.is_dir()  # nobody cleaned up after it
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        mcore.save({"w": ShardedTensor.from_rank_offsets("w", rows(4, 4)), "it": 3}, run, 1)
        assert not killed_dir.exists()
        assert (alive_dir / "metadata.json").exists()
        # the save's own directory is gone too (other libraries' temp files, e.g. those wandb
        # makes when Megatron-Core imports it, are not ours to judge)
        assert sorted(tmp.glob("ckptstore-megatron-*")) == [alive_dir]
    finally:
        alive.kill()
        alive.wait(timeout=30)
    loaded = mcore.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4))}, run, 1)
    assert torch.equal(loaded["w"], rows(4, 4))
    assert loaded["it"] == 3


@pytest.mark.slow
def test_a_rank_killed_inside_a_real_save_leaves_no_common_state_and_is_cleaned_up(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real Megatron save (in a child process) stalls in its upload and is SIGKILLed: its
    private directory holds no common.pt (the pickled common state), and the next save
    removes it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    ready = tmp_path / "stalled"
    child = textwrap.dedent(
        """
        import pathlib, sys, time, warnings
        warnings.simplefilter("ignore")
        import torch, torch.distributed as dist
        import ckptstore
        from ckptstore.objectstore import LocalStore
        from megatron.core.dist_checkpointing import ShardedTensor
        from ckptstore.integrations import megatron as mcore

        class StalledStore(LocalStore):
            def put(self, key, data):  # the upload hangs, as on a dead network
                pathlib.Path(sys.argv[2]).write_text("stalled")
                time.sleep(600)

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        root = pathlib.Path(sys.argv[1])
        run = ckptstore.open_run("stalled", db=root / "m.db", store=StalledStore(root / "s"))
        state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 4)), "secret": 42}
        mcore.save(state, run, 1)
        """
    )
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-c", child, str(tmp_path), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert proc.poll() is None, f"the child exited {proc.returncode}"
            assert time.monotonic() < deadline, "the child's save never reached its upload"
            time.sleep(0.2)
        # Only the save's own directory is ours to judge: Megatron-Core imports wandb, which
        # (0.31 on) makes temporary directories of its own at import, left by the SIGKILL.
        left = sorted(tmp.glob("ckptstore-megatron-*"))
        assert len(left) == 1
        assert not (left[0] / "common.pt").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert left[0].is_dir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    mcore.save({"w": ShardedTensor.from_rank_offsets("w", rows(4, 4))}, run, 1)
    assert sorted(tmp.glob("ckptstore-megatron-*")) == []
