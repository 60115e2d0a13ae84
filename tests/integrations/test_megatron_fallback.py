"""``ckpt_megatron.load`` of the newest checkpoint falls back past one that fails, as
``ckpt_dcp.load`` does: metadata that rank 0 finds wrong before anything is loaded, or data a
rank finds damaged while loading. A writer marks the failed checkpoint corrupt (quarantining a
damaged blob, never a healthy one); a reader only reports; every rank loads the same step.

The checkpoints are committed through the public API (crafted_checkpoints.py). The loads run in
this process in a gloo world of one, and once (slow) in two spawned ranks where only rank 1
reads the damaged blob.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from crafted_checkpoints import MEGATRON_LIES, MegatronCheckpoint, Shard, commit_megatron, rows
from lazy_imports import deferred

import ckptstore
from ckptstore.cas import blob_key
from ckptstore.checkpointer import CheckpointInfo, Run
from ckptstore.errors import CheckpointNotFoundError, IntegrityError
from ckptstore.objectstore import LocalStore
from ckptstore.serialize import read_index

# Megatron-Core takes seconds to import: on first use, not when pytest collects this module.
ShardedTensor = deferred("megatron.core.dist_checkpointing", "ShardedTensor")
mcore = deferred("ckptstore.integrations.megatron")

#: Rows of each shard of 'w' in the damaged-data cases: 1.2 MiB, above the pack threshold, so
#: each shard is a chunk blob of its own.
ROWS, COLS = 300, 1024


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def paths(tmp_path: Path) -> tuple[Path, LocalStore]:
    return tmp_path / "m.db", LocalStore(tmp_path / "store", fsync=False)


@pytest.fixture
def run(paths: tuple[Path, LocalStore], world_of_one: None) -> Iterator[Run]:
    db, store = paths
    with ckptstore.open_run("lies", db=db, store=store) as opened:
        yield opened


def truthful(run: Run, step: int) -> CheckpointInfo:
    return commit_megatron(
        run, step, MegatronCheckpoint([Shard("w", [256, 64], [0, 0], rows(256))])
    )


def wanted(shape: tuple[int, ...] = (256, 64)) -> dict[str, Any]:
    """A sharded state dict asking for all of tensor 'w' (filled with a sentinel)."""
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full(shape, -7.0))}


def halves(step: int) -> MegatronCheckpoint:
    """'w' (2*ROWS x COLS) as two shards, each its own blob; values differ per step."""
    top, bottom = rows(ROWS, COLS) + step, rows(ROWS, COLS, start=ROWS) + step
    shape = [2 * ROWS, COLS]
    return MegatronCheckpoint(
        [Shard("w", shape, [0, 0], top), Shard("w", shape, [ROWS, 0], bottom)]
    )


def damage_shard(store: LocalStore, info: CheckpointInfo, path: str) -> str:
    """Flip the last byte of the blob holding entry ``path`` of ``megatron/rank0``; its key."""
    [component] = [c for c in info.components if c.name == "megatron/rank0"]
    digest = read_index(store, component.index_digest).entry(path).segments[0].digest
    key = blob_key(digest)
    data = bytearray((store.root / key).read_bytes())
    data[-1] ^= 0xFF
    (store.root / key).write_bytes(bytes(data))
    return key


def statuses(run: Run) -> dict[int, str]:
    return {c.step: c.status for c in run.checkpoints()}


def objects(store: LocalStore) -> dict[str, bytes]:
    return {info.key: (store.root / info.key).read_bytes() for info in store.list("")}


@pytest.mark.parametrize("case", list(MEGATRON_LIES))
def test_the_newest_checkpoint_with_a_lying_layout_is_skipped_and_marked(
    run: Run, paths: tuple[Path, LocalStore], case: str
) -> None:
    truthful(run, 1)
    commit_megatron(run, 2, MEGATRON_LIES[case][0])
    before = objects(paths[1])
    loaded = mcore.load(wanted(), run)
    assert torch.equal(loaded["w"], rows(256))
    assert statuses(run) == {1: "committed", 2: "corrupt"}
    [corrupt] = [c for c in run.checkpoints() if c.step == 2]
    assert "tensor 'w'" in (corrupt.error or "")
    assert objects(paths[1]) == before  # healthy blobs: nothing quarantined or moved


def test_a_reader_falls_back_too_and_marks_nothing(
    run: Run, paths: tuple[Path, LocalStore], caplog: pytest.LogCaptureFixture
) -> None:
    truthful(run, 1)
    commit_megatron(run, 2, MEGATRON_LIES["overlap_hides_a_gap"][0])
    db, store = paths
    with (
        ckptstore.open_run("lies", db=db, store=store, writable=False) as reader,
        caplog.at_level(logging.ERROR, logger="ckptstore"),
    ):
        loaded = mcore.load(wanted(), reader)
    assert torch.equal(loaded["w"], rows(256))
    assert statuses(run) == {1: "committed", 2: "committed"}
    assert any("was NOT marked corrupt" in r.getMessage() for r in caplog.records)


def test_without_fallback_the_lying_layout_is_raised_and_nothing_marked(run: Run) -> None:
    truthful(run, 1)
    commit_megatron(run, 2, MEGATRON_LIES["claims_2_to_the_40_rows"][0])
    with pytest.raises(IntegrityError, match="run 'lies', step 2: tensor 'w'") as caught:
        mcore.load(wanted(), run, fallback=False)
    assert caught.value.digest is None
    assert statuses(run) == {1: "committed", 2: "committed"}


def test_no_checkpoint_left_after_skipping_names_the_skipped_steps(run: Run) -> None:
    commit_megatron(run, 1, MEGATRON_LIES["overlap_hides_a_gap"][0])
    commit_megatron(run, 2, MEGATRON_LIES["claims_2_to_the_40_rows"][0])
    with pytest.raises(CheckpointNotFoundError, match=r"skipped corrupt steps \[2, 1\]"):
        mcore.load(wanted(), run)
    assert statuses(run) == {1: "corrupt", 2: "corrupt"}


def test_damaged_data_of_the_newest_checkpoint_falls_back_and_quarantines_the_blob(
    run: Run, paths: tuple[Path, LocalStore]
) -> None:
    store = paths[1]
    commit_megatron(run, 1, halves(1))
    key = damage_shard(store, commit_megatron(run, 2, halves(2)), "t1")
    loaded = mcore.load(wanted((2 * ROWS, COLS)), run)
    assert torch.equal(loaded["w"], rows(2 * ROWS, COLS) + 1)
    assert statuses(run) == {1: "committed", 2: "corrupt"}
    assert not (store.root / key).exists()
    assert [i.key for i in store.list("quarantine/")] != []


#: One rank of the two-rank case: loads its half of 'w' (TP=2) from the newest checkpoint and
#: leaves what it loaded (or its traceback) as JSON.
RANK = textwrap.dedent(
    """
    import json, pathlib, sys, traceback, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist
    import ckptstore
    from megatron.core.dist_checkpointing import ShardedTensor
    from ckptstore.integrations import megatron as mcore

    rank, root, rows = int(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
    report = {}
    try:
        rendezvous = f"file://{root / 'rendezvous'}"
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=rendezvous)
        store = ckptstore.LocalStore(root / "store", fsync=False)
        run = ckptstore.open_run("lies", db=root / "m.db", store=store, writable=rank == 0)
        half = ShardedTensor.from_rank_offsets("w", torch.zeros(rows, 1024), (0, rank, 2))
        loaded = mcore.load({"w": half}, run)
        report["w"] = loaded["w"][:, 0].tolist()
        run.close()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        report["traceback"] = traceback.format_exc()
    (root / f"rank{rank}.json").write_text(json.dumps(report))
    """
)


@pytest.mark.slow
def test_two_ranks_agree_to_fall_back_when_only_one_finds_damage(
    run: Run, paths: tuple[Path, LocalStore]
) -> None:
    """Step 3's layout lies (rank 0 skips it before loading); step 2's second shard is damaged,
    which only rank 1 reads: both ranks load step 1."""
    db, store = paths
    commit_megatron(run, 1, halves(1))
    key = damage_shard(store, commit_megatron(run, 2, halves(2)), "t1")
    commit_megatron(run, 3, MEGATRON_LIES["overlap_hides_a_gap"][0])
    root = db.parent
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen([sys.executable, "-c", RANK, str(r), str(root), str(ROWS)], env=env)
        for r in range(2)
    ]
    try:
        for proc in procs:
            proc.wait(timeout=240)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    expected = rows(2 * ROWS, COLS)[:, 0] + 1
    for rank in range(2):
        report = json.loads((root / f"rank{rank}.json").read_text())
        assert "traceback" not in report, report["traceback"]
        assert report["w"] == expected[rank * ROWS : (rank + 1) * ROWS].tolist()
    assert statuses(run) == {1: "committed", 2: "corrupt", 3: "corrupt"}
    assert not (store.root / key).exists()
