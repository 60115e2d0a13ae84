"""Logical versus stored bytes, per run and overall (``ckptstore du``)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select

from ckptstore.manifest.db import Database
from ckptstore.manifest.models import Blob, Checkpoint, CheckpointBlob, Run, Status


@dataclass(frozen=True, slots=True)
class Usage:
    name: str
    checkpoints: int
    #: Bytes of state the committed checkpoints hold, as if each were stored on its own.
    logical_bytes: int
    #: Raw bytes of the distinct blobs they reference (after deduplication).
    unique_bytes: int
    #: Bytes those blobs occupy in the store (after compression).
    stored_bytes: int

    @property
    def dedup_ratio(self) -> float | None:
        return self.logical_bytes / self.unique_bytes if self.unique_bytes else None

    @property
    def compression_ratio(self) -> float | None:
        return self.unique_bytes / self.stored_bytes if self.stored_bytes else None


def _usage(db: Database, name: str, run_id: int | None) -> Usage:
    committed = select(Checkpoint.id).where(Checkpoint.status == Status.COMMITTED)
    if run_id is not None:
        committed = committed.where(Checkpoint.run_id == run_id)
    with db.read() as session:
        count, logical = session.execute(
            select(func.count(), func.coalesce(func.sum(Checkpoint.logical_bytes), 0)).where(
                Checkpoint.id.in_(committed)
            )
        ).one()
        digests = (
            select(CheckpointBlob.digest)
            .where(CheckpointBlob.checkpoint_id.in_(committed))
            .distinct()
        )
        unique, stored = session.execute(
            select(
                func.coalesce(func.sum(Blob.logical_bytes), 0),
                func.coalesce(func.sum(Blob.stored_bytes), 0),
            ).where(Blob.digest.in_(digests))
        ).one()
    return Usage(name, int(count), int(logical), int(unique), int(stored))


def disk_usage(db: Database) -> tuple[list[Usage], Usage, int]:
    """Per-run usage, the total over committed checkpoints, and every blob row's bytes."""
    with db.read() as session:
        runs = list(session.execute(select(Run.id, Run.name).order_by(Run.name)))
        all_rows = int(session.scalar(select(func.coalesce(func.sum(Blob.stored_bytes), 0))) or 0)
    return [_usage(db, name, rid) for rid, name in runs], _usage(db, "TOTAL", None), all_rows
