"""The checkpointer across processes and transactions, on SQLite and PostgreSQL.

- a writer SIGKILLed between upload and commit leaves nothing visible;
- several processes commit to different runs of one database at once;
- shard workers (spawned processes) store components and the controller commits their receipts;
- a commit racing another transaction that stores the same blob.

Worker functions are module-level so that spawned processes can import them; one spawn pool
serves the whole module (each process imports torch once).
"""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Any

import pytest
import torch
from pg_waits import wait_for_a_lock_waiter
from sqlalchemy import insert, select

from ckptstore.cas.blobs import put_blob
from ckptstore.cas.digest import blob_key
from ckptstore.cas.header import Kind
from ckptstore.checkpointer import Run, ShardReceipt, ShardWriter, open_run
from ckptstore.manifest.models import BlobRow, CheckpointBlobRow, utcnow
from ckptstore.objectstore import LocalStore
from ckptstore.serialize.compare import first_difference

WORKERS = 4


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Components bit-exact (a load returns components in name order, not save order)."""
    assert sorted(actual) == sorted(expected)
    for name, state in expected.items():
        diff = first_difference(actual[name], state, name)
        assert diff is None, diff


def statuses(run: Run) -> list[tuple[int, str]]:
    return [(c.step, c.status) for c in run.checkpoints()]


def referenced(run: Run, checkpoint_id: int) -> set[str]:
    with run.db.read() as session:
        return set(
            session.scalars(
                select(CheckpointBlobRow.digest).where(
                    CheckpointBlobRow.checkpoint_id == checkpoint_id
                )
            )
        )


@pytest.fixture(scope="module")
def spawn_pool() -> Iterator[ProcessPoolExecutor]:
    with ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


@pytest.fixture(scope="module")
def manager() -> Iterator[SyncManager]:
    """Shares a barrier with pool workers (they start at different times)."""
    with multiprocessing.get_context("spawn").Manager() as sync:
        yield sync


# -- 2. a writer killed between upload and commit --------------------------------------------------

CRASHING_WRITER = textwrap.dedent(
    '''
    """Commit step 1, then die (SIGKILL) right after the index blob of step 2 is stored."""
    import os
    import signal
    import sys

    import torch

    from ckptstore.cas.header import Kind, decode_header
    from ckptstore.checkpointer import open_run
    from ckptstore.objectstore import LocalStore


    class KillAfterIndexStore(LocalStore):
        armed = False

        def put(self, key, data):
            created = super().put(key, data)
            if self.armed:
                parts = [data] if isinstance(data, bytes | bytearray | memoryview) else data
                whole = memoryview(b"".join(bytes(p) for p in parts))
                if decode_header(whole, key).kind is Kind.INDEX:
                    os.kill(os.getpid(), signal.SIGKILL)
            return created


    def state(seed):
        gen = torch.Generator().manual_seed(seed)
        return {
            "policy": {
                "w": torch.randn(300_000, generator=gen),
                "b": torch.randn(64, generator=gen),
            },
            "dataloader": {"position": seed * 10, "epoch": 0},
        }


    db_url, store_root, expected_path = sys.argv[1:4]
    store = KillAfterIndexStore(store_root)
    run = open_run("crashy", db=db_url, store=store)
    first = state(1)
    run.save(1, first).wait()
    torch.save(first, expected_path)
    store.armed = True
    run.save(2, state(2)).wait()
    sys.exit("still alive: the store should have killed this process before the commit")
    '''
)


def test_writer_killed_between_upload_and_commit(
    db_url: str, store: LocalStore, tmp_path: Path
) -> None:
    script = tmp_path / "crashing_writer.py"
    script.write_text(CRASHING_WRITER)
    expected_path = tmp_path / "step1.pt"
    child = subprocess.run(
        [sys.executable, str(script), db_url, str(store.root), str(expected_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    expected = torch.load(expected_path, weights_only=True)

    with open_run("crashy", db=db_url, store=store) as run:
        latest = run.latest()
        assert latest is not None
        assert latest.step == 1
        loaded = run.load()
        assert loaded.info.step == 1
        assert_same(loaded.state, expected)

        rows = run.checkpoints()
        # Opening the run as the new writer marked the dead writer's pending row failed.
        assert [(c.step, c.status) for c in rows] == [(1, "committed"), (2, "failed")]
        pending = rows[1]
        assert pending.error is not None
        assert "abandoned" in pending.error
        assert pending.components == ()
        assert referenced(run, pending.id) == set()
        # Step 2's blobs reached the store but nothing references them: they are GC's.
        stored = {info.key for info in store.list("cas/")}
        committed = {blob_key(d) for d in referenced(run, rows[0].id)}
        assert committed < stored

        # The new job carries on and commits its own step 2.
        redone = {"policy": {"w": torch.zeros(10)}, "dataloader": {"position": 20, "epoch": 0}}
        info = run.save(2, redone).wait()
        assert info.writer_epoch > pending.writer_epoch
        latest = run.latest()
        assert latest is not None
        assert (latest.step, latest.id) == (2, info.id)
        assert_same(run.load().state, redone)
        assert statuses(run) == [(1, "committed"), (2, "failed"), (2, "committed")]


# -- 6. concurrent writers to different runs of one database ---------------------------------------


def _worker_state(seed: int, step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    return {
        "policy": {"w": torch.randn(16_384, generator=gen), "b": torch.randn(32, generator=gen)},
        "trainer": {"step": step, "seed": seed},
    }


def _commit_steps(
    db_url: str, store_root: str, name: str, seed: int, steps: int, start: Any
) -> int:
    """Commit ``steps`` checkpoints to run ``name`` (in a spawned process); returns the latest."""
    start.wait(timeout=120)  # a barrier: all workers begin together
    with open_run(name, db=db_url, store=store_root) as run:
        for step in range(1, steps + 1):
            run.save(step, _worker_state(seed, step), metrics={"reward": seed + step / 100})
        run.finalize()
        latest = run.latest()
    assert latest is not None
    return latest.step


def test_concurrent_commits_to_different_runs(
    db_url: str, store: LocalStore, spawn_pool: ProcessPoolExecutor, manager: SyncManager
) -> None:
    open_run("warmup", db=db_url, store=store).close()  # schema created once, up front
    steps = 6
    start = manager.Barrier(WORKERS)
    futures = {
        seed: spawn_pool.submit(
            _commit_steps, db_url, str(store.root), f"worker-{seed}", seed, steps, start
        )
        for seed in range(WORKERS)
    }
    assert {seed: f.result(timeout=120) for seed, f in futures.items()} == dict.fromkeys(
        range(WORKERS), steps
    )
    for seed in range(WORKERS):
        with open_run(f"worker-{seed}", db=db_url, store=store, writable=False) as run:
            assert statuses(run) == [(step, "committed") for step in range(1, steps + 1)]
            latest = run.latest()
            assert latest is not None
            assert latest.step == steps
            assert latest.metrics == {"reward": seed + steps / 100}
            assert_same(run.load().state, _worker_state(seed, steps))
            assert_same(run.load(step=3).state, _worker_state(seed, 3))


# -- 7. shard workers ------------------------------------------------------------------------------


def _shard_state(rank: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(500 + rank)
    return {
        "layers.0.weight": torch.randn(256, 1024, generator=gen),  # 1 MiB: chunked
        "layers.0.bias": torch.randn(256, generator=gen).to(torch.bfloat16),  # packed
        "rank": rank,
    }


def _write_shard(store_root: str, component: str, rank: int) -> ShardReceipt:
    """A worker process: store one shard, hand back the receipt (no database access)."""
    with ShardWriter(store_root) as writer:
        return writer.write(component, _shard_state(rank))


def test_shards_written_by_worker_processes_commit_together(
    db_url: str, store: LocalStore, spawn_pool: ProcessPoolExecutor
) -> None:
    def write_shards() -> list[ShardReceipt]:
        futures = [
            spawn_pool.submit(_write_shard, str(store.root), f"policy/rank{rank}", rank)
            for rank in (0, 1)
        ]
        return [f.result(timeout=120) for f in futures]

    optimizer = {"step": torch.tensor(5), "lr": 1e-4}
    expected = {
        "policy/rank0": _shard_state(0),
        "policy/rank1": _shard_state(1),
        "optimizer": optimizer,
    }
    with open_run("sharded", db=db_url, store=store) as run:
        receipts = write_shards()
        assert all(r.uploaded_bytes > 0 for r in receipts)
        info = run.save(5, {"optimizer": optimizer}, receipts=receipts).wait()
        assert {c.name for c in info.components} == set(expected)
        assert info.logical_bytes == sum(r.result.logical_bytes for r in receipts) + sum(
            c.logical_bytes for c in info.components if c.name == "optimizer"
        )
        assert info.uploaded_bytes >= sum(r.uploaded_bytes for r in receipts)

        # The same shards again: the workers find every blob stored, nothing is uploaded.
        again = run.save(6, {"optimizer": optimizer}, receipts=write_shards()).wait()
        assert again.uploaded_bytes < 0.01 * again.logical_bytes

    with open_run("sharded", db=db_url, store=store, writable=False) as run:
        loaded = run.load()
        assert loaded.info.step == 6
        assert_same(loaded.state, expected)
        assert_same(run.load(step=5).state, expected)
        one = run.load(components=["policy/rank1"])
        assert_same(one.state, {"policy/rank1": _shard_state(1)})


# -- a commit racing another transaction that stores the same blob ---------------------------------


def test_commit_survives_a_concurrent_commit_of_the_same_blob(
    db_url: str, store: LocalStore
) -> None:
    shared = torch.randn(300_000, generator=torch.Generator().manual_seed(3))  # one chunk
    state = {"policy": {"w": shared}}
    with open_run("racer", db=db_url, store=store) as run:
        # Another run's writer stored the same (new) blob and its commit, which claims the
        # blob, is still in its transaction.
        ref = put_blob(store, shared.numpy().tobytes(), Kind.CHUNK, itemsize=4, float_like=True)
        assert ref.uploaded
        with run.db.engine.connect() as other:
            other.execute(
                insert(BlobRow).values(
                    digest=ref.digest,
                    kind="chunk",
                    logical_bytes=ref.logical_bytes,
                    stored_bytes=ref.stored_bytes,
                    codec=ref.codec,
                    created_at=utcnow(),
                    last_claimed_at=utcnow(),
                    state="live",
                )
            )
            handle = run.save(1, state)
            if run.db.is_sqlite:
                time.sleep(0.3)  # the save waits for SQLite's write lock meanwhile
            else:
                wait_for_a_lock_waiter(run.db.engine, "the commit never reached the blob insert")
            other.commit()
        info = handle.wait(timeout=60)
        assert info.status == "committed"
        assert_same(run.load().state, state)
        assert ref.digest in referenced(run, info.id)
