"""Durability comes before the commit: a save flushes what it wrote (one batched flush) before
the transaction that makes the checkpoint visible, and a ShardWriter flushes before it hands
out receipts (DESIGN.md §7)."""

from __future__ import annotations

from pathlib import Path

import torch
from sqlalchemy import create_engine, text

from ckptstore.cas import blob_key
from ckptstore.checkpointer import ShardWriter, open_run
from ckptstore.objectstore import LocalStore


class RecordingStore(LocalStore):
    """A real LocalStore that records, at every flush, the run's checkpoint statuses."""

    def __init__(self, root: Path, db: Path) -> None:
        super().__init__(root)
        self.db = db
        self.seen: list[list[tuple[int, str]]] = []
        #: The files each flush was to make durable.
        self.flushed: list[set[Path]] = []

    def flush(self) -> None:
        engine = create_engine(f"sqlite:///{self.db}")
        try:
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT step, status FROM checkpoints ORDER BY id"))
                self.seen.append([(r.step, r.status) for r in rows])
        finally:
            engine.dispose()
        self.flushed.append(set(self._unsynced))
        super().flush()


def test_a_save_flushes_before_its_commit(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    store = RecordingStore(tmp_path / "s", db)
    with open_run("r", db=db, store=store, async_save=False) as run:
        run.save(1, {"w": {"t": torch.ones(8)}})
        run.save(2, {"w": {"t": torch.zeros(8)}})
    # At each flush the save's row exists and is still pending: nothing visible yet.
    assert store.seen == [[(1, "pending")], [(1, "committed"), (2, "pending")]]
    # ... and the flush covers every object the save references.
    engine = create_engine(f"sqlite:///{db}")
    try:
        with engine.connect() as conn:
            for step in (1, 2):
                digests = conn.execute(
                    text(
                        "SELECT b.digest FROM checkpoint_blobs b JOIN checkpoints c "
                        "ON c.id = b.checkpoint_id WHERE c.step = :step"
                    ),
                    {"step": step},
                ).scalars()
                files = {store.root / blob_key(d) for d in digests}
                assert files
                assert files <= store.flushed[step - 1], step
    finally:
        engine.dispose()


def test_shard_receipts_come_after_the_flush(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    with open_run("r", db=db, store=tmp_path / "s"):
        pass  # the database exists, with no checkpoint
    store = RecordingStore(tmp_path / "s", db)
    with ShardWriter(store) as writer:
        pending = writer.save({"policy": {"w": torch.ones(8)}})
        receipts = pending.receipts()
        assert store.seen == [[]]  # flushed once, before the receipts were handed out
        referenced = {store.root / blob_key(b.digest) for r in receipts for b in r.result.blobs}
        assert referenced
        assert referenced <= store.flushed[0]
        writer.write("optimizer", {"m": torch.ones(2)})
        assert len(store.seen) == 2
    with open_run("r", db=db, store=store, async_save=False) as run:
        run.save(1, receipts=receipts)
