"""Garbage collection's statements: the lease, mark, sweep and the orphan check (DESIGN.md §8).

maintenance/gc.py runs the passes and owns the store side; every statement is here. A blob is
protected while a committed, pending or corrupt checkpoint references it (corrupt: repairable,
see checkpointer/repair.py) -- unless the caller releases corrupt checkpoints.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence

from sqlalchemy import and_, delete, exists, func, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import Exists

from ckptstore.errors import GcBusyError
from ckptstore.manifest import queries as q
from ckptstore.manifest.db import Database
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


def take_lease(db: Database, holder: str, ttl: dt.timedelta) -> None:
    """Hold the single GC lease for ``ttl``; GcBusyError if another holder has it."""

    def acquire(session: Session) -> None:
        now = utcnow()
        # Make sure the single row exists (two GCs racing to create it must not collide),
        # then lock it: the second GC waits here and then sees the first one's lease.
        session.execute(
            q.insert_ignoring_duplicates(session, GcLeaseRow),
            [{"id": 1, "holder": "", "expires_at": now - dt.timedelta(seconds=1)}],
        )
        lease = session.scalars(
            select(GcLeaseRow).where(GcLeaseRow.id == 1).with_for_update()
        ).first()
        if lease is not None and q.as_utc(lease.expires_at) > now and lease.holder != holder:
            raise GcBusyError(
                f"another garbage collection ({lease.holder}) holds the lease until "
                f"{q.as_utc(lease.expires_at):%Y-%m-%d %H:%M:%S} UTC; wait for it to finish"
            )
        if lease is None:  # released (deleted) between the two statements
            session.add(GcLeaseRow(id=1, holder=holder, expires_at=now + ttl))
        else:
            lease.holder, lease.expires_at = holder, now + ttl

    db.write(acquire, what="taking the GC lease")


def release_lease(db: Database, holder: str) -> None:
    """Give the lease back (an expired lease frees itself anyway)."""
    db.write(
        lambda s: s.execute(delete(GcLeaseRow).where(GcLeaseRow.holder == holder)),
        what="releasing the GC lease",
    )


def kept_for_corrupt(db: Database) -> tuple[int, int, int]:
    """(blobs, stored bytes) that only corrupt checkpoints hold, and how many are corrupt."""
    only_corrupt = and_(_protected([Status.CORRUPT]), ~_protected(_KEEPING))
    with db.read() as session:
        count, size = session.execute(
            select(func.count(), func.coalesce(func.sum(BlobRow.stored_bytes), 0)).where(
                only_corrupt
            )
        ).one()
        corrupt = session.scalar(
            select(func.count())
            .select_from(CheckpointRow)
            .where(CheckpointRow.status == Status.CORRUPT)
        )
    return int(count), int(size), int(corrupt or 0)


def condemn(
    db: Database, cutoff: dt.datetime, *, release_corrupt: bool, dry_run: bool
) -> tuple[int, int]:
    """Mark: condemn live, unprotected blobs nobody claimed since ``cutoff``; (count, bytes)."""
    condition = and_(
        BlobRow.state == BlobState.LIVE,
        BlobRow.last_claimed_at < cutoff,
        ~_protection(release_corrupt),
    )

    def mark(session: Session) -> tuple[int, int]:
        # Exclusive against commits (they hold it shared): a commit claiming a blob is either
        # fully visible to this mark or starts after it (and then revives what it condemned).
        q.hold_gc_lock_exclusive(session)
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

    return db.write(mark, what="GC mark")


def _sweepable(cutoff: dt.datetime, release_corrupt: bool) -> ColumnElement[bool]:
    return and_(
        BlobRow.state == BlobState.CONDEMNED,
        BlobRow.condemned_at < cutoff,
        BlobRow.last_claimed_at < cutoff,
        ~_protection(release_corrupt),
    )


def sweepable(db: Database, cutoff: dt.datetime, *, release_corrupt: bool) -> list[tuple[str, int]]:
    """(digest, stored bytes) of blobs condemned before ``cutoff`` and still unprotected."""
    with db.read() as session:
        rows = session.execute(
            select(BlobRow.digest, BlobRow.stored_bytes).where(_sweepable(cutoff, release_corrupt))
        )
        return [(digest, int(size)) for digest, size in rows]


def sweep(
    db: Database,
    batch: Sequence[str],
    cutoff: dt.datetime,
    *,
    release_corrupt: bool,
    delete_objects: DeleteObjects,
) -> tuple[int, int]:
    """Sweep: re-check ``batch`` under the GC lock, delete the rows, then the objects."""

    def transaction(session: Session) -> tuple[int, int]:
        q.hold_gc_lock_exclusive(session)
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

    return db.write(transaction, what="GC sweep")


def unknown_digests(db: Database, digests: Sequence[str]) -> set[str]:
    """The digests that have no blob row (orphan objects, if old enough)."""
    with db.read() as session:
        return set(digests) - _known(session, digests)


def delete_orphans(db: Database, digests: Sequence[str], delete_objects: DeleteObjects) -> set[str]:
    """Delete the objects of ``digests`` that still have no row, under the GC lock."""

    def transaction(session: Session) -> set[str]:
        q.hold_gc_lock_exclusive(session)
        orphans = set(digests) - _known(session, digests)
        if orphans:
            delete_objects(sorted(orphans))
        return orphans

    return db.write(transaction, what="GC orphan sweep")


def _known(session: Session, digests: Sequence[str]) -> set[str]:
    return set(session.scalars(select(BlobRow.digest).where(BlobRow.digest.in_(list(digests)))))
