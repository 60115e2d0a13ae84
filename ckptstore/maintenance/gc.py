"""Garbage collection: mark, then sweep, with a grace period (DESIGN.md §8).

- **Mark**: a live blob that no committed or pending checkpoint references, and that nobody
  claimed within the grace period, is condemned (``condemned_at`` = now).
- **Sweep**: a blob condemned for at least the grace period, and still unreferenced and
  unclaimed, loses its row and then its object — both while holding the GC lock, which every
  commit takes shared, so a commit that claims the blob either revives it first or finds it gone
  and fails safely (its next save uploads it again).
- **Orphans**: objects under ``cas/`` with no row (a crashed save's uploads) older than the
  grace period are deleted, re-checked under the same lock.

Only one GC runs at a time (a lease row in ``gc_lease``). ``dry_run`` reports what would happen.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from sqlalchemy import and_, delete, exists, func, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import Exists

from ckptstore.cas.digest import blob_key, digest_from_key
from ckptstore.errors import CkptStoreError
from ckptstore.manifest import queries as q
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import (
    Blob,
    BlobState,
    Checkpoint,
    CheckpointBlob,
    Component,
    GcLease,
    Status,
    utcnow,
)
from ckptstore.objectstore import ObjectStore

log = logging.getLogger("ckptstore.gc")

DEFAULT_GRACE = dt.timedelta(hours=6)
LEASE_TTL = dt.timedelta(minutes=15)
_BATCH = 500
Progress = Callable[[str, int], None]


class GcBusyError(CkptStoreError):
    """Another garbage collection holds the lease."""


@dataclass(slots=True)
class GcReport:
    dry_run: bool
    grace_seconds: float
    condemned: int = 0
    condemned_bytes: int = 0
    swept: int = 0
    swept_bytes: int = 0
    orphans: int = 0
    orphan_bytes: int = 0
    #: Leftovers of writes that never finished (temporary files, multipart uploads).
    incomplete: int = 0
    incomplete_bytes: int = 0
    errors: list[str] = field(default_factory=list)


def _protected() -> Exists:
    """SQL: the blob is referenced by a committed or pending checkpoint."""
    return exists(
        select(1)
        .select_from(CheckpointBlob)
        .join(Checkpoint, Checkpoint.id == CheckpointBlob.checkpoint_id)
        .where(
            CheckpointBlob.digest == Blob.digest,
            Checkpoint.status.in_([Status.COMMITTED, Status.PENDING]),
        )
    )


@contextlib.contextmanager
def gc_lease(db: Database, holder: str | None = None) -> Iterator[str]:
    """Hold the single GC lease for the duration of the block."""
    holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def acquire(session: Session) -> None:
        now = utcnow()
        # Make sure the single row exists (two GCs racing to create it must not collide),
        # then lock it: the second GC waits here and then sees the first one's lease.
        session.execute(
            q.insert_ignoring_duplicates(session, GcLease),
            [{"id": 1, "holder": "", "expires_at": now - dt.timedelta(seconds=1)}],
        )
        lease = session.scalars(select(GcLease).where(GcLease.id == 1).with_for_update()).first()
        if lease is not None and q.as_utc(lease.expires_at) > now and lease.holder != holder:
            raise GcBusyError(
                f"another garbage collection ({lease.holder}) holds the lease until "
                f"{q.as_utc(lease.expires_at):%Y-%m-%d %H:%M:%S} UTC; wait for it to finish"
            )
        if lease is None:  # released (deleted) between the two statements
            session.add(GcLease(id=1, holder=holder, expires_at=now + LEASE_TTL))
        else:
            lease.holder, lease.expires_at = holder, now + LEASE_TTL

    db.write(acquire, what="taking the GC lease")
    try:
        yield holder
    finally:
        with contextlib.suppress(Exception):  # an expired lease frees itself anyway
            db.write(
                lambda s: s.execute(delete(GcLease).where(GcLease.holder == holder)),
                what="releasing the GC lease",
            )


def collect_garbage(
    db: Database,
    store: ObjectStore,
    *,
    grace: dt.timedelta = DEFAULT_GRACE,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> GcReport:
    """Run one mark-and-sweep pass; see the module docstring."""
    report = GcReport(dry_run=dry_run, grace_seconds=grace.total_seconds())
    with gc_lease(db):
        _mark(db, grace, report)
        _sweep(db, store, grace, report, progress)
        _sweep_orphans(db, store, grace, report, progress)
        report.incomplete, report.incomplete_bytes = store.sweep_incomplete(
            grace.total_seconds(), dry_run=dry_run
        )
    return report


def _mark(db: Database, grace: dt.timedelta, report: GcReport) -> None:
    cutoff = utcnow() - grace
    condition = and_(Blob.state == BlobState.LIVE, Blob.last_claimed_at < cutoff, ~_protected())

    def mark(session: Session) -> tuple[int, int]:
        # Exclusive against commits (they hold it shared): a commit claiming a blob is either
        # fully visible to this mark or starts after it (and then revives what it condemned).
        q.hold_gc_lock_exclusive(session)
        count, size = session.execute(
            select(func.count(), func.coalesce(func.sum(Blob.stored_bytes), 0)).where(condition)
        ).one()
        if not report.dry_run:
            session.execute(
                update(Blob)
                .where(condition)
                .values(state=BlobState.CONDEMNED, condemned_at=utcnow())
                .execution_options(synchronize_session=False)
            )
        return int(count), int(size)

    report.condemned, report.condemned_bytes = db.write(mark, what="GC mark")


def _sweepable(cutoff: dt.datetime) -> ColumnElement[bool]:
    return and_(
        Blob.state == BlobState.CONDEMNED,
        Blob.condemned_at < cutoff,
        Blob.last_claimed_at < cutoff,
        ~_protected(),
    )


def _sweep(
    db: Database,
    store: ObjectStore,
    grace: dt.timedelta,
    report: GcReport,
    progress: Progress | None,
) -> None:
    cutoff = utcnow() - grace
    with db.read() as session:
        doomed = list(
            session.execute(select(Blob.digest, Blob.stored_bytes).where(_sweepable(cutoff)))
        )
    if report.dry_run:
        report.swept = len(doomed)
        report.swept_bytes = sum(size for _, size in doomed)
        return
    for i in range(0, len(doomed), _BATCH):
        batch = [d for d, _ in doomed[i : i + _BATCH]]

        def sweep(session: Session, batch: Sequence[str] = batch) -> tuple[int, int]:
            q.hold_gc_lock_exclusive(session)
            rows = list(
                session.execute(
                    select(Blob.digest, Blob.stored_bytes)
                    .where(Blob.digest.in_(batch), _sweepable(cutoff))
                    .with_for_update()
                )
            )
            digests = [d for d, _ in rows]
            if not digests:
                return 0, 0
            # Rows of failed, deleted or corrupt checkpoints still point at these blobs.
            session.execute(delete(CheckpointBlob).where(CheckpointBlob.digest.in_(digests)))
            session.execute(delete(Component).where(Component.index_digest.in_(digests)))
            session.execute(delete(Blob).where(Blob.digest.in_(digests)))
            session.flush()
            store.delete(blob_key(d) for d in digests)
            return len(digests), sum(size for _, size in rows)

        count, size = db.write(sweep, what="GC sweep")
        report.swept += count
        report.swept_bytes += size
        if progress:
            progress("sweep", count)


def _sweep_orphans(
    db: Database,
    store: ObjectStore,
    grace: dt.timedelta,
    report: GcReport,
    progress: Progress | None,
) -> None:
    cutoff = (utcnow() - grace).timestamp()
    candidates: list[tuple[str, int]] = []
    for info in store.list("cas/"):
        digest = digest_from_key(info.key)
        if digest is not None and info.mtime < cutoff:
            candidates.append((digest, info.size))
        if len(candidates) >= _BATCH:
            _delete_orphans(db, store, candidates, report, progress)
            candidates = []
    if candidates:
        _delete_orphans(db, store, candidates, report, progress)


def _delete_orphans(
    db: Database,
    store: ObjectStore,
    candidates: list[tuple[str, int]],
    report: GcReport,
    progress: Progress | None,
) -> None:
    sizes = dict(candidates)

    def known(session: Session) -> set[str]:
        return set(session.scalars(select(Blob.digest).where(Blob.digest.in_(list(sizes)))))

    if report.dry_run:
        with db.read() as session:
            orphans = set(sizes) - known(session)
        report.orphans += len(orphans)
        report.orphan_bytes += sum(sizes[d] for d in orphans)
        return

    def sweep(session: Session) -> set[str]:
        q.hold_gc_lock_exclusive(session)
        orphans = set(sizes) - known(session)
        if orphans:
            store.delete(blob_key(d) for d in sorted(orphans))
        return orphans

    orphans = db.write(sweep, what="GC orphan sweep")
    report.orphans += len(orphans)
    report.orphan_bytes += sum(sizes[d] for d in orphans)
    if progress:
        progress("orphans", len(candidates))
