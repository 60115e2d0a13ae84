"""Garbage collection's statements, inside the caller's session: the lease, mark, sweep and the
orphan check (DESIGN.md §8).

A blob is protected while a committed, pending or corrupt checkpoint references it (corrupt:
repairable, see checkpointer/repair.py) -- unless the caller releases corrupt checkpoints.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence

from sqlalchemy import and_, delete, exists, func, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import Exists

from ckptstore.errors import GcBusyError
from ckptstore.manifest._orm.blobs import insert_ignoring_duplicates
from ckptstore.manifest._orm.runs import as_utc, hold_gc_lock_exclusive
from ckptstore.manifest.models import (
    BlobRow,
    BlobState,
    CheckpointBlobRow,
    CheckpointRow,
    ComponentRow,
    GcLeaseRow,
    Status,
    utcnow,
)

_KEEPING = (Status.COMMITTED, Status.PENDING)
#: Deletes the objects of these digests from the store (inside the sweep's transaction).
DeleteObjects = Callable[[Sequence[str]], None]


def _protected(statuses: Sequence[str]) -> Exists:
    """SQL: the blob is referenced by a checkpoint in one of ``statuses``."""
    return exists(
        select(1)
        .select_from(CheckpointBlobRow)
        .join(CheckpointRow, CheckpointRow.id == CheckpointBlobRow.checkpoint_id)
        .where(CheckpointBlobRow.digest == BlobRow.digest, CheckpointRow.status.in_(list(statuses)))
    )


def _protection(release_corrupt: bool) -> Exists:
    return _protected(_KEEPING if release_corrupt else (*_KEEPING, Status.CORRUPT))


def acquire_lease(session: Session, holder: str, ttl: dt.timedelta) -> None:
    """Hold the single GC lease row for ``ttl``; GcBusyError if another holder has it."""
    now = utcnow()
    # Make sure the single row exists (two GCs racing to create it must not collide),
    # then lock it: the second GC waits here and then sees the first one's lease.
    session.execute(
        insert_ignoring_duplicates(session, GcLeaseRow),
        [{"id": 1, "holder": "", "expires_at": now - dt.timedelta(seconds=1)}],
    )
    lease = session.scalars(select(GcLeaseRow).where(GcLeaseRow.id == 1).with_for_update()).first()
    if lease is not None and as_utc(lease.expires_at) > now and lease.holder != holder:
        raise GcBusyError(
            f"another garbage collection ({lease.holder}) holds the lease until "
            f"{as_utc(lease.expires_at):%Y-%m-%d %H:%M:%S} UTC; wait for it to finish"
        )
    if lease is None:  # released (deleted) between the two statements
        session.add(GcLeaseRow(id=1, holder=holder, expires_at=now + ttl))
    else:
        lease.holder, lease.expires_at = holder, now + ttl


def delete_lease(session: Session, holder: str) -> None:
    """Delete ``holder``'s lease row."""
    session.execute(delete(GcLeaseRow).where(GcLeaseRow.holder == holder))


def corrupt_only_totals(session: Session) -> tuple[int, int, int]:
    """(blobs, stored bytes) that only corrupt checkpoints hold, and how many are corrupt."""
    only_corrupt = and_(_protected([Status.CORRUPT]), ~_protected(_KEEPING))
    count, size = session.execute(
        select(func.count(), func.coalesce(func.sum(BlobRow.stored_bytes), 0)).where(only_corrupt)
    ).one()
    corrupt = session.scalar(
        select(func.count())
        .select_from(CheckpointRow)
        .where(CheckpointRow.status == Status.CORRUPT)
    )
    return int(count), int(size), int(corrupt or 0)


def condemn_unclaimed(
    session: Session, cutoff: dt.datetime, *, release_corrupt: bool, dry_run: bool
) -> tuple[int, int]:
    """Condemn live, unprotected blobs nobody claimed since ``cutoff``; (count, bytes)."""
    condition = and_(
        BlobRow.state == BlobState.LIVE,
        BlobRow.last_claimed_at < cutoff,
        ~_protection(release_corrupt),
    )
    # Exclusive against commits (they hold it shared): a commit claiming a blob is either
    # fully visible to this mark or starts after it (and then revives what it condemned).
    hold_gc_lock_exclusive(session)
    count, size = session.execute(
        select(func.count(), func.coalesce(func.sum(BlobRow.stored_bytes), 0)).where(condition)
    ).one()
    if not dry_run:
        session.execute(
            update(BlobRow)
            .where(condition)
            .values(state=BlobState.CONDEMNED, condemned_at=utcnow())
            .execution_options(synchronize_session=False)
        )
    return int(count), int(size)


def _sweepable(cutoff: dt.datetime, release_corrupt: bool) -> ColumnElement[bool]:
    return and_(
        BlobRow.state == BlobState.CONDEMNED,
        BlobRow.condemned_at < cutoff,
        BlobRow.last_claimed_at < cutoff,
        ~_protection(release_corrupt),
    )


def sweepable_rows(
    session: Session, cutoff: dt.datetime, *, release_corrupt: bool
) -> list[tuple[str, int]]:
    """(digest, stored bytes) of blobs condemned before ``cutoff`` and still unprotected."""
    rows = session.execute(
        select(BlobRow.digest, BlobRow.stored_bytes).where(_sweepable(cutoff, release_corrupt))
    )
    return [(digest, int(size)) for digest, size in rows]


def delete_swept(
    session: Session,
    batch: Sequence[str],
    cutoff: dt.datetime,
    *,
    release_corrupt: bool,
    delete_objects: DeleteObjects,
) -> tuple[int, int]:
    """Re-check ``batch`` under the GC lock, delete the rows, then the objects; (count, bytes)."""
    hold_gc_lock_exclusive(session)
    rows = list(
        session.execute(
            select(BlobRow.digest, BlobRow.stored_bytes)
            .where(BlobRow.digest.in_(list(batch)), _sweepable(cutoff, release_corrupt))
            .with_for_update()
        )
    )
    digests = [d for d, _ in rows]
    if not digests:
        return 0, 0
    # Rows of failed, deleted (or released corrupt) checkpoints still point at these blobs.
    session.execute(delete(CheckpointBlobRow).where(CheckpointBlobRow.digest.in_(digests)))
    session.execute(delete(ComponentRow).where(ComponentRow.index_digest.in_(digests)))
    session.execute(delete(BlobRow).where(BlobRow.digest.in_(digests)))
    session.flush()
    delete_objects(digests)
    return len(digests), sum(size for _, size in rows)


def known_digests(session: Session, digests: Sequence[str]) -> set[str]:
    """The digests of ``digests`` that have a blob row."""
    return set(session.scalars(select(BlobRow.digest).where(BlobRow.digest.in_(list(digests)))))


def delete_orphan_objects(
    session: Session, digests: Sequence[str], delete_objects: DeleteObjects
) -> set[str]:
    """Delete the objects of ``digests`` that still have no row, under the GC lock."""
    hold_gc_lock_exclusive(session)
    orphans = set(digests) - known_digests(session, digests)
    if orphans:
        delete_objects(sorted(orphans))
    return orphans
