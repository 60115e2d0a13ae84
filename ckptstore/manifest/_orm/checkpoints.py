"""Checkpoint rows: the pending row, status changes (commit, fail, delete, corrupt, repair)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from ckptstore.errors import RunStateError
from ckptstore.manifest._orm import blobs
from ckptstore.manifest._orm.blobs import BlobFacts, blob_rows, condemn_blob_row, revive_blob_rows
from ckptstore.manifest._orm.runs import hold_gc_lock_exclusive
from ckptstore.manifest._sql.tables import BATCH
from ckptstore.manifest.models import BlobRow, CheckpointBlobRow, CheckpointRow, Status, utcnow
from ckptstore.manifest.records import BlobClaim, ComponentInfo


def insert_pending(session: Session, run_id: int, step: int, epoch: int, trigger: str) -> int:
    """Insert a pending checkpoint row; returns its id."""
    row = CheckpointRow(
        run_id=run_id, step=step, writer_epoch=epoch, trigger=trigger, status=Status.PENDING
    )
    session.add(row)
    session.flush()
    return row.id


def set_status(
    session: Session,
    checkpoint_id: int,
    status: Status,
    error: str | None,
    *,
    only_if: Status | None = None,
) -> bool:
    """Set a checkpoint's status (if it is ``only_if``, when given); True if it changed."""
    condition = [CheckpointRow.id == checkpoint_id]
    if only_if is not None:
        condition.append(CheckpointRow.status == only_if)
    result = session.execute(
        update(CheckpointRow)
        .where(*condition)
        .values(status=status, error=(error or "")[:4000] or None)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0))


def corrupt_and_condemn(
    session: Session, checkpoint_id: int, reason: str, digests: Iterable[str]
) -> None:
    """The one mark-corrupt transaction body (load fallback and verify): the checkpoint becomes
    corrupt and its damaged blobs are condemned, with commits held off (GC lock exclusive) so
    no commit trusts a damaged object between this and the caller's quarantine of it.

    Corrupt is recoverable: the checkpoint's rows stay, GC keeps its blobs, and
    :func:`restore_committed` brings it back once every blob verifies again."""
    hold_gc_lock_exclusive(session)
    set_status(session, checkpoint_id, Status.CORRUPT, reason)
    for digest in digests:
        condemn_blob_row(session, digest)


def restore_committed(session: Session, checkpoint_id: int, digests: Sequence[str]) -> str | None:
    """A corrupt checkpoint whose blobs all verified again becomes committed (or deleted, if a
    newer save of the same step was committed meanwhile); its condemned blob rows are live
    again. Returns the new status, or None if it is no longer corrupt or a row is missing."""
    hold_gc_lock_exclusive(session)
    row = session.get(CheckpointRow, checkpoint_id, with_for_update=True)
    if row is None or row.status != Status.CORRUPT:
        return None
    rows = blob_rows(session, list(digests))
    if len(rows) != len(set(digests)):
        return None
    now = revive_blob_rows(session, digests)
    newer = session.scalar(
        select(CheckpointRow.id).where(
            CheckpointRow.run_id == row.run_id,
            CheckpointRow.step == row.step,
            CheckpointRow.status == Status.COMMITTED,
            CheckpointRow.id != row.id,
        )
    )
    status = Status.DELETED if newer is not None else Status.COMMITTED
    note = f"repaired: every blob verified again at {now:%Y-%m-%d %H:%M:%S} UTC"
    if newer is not None:
        note += f"; superseded by checkpoint {newer} of the same step"
    row.status = status
    row.error = f"{note} (was: {row.error})"[:4000] if row.error else note
    return status


def delete_corrupt(session: Session) -> list[int]:
    """Every corrupt checkpoint becomes deleted: its owner gave up on repairing it, so GC may
    take its blobs and ``verify`` stops reporting it. Returns their ids."""
    hold_gc_lock_exclusive(session)
    rows = list(
        session.scalars(
            select(CheckpointRow).where(CheckpointRow.status == Status.CORRUPT).with_for_update()
        )
    )
    for row in rows:
        note = f"released by gc --release-corrupt at {utcnow():%Y-%m-%d %H:%M:%S} UTC"
        row.status = Status.DELETED
        row.error = f"{note} (was: {row.error})"[:4000] if row.error else note
    return [row.id for row in rows]


def supersede_step(session: Session, checkpoint_id: int) -> list[int]:
    """Saving a step again replaces it: older committed (or local) checkpoints of the same run
    and step become deleted (their blobs go to GC unless shared), in the commit's
    transaction."""
    row = session.get(CheckpointRow, checkpoint_id)
    assert row is not None
    older = list(
        session.scalars(
            select(CheckpointRow.id).where(
                CheckpointRow.run_id == row.run_id,
                CheckpointRow.step == row.step,
                CheckpointRow.status.in_([Status.COMMITTED.value, Status.LOCAL.value]),
                CheckpointRow.id != checkpoint_id,
            )
        )
    )
    if older:
        session.execute(
            update(CheckpointRow)
            .where(CheckpointRow.id.in_(older))
            .values(
                status=Status.DELETED,
                error=f"superseded by checkpoint {checkpoint_id}, a newer save of step {row.step}",
            )
            .execution_options(synchronize_session=False)
        )
    return older


def status_of(session: Session, checkpoint_id: int) -> str | None:
    """A checkpoint's status (locked for update on PostgreSQL), or None if it has no row."""
    return session.scalar(
        select(CheckpointRow.status).where(CheckpointRow.id == checkpoint_id).with_for_update()
    )


def finish_commit(
    session: Session,
    checkpoint_id: int,
    values: dict[str, Any],
    *,
    status: Status = Status.COMMITTED,
) -> None:
    """Flip a pending checkpoint to committed (or local) with its final values."""
    current = session.scalar(select(CheckpointRow.status).where(CheckpointRow.id == checkpoint_id))
    if current != Status.PENDING:
        raise RunStateError(
            f"checkpoint {checkpoint_id} is {current}, not pending; it cannot be committed"
        )
    session.execute(
        update(CheckpointRow)
        .where(CheckpointRow.id == checkpoint_id)
        .values(status=status, committed_at=utcnow(), **values)
    )


def mark_deleted(session: Session, ids: Iterable[int]) -> None:
    """Mark committed checkpoints deleted (retention)."""
    ids = list(ids)
    for i in range(0, len(ids), BATCH):
        session.execute(
            update(CheckpointRow)
            .where(
                CheckpointRow.id.in_(ids[i : i + BATCH]),
                CheckpointRow.status == Status.COMMITTED,
            )
            .values(status=Status.DELETED)
        )


def corrupt_ids_referencing(session: Session, digests: Sequence[str]) -> list[int]:
    """Ids of corrupt checkpoints that reference any of ``digests``."""
    found: set[int] = set()
    for i in range(0, len(digests), BATCH):
        found.update(
            session.scalars(
                select(CheckpointBlobRow.checkpoint_id)
                .join(CheckpointRow, CheckpointRow.id == CheckpointBlobRow.checkpoint_id)
                .where(
                    CheckpointBlobRow.digest.in_(digests[i : i + BATCH]),
                    CheckpointRow.status == Status.CORRUPT,
                )
            )
        )
    return sorted(found)


def checkpoint_digests(session: Session, checkpoint_id: int, *, limit: int) -> list[str]:
    """Up to ``limit`` digests the checkpoint references."""
    return list(
        session.scalars(
            select(CheckpointBlobRow.digest)
            .where(CheckpointBlobRow.checkpoint_id == checkpoint_id)
            .order_by(CheckpointBlobRow.digest)
            .limit(limit)
        )
    )


def checkpoint_blob_sizes(session: Session, checkpoint_id: int) -> dict[str, int | None]:
    """Every blob a checkpoint references and the raw length its row records (None: no row)."""
    rows = session.execute(
        select(CheckpointBlobRow.digest, BlobRow.logical_bytes)
        .outerjoin(BlobRow, BlobRow.digest == CheckpointBlobRow.digest)
        .where(CheckpointBlobRow.checkpoint_id == checkpoint_id)
    )
    return {row[0]: row[1] for row in rows}


def record_commit(
    session: Session,
    checkpoint_id: int,
    claims: Mapping[str, BlobClaim],
    existing: Mapping[str, BlobFacts],
    components: Sequence[ComponentInfo],
    values: Callable[[int], dict[str, Any]],
    *,
    status: Status = Status.COMMITTED,
) -> None:
    """What every commit records once its checks passed: blob rows and references (``in_store``
    for a store commit, not for a local one), components, the row's final values
    (``values(stored bytes)``) and status, and the older checkpoint of its step superseded."""
    stored = sum(
        existing[d].stored_bytes if d in existing else c.stored_bytes for d, c in claims.items()
    )
    in_store = status == Status.COMMITTED
    blobs.record_blobs(session, checkpoint_id, claims.values(), existing, in_store=in_store)
    blobs.record_components(session, checkpoint_id, components)
    finish_commit(session, checkpoint_id, values(stored), status=status)
    supersede_step(session, checkpoint_id)
