"""Garbage collection's statements, inside the caller's session: the lease, mark, sweep and the
orphan check (DESIGN.md §8).

A blob is protected while a committed, local, pending or corrupt checkpoint references it (corrupt:
repairable, see checkpointer/repair.py) -- unless the caller releases corrupt checkpoints.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import and_, delete, exists, func, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import Exists

from ckptstore.errors import GcBusyError
from ckptstore.manifest._orm.blobs import dialect_of, insert_ignoring_duplicates
from ckptstore.manifest._orm.runs import as_utc, hold_gc_lock_exclusive
from ckptstore.manifest._sql.sets import among
from ckptstore.manifest.models import (
    BlobCopyRow,
    BlobRow,
    BlobState,
    CheckpointBlobRow,
    CheckpointRow,
    ComponentRow,
    GcLeaseRow,
    Status,
    utcnow,
)

_KEEPING = (Status.COMMITTED, Status.LOCAL, Status.PENDING)
#: Deletes the objects of these digests from the store (inside the sweep's transaction).
DeleteObjects = Callable[[Sequence[str]], None]


def _protected(statuses: Sequence[str]) -> Exists:
    """SQL: the blob is referenced by a checkpoint in one of ``statuses``.

    The status is a scalar subquery, not a join: the planner then has to find the blob's
    references through their digest index and look each checkpoint up by its key -- work in
    proportion to the blob's references. Written as a join, PostgreSQL without fresh table
    statistics (a new or bulk-loaded manifest) scanned every checkpoint for every blob instead."""
    status = (
        select(CheckpointRow.status)
        .where(CheckpointRow.id == CheckpointBlobRow.checkpoint_id)
        .scalar_subquery()
    )
    return exists(
        select(1)
        .select_from(CheckpointBlobRow)
        .where(CheckpointBlobRow.digest == BlobRow.digest, status.in_(list(statuses)))
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
    corrupt = session.scalar(
        select(func.count())
        .select_from(CheckpointRow)
        .where(CheckpointRow.status == Status.CORRUPT)
    )
    if not corrupt:  # the usual case: no need to look at any blob
        return 0, 0, 0
    # From the corrupt checkpoints' references, not from every blob row.
    held = (
        select(CheckpointBlobRow.digest)
        .join(CheckpointRow, CheckpointRow.id == CheckpointBlobRow.checkpoint_id)
        .where(CheckpointRow.status == Status.CORRUPT)
    )
    count, size = session.execute(
        select(func.count(), func.coalesce(func.sum(BlobRow.stored_bytes), 0)).where(
            BlobRow.digest.in_(held), ~_protected(_KEEPING)
        )
    ).one()
    return int(count), int(size), int(corrupt)


def window_end(session: Session, after: str, rows: int) -> str | None:
    """The digest ``rows`` blob rows after ``after`` in digest order (the end of the next window
    of a pass over the table), or None if fewer rows follow: an index-only walk of ``rows``
    keys, whatever the table's size."""
    return session.scalar(
        select(BlobRow.digest)
        .where(BlobRow.digest > after)
        .order_by(BlobRow.digest)
        .offset(rows - 1)
        .limit(1)
    )


def _within(after: str, end: str | None) -> ColumnElement[bool]:
    """SQL: the blob's digest is in the window ``(after, end]`` (``end`` None: no upper end)."""
    if end is None:
        return BlobRow.digest > after
    return and_(BlobRow.digest > after, BlobRow.digest <= end)


#: A blob row as the passes read it: (digest, state, last claimed, condemned at, stored bytes).
_Facts = tuple[str, str, dt.datetime, dt.datetime | None, int]


def _facts(session: Session, where: ColumnElement[bool], state: BlobState) -> list[_Facts]:
    """The rows in ``state`` that ``where`` selects by their digests (a window's range, a
    batch's list).

    The state is compared as an expression (``state || ''``), which no index holds: given the
    column itself, a planner may walk the (state, last_claimed_at) index over every row of the
    table instead of the few keys asked for (SQLite did, for each window and for each batch
    under the GC lock: a mark over 10^6 rows took minutes). So the statement walks the keys
    asked for and returns only rows in ``state`` -- for the sweep, usually none of a window's
    10^4. The times are compared here, in UTC, whatever the database stored."""
    rows = session.execute(
        select(
            BlobRow.digest,
            BlobRow.state,
            BlobRow.last_claimed_at,
            BlobRow.condemned_at,
            BlobRow.stored_bytes,
        ).where(where, (BlobRow.state + "") == state.value)
    )
    return [
        (d, state, claimed, condemned, int(size)) for d, state, claimed, condemned, size in rows
    ]


def _unclaimed(rows: list[_Facts], cutoff: dt.datetime) -> list[tuple[str, int]]:
    """(digest, size) of the live rows nobody claimed since ``cutoff``."""
    return [
        (digest, size)
        for digest, state, claimed, _, size in rows
        if state == BlobState.LIVE and as_utc(claimed) < cutoff
    ]


def _condemned_before(rows: list[_Facts], cutoff: dt.datetime) -> list[tuple[str, int]]:
    """(digest, size) of the rows condemned, and claimed last, before ``cutoff``."""
    return [
        (digest, size)
        for digest, state, claimed, condemned, size in rows
        if state == BlobState.CONDEMNED
        and condemned is not None
        and as_utc(condemned) < cutoff
        and as_utc(claimed) < cutoff
    ]


def _unprotected(
    session: Session, found: list[tuple[str, int]], release_corrupt: bool
) -> list[tuple[str, int]]:
    """Those of ``found`` that no checkpoint protects (looked up by key, one statement)."""
    if not found:
        return []
    free = set(
        session.scalars(
            select(BlobRow.digest).where(
                among(BlobRow.digest, [d for d, _ in found], dialect_of(session)),
                ~_protection(release_corrupt),
            )
        )
    )
    return [(digest, size) for digest, size in found if digest in free]


def unclaimed_rows(
    session: Session, after: str, end: str | None, cutoff: dt.datetime, *, release_corrupt: bool
) -> list[tuple[str, int]]:
    """(digest, stored bytes) of the blobs in the window ``(after, end]`` the mark would
    condemn: live, unprotected, unclaimed since ``cutoff``. Read without a lock:
    :func:`condemn_rows` checks them again under it."""
    rows = _facts(session, _within(after, end), BlobState.LIVE)
    return _unprotected(session, _unclaimed(rows, cutoff), release_corrupt)


def condemned_rows(
    session: Session, after: str, end: str | None, cutoff: dt.datetime
) -> list[tuple[str, int]]:
    """(digest, stored bytes) of the blobs in the window ``(after, end]`` condemned (and
    claimed last) before ``cutoff``, protected or not. Read without a lock: what a sweep hands
    to :func:`delete_swept`, which checks each under it, protection included."""
    return _condemned_before(_facts(session, _within(after, end), BlobState.CONDEMNED), cutoff)


def sweepable_rows(
    session: Session, after: str, end: str | None, cutoff: dt.datetime, *, release_corrupt: bool
) -> list[tuple[str, int]]:
    """Those of :func:`condemned_rows` still unprotected: what a sweep would delete (a dry
    run's report)."""
    return _unprotected(session, condemned_rows(session, after, end, cutoff), release_corrupt)


def condemn_rows(
    session: Session, digests: Sequence[str], cutoff: dt.datetime, *, release_corrupt: bool
) -> tuple[int, int]:
    """Mark: condemn those of ``digests`` that are still live, unprotected and unclaimed since
    ``cutoff``, checked under the GC lock; (count, bytes)."""
    # Exclusive against commits (they hold it shared): a commit claiming one of these blobs is
    # either fully visible to the checks below or starts after them (and then revives what
    # this condemned). The lock is held for this batch only, never for the scan that found it.
    hold_gc_lock_exclusive(session)
    dialect = dialect_of(session)
    rows = _facts(session, among(BlobRow.digest, digests, dialect), BlobState.LIVE)
    doomed = _unprotected(session, _unclaimed(rows, cutoff), release_corrupt)
    if doomed:
        session.execute(
            update(BlobRow)
            .where(among(BlobRow.digest, [d for d, _ in doomed], dialect))
            .values(state=BlobState.CONDEMNED, condemned_at=utcnow())
            .execution_options(synchronize_session=False)
        )
    return len(doomed), sum(size for _, size in doomed)


def delete_swept(
    session: Session,
    batch: Sequence[str],
    cutoff: dt.datetime,
    *,
    release_corrupt: bool,
    delete_objects: DeleteObjects,
) -> tuple[int, int]:
    """Re-check ``batch`` under the GC lock, then delete the rows and the objects; (count,
    bytes).

    The objects go while the lock is held: a commit that found no row would otherwise check
    the object, find it, record a new row, and reference an object deleted a moment later.
    Once the re-check has settled which blobs go, nothing can claim them until this
    transaction ends, so the store deletes their objects on another thread while the database
    deletes their rows (a local store's unlinks and the database's deletes each take about
    half of a batch); both are done before the transaction commits. Should the row deletes
    fail, the rows stay condemned and the next sweep finds their objects already gone (a
    missing object is deleted as a no-op), as when the commit itself fails after the objects
    went."""
    hold_gc_lock_exclusive(session)
    dialect = dialect_of(session)
    rows = _facts(session, among(BlobRow.digest, batch, dialect), BlobState.CONDEMNED)
    doomed = _unprotected(session, _condemned_before(rows, cutoff), release_corrupt)
    digests = [d for d, _ in doomed]
    if not digests:
        return 0, 0
    with ThreadPoolExecutor(1, thread_name_prefix="ckptstore-gc-delete") as objects:
        # Leaving the block waits for the deletes, also when a row delete raises.
        deleted = objects.submit(delete_objects, digests)
        # Rows of failed, deleted (or released corrupt) checkpoints still point at these blobs.
        # No session state to keep in step (synchronize_session=False): else each DELETE
        # returns every deleted key to Python to look for in the session's identity map.
        for table, column in (
            (CheckpointBlobRow, CheckpointBlobRow.digest),
            (ComponentRow, ComponentRow.index_digest),
            (BlobCopyRow, BlobCopyRow.digest),
            (BlobRow, BlobRow.digest),
        ):
            session.execute(
                delete(table)
                .where(among(column, digests, dialect))
                .execution_options(synchronize_session=False)
            )
        deleted.result()
    return len(digests), sum(size for _, size in doomed)


def known_digests(session: Session, digests: Sequence[str]) -> set[str]:
    """The digests of ``digests`` that have a blob row."""
    if not digests:
        return set()
    return set(
        session.scalars(
            select(BlobRow.digest).where(among(BlobRow.digest, digests, dialect_of(session)))
        )
    )


def delete_orphan_objects(
    session: Session, digests: Sequence[str], delete_objects: DeleteObjects
) -> set[str]:
    """Delete the objects of ``digests`` that still have no row, under the GC lock."""
    hold_gc_lock_exclusive(session)
    orphans = set(digests) - known_digests(session, digests)
    if orphans:
        delete_objects(sorted(orphans))
    return orphans
