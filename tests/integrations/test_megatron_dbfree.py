"""DB-free workers for Megatron (DESIGN.md §12): ``ckpt_megatron.load(sd, run if rank == 0 else
None, store=url)`` and the same form for ``save``. Only rank 0 opens the manifest; it chooses
the checkpoint (falling back past corrupt ones) and hands the other ranks its record and meta.

One spawned job of two gloo ranks (``megatron_dbfree_child.py``) in which rank 1 cannot reach
any database runs the multi-process scenarios; the argument checks and the wire format run in
this process.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from crafted_checkpoints import MEGATRON_LIES, MegatronCheckpoint, Shard, commit_megatron, rows
from lazy_imports import deferred

import ckptstore
from ckptstore import extending
from ckptstore.cas import blob_key
from ckptstore.checkpointer import CheckpointInfo, Run
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ConfigError,
    IntegrityError,
    SaveError,
)
from ckptstore.objectstore import LocalStore
from ckptstore.serialize import read_index

CHILD = Path(__file__).with_name("megatron_dbfree_child.py")
#: Rows of each rank's half of 'w': 1.2 MiB, above the pack threshold, so each half is a chunk
#: blob of its own and only rank 1 reads the second one.
ROWS, COLS = 300, 1024

# Megatron-Core takes seconds to import: on first use, not when pytest collects this module.
ShardedTensor = deferred("megatron.core.dist_checkpointing", "ShardedTensor")
mcore = deferred("ckptstore.integrations.megatron")
choice = deferred("ckptstore.integrations.megatron._choice")


def halves(step: int) -> MegatronCheckpoint:
    """'w' (2*ROWS x COLS) as two shards, each its own blob; values differ per step."""
    top, bottom = rows(ROWS, COLS) + step, rows(ROWS, COLS, start=ROWS) + step
    shape = [2 * ROWS, COLS]
    return MegatronCheckpoint(
        [Shard("w", shape, [0, 0], top), Shard("w", shape, [ROWS, 0], bottom)]
    )


def damage(root: Path, info: CheckpointInfo, path: str) -> str:
    """Flip the last byte of the blob holding ``megatron/rank0``'s entry ``path``; its key."""
    store = LocalStore(root, fsync=False)
    [component] = [c for c in info.components if c.name == "megatron/rank0"]
    digest = read_index(store, component.index_digest).entry(path).segments[0].digest
    key = blob_key(digest)
    data = bytearray((root / key).read_bytes())
    data[-1] ^= 0xFF
    (root / key).write_bytes(bytes(data))
    return key


def spawn(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Run both ranks of the child to completion; their reports."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    text = json.dumps(config)
    procs = [subprocess.Popen([sys.executable, str(CHILD), str(r), text], env=env) for r in (0, 1)]
    try:
        for proc in procs:
            proc.wait(timeout=240)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    reports = []
    for rank in (0, 1):
        path = Path(config["root"]) / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} exited {procs[rank].returncode} without a report"
        reports.append(json.loads(path.read_text()))
        assert "traceback" not in reports[-1], reports[-1]["traceback"]
    return reports


def test_rank1_without_a_database_loads_falls_back_and_saves(tmp_path: Path) -> None:
    store_root, db = tmp_path / "store", tmp_path / "m.db"
    with ckptstore.open_run("dbfree", db=db, store=store_root) as run:
        commit_megatron(run, 1, halves(1))
        key = damage(store_root, commit_megatron(run, 2, halves(2)), "t1")
        commit_megatron(run, 3, MEGATRON_LIES["overlap_hides_a_gap"][0])
    mirror = tmp_path / "mirror"
    shutil.copytree(store_root, mirror)
    config = {
        "root": str(tmp_path),
        "db": str(db),
        "store": str(store_root),
        "mirror": str(mirror),
        "rows": ROWS,
    }
    rank0, rank1 = spawn(config)

    # Rank 1 never tried to reach a database.
    assert rank1["db_attempts"] == []
    # 1. Damage seen only through another store condemns nothing; every rank raises.
    assert rank1["mirror"]["error"] == "IntegrityError"
    assert rank0["mirror"]["error"] == "CkptStoreError"
    assert "rank 1, which reads the store" in rank0["mirror"]["message"]
    assert "Nothing was marked corrupt" in rank0["mirror"]["message"]
    assert rank0["after_mirror"] == {"1": "committed", "2": "committed", "3": "corrupt"}
    # 2. Rank 0 skips step 4 (its layout lies), rank 1 finds step 2 damaged: both load step 1.
    assert rank0["fallback"] == rank1["fallback"] == {"error": None}
    assert rank0["fallback_w"] is True
    assert rank1["fallback_w"] is True
    assert rank0["after_fallback"] == {
        "1": "committed",
        "2": "corrupt",
        "3": "corrupt",
        "4": "corrupt",
    }
    assert not (store_root / key).exists()  # quarantined by rank 0
    assert (mirror / key).exists()  # the mirror was only read
    # 3. Saves with rank 1 holding only the store, loaded back bit-exact.
    assert rank0["save5"] == rank1["save5"] == {"error": None}
    assert rank0["saved"] == {"5": "committed", "6": "committed"}
    for report in (rank0, rank1):
        for check in ("newest_model", "newest_objects", "step5_model", "step5_objects"):
            assert report[check], (check, report)
    with ckptstore.open_run("dbfree", db=db, store=store_root, writable=False) as reader:
        names = sorted(c.name for c in reader.checkpoint(6).components)
    assert "megatron/rank1" in names
    # 4. A rank with neither a run nor a store fails every rank, naming it.
    for report in (rank0, rank1):
        assert report["arguments"]["error"] == "ConfigError"
        assert "rank 1: no run and no store" in report["arguments"]["message"]


# -- in this process (a world of one) -------------------------------------------------------------


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def run(tmp_path: Path, world_of_one: None) -> Iterator[Run]:
    with ckptstore.open_run("solo", db=tmp_path / "m.db", store=tmp_path / "store") as opened:
        yield opened


def wanted() -> dict[str, Any]:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((2 * ROWS, COLS), -7.0))}


def test_rank0_without_a_run_is_refused(run: Run) -> None:
    commit_megatron(run, 1, halves(1))
    with pytest.raises(ConfigError, match="rank 0: rank 0 chooses the checkpoint to load"):
        mcore.load(wanted(), None, store=run.store)
    with pytest.raises(ConfigError, match="rank 0 chooses"):
        mcore.load(wanted(), None, store=str(run.store.root))


def test_a_rank_without_run_or_store_is_refused(world_of_one: None) -> None:
    with pytest.raises(ConfigError, match="rank 0 chooses the checkpoint"):
        mcore.load(wanted(), None)
    with pytest.raises(ConfigError, match="no run and no store"):
        mcore.save(wanted(), None, 1)


def test_a_run_and_another_store_are_refused(run: Run, tmp_path: Path) -> None:
    other = LocalStore(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"store=file://.*/other is not the run's store"):
        mcore.load(wanted(), run, store=other)
    with pytest.raises(ConfigError, match="is not the run's store"):
        mcore.save(wanted(), run, 1, store=str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="the target is already a store"):
        mcore.save(wanted(), run.store, 1, store=run.store)
    with pytest.raises(ConfigError, match="run is a LocalStore"):
        mcore.load(wanted(), run.store)
    assert run.checkpoints() == []


def test_rank0_with_its_run_and_the_same_store_url_loads(run: Run) -> None:
    commit_megatron(run, 1, halves(1))
    commit_megatron(run, 2, halves(2))
    url = str(run.store.root)
    loaded = mcore.load(wanted(), run, store=url)
    assert torch.equal(loaded["w"], rows(2 * ROWS, COLS) + 2)
    loaded = mcore.load(wanted(), run, 1, store=run.store)
    assert torch.equal(loaded["w"], rows(2 * ROWS, COLS) + 1)
    with pytest.raises(CheckpointNotFoundError):
        mcore.load(wanted(), run, 7, store=url)


def test_rank0_given_only_a_store_commits_nothing(run: Run) -> None:
    with pytest.raises(SaveError, match="rank 0 commits and needs a writable Run"):
        mcore.save(wanted(), None, 1, store=run.store)
    assert run.checkpoints() == []


def test_the_checkpoint_record_crosses_as_json_unchanged(run: Run) -> None:
    info = run.save(
        3, {"x": torch.arange(4)}, training_info={"iteration": 3}, metrics={"loss": 0.5}
    ).wait()
    assert isinstance(info.committed_at, dt.datetime)
    sent = json.loads(json.dumps(extending.checkpoint_info_to_json(info)))
    assert extending.checkpoint_info_from_json(sent, what="rank 0's choice") == info


def test_rank0s_errors_cross_with_their_type() -> None:
    sent = json.loads(json.dumps(choice.error_to_json(CheckpointNotFoundError("no step 9"))))
    received = choice.error_from_json(sent)
    assert type(received) is CheckpointNotFoundError
    assert "on rank 0" in str(received)
    assert "no step 9" in str(received)
    assert type(choice.error_from_json(choice.error_to_json(IntegrityError("x")))) is (
        IntegrityError
    )
    other = choice.error_from_json(choice.error_to_json(OSError("disk")))
    assert type(other) is CkptStoreError
    assert "OSError: disk" in str(other)
