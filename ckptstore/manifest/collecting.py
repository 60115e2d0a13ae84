"""Collecting garbage: the manifest's side of ``ckptstore gc`` (DESIGN.md §8), one named
operation per step, each its own transaction.

Each pass walks the blob table in windows of digests: a read without a lock finds the
window's candidates, and a write transaction per batch of them checks each again under the GC
lock and acts. So memory is bounded by a window, and commits wait at most one batch.

maintenance/gc.py runs the passes and owns the store side; the statements are in
:mod:`ckptstore.manifest._orm.collect`. A blob is protected while a committed, pending or
corrupt checkpoint references it -- unless the caller releases corrupt checkpoints.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from ckptstore.manifest._orm import collect
from ckptstore.manifest._orm.collect import DeleteObjects
from ckptstore.manifest.db import Database

__all__ = [
    "DeleteObjects",
    "Window",
    "condemn",
    "condemned_in",
    "delete_orphans",
    "kept_for_corrupt",
    "release_lease",
    "sweep",
    "sweepable_in",
    "take_lease",
    "unclaimed_in",
    "unknown_digests",
    "window_after",
]

#: A range of blob digests ``(after, end]`` (``end`` None: to the last one): passes over the
#: blob table read and lock one window at a time.
Window = tuple[str, str | None]


def take_lease(db: Database, holder: str, ttl: dt.timedelta) -> None:
    """Hold the single GC lease for ``ttl``; GcBusyError if another holder has it."""
    db.write(lambda s: collect.acquire_lease(s, holder, ttl), what="taking the GC lease")


def release_lease(db: Database, holder: str) -> None:
    """Give the lease back (an expired lease frees itself anyway)."""
    db.write(lambda s: collect.delete_lease(s, holder), what="releasing the GC lease")


def kept_for_corrupt(db: Database) -> tuple[int, int, int]:
    """(blobs, stored bytes) that only corrupt checkpoints hold, and how many are corrupt."""
    with db.read() as session:
        return collect.corrupt_only_totals(session)


def window_after(db: Database, after: str, rows: int) -> str | None:
    """The end of the window of the next ``rows`` blob rows after the digest ``after`` (a pass
    over the table goes window by window: bounded memory and transactions); None if fewer
    rows follow, and the window runs to the end."""
    with db.read() as session:
        return collect.window_end(session, after, rows)


def unclaimed_in(
    db: Database, window: Window, cutoff: dt.datetime, *, release_corrupt: bool
) -> list[tuple[str, int]]:
    """(digest, stored bytes) of the live, unprotected blobs in ``window`` nobody claimed
    since ``cutoff``: what the mark would condemn (read without a lock)."""
    with db.read() as session:
        return collect.unclaimed_rows(session, *window, cutoff, release_corrupt=release_corrupt)


def condemn(
    db: Database, digests: Sequence[str], cutoff: dt.datetime, *, release_corrupt: bool
) -> tuple[int, int]:
    """Mark: condemn those of ``digests`` still unclaimed and unprotected, checked again under
    the GC lock (held for this batch only); (count, bytes)."""
    return db.write(
        lambda s: collect.condemn_rows(s, digests, cutoff, release_corrupt=release_corrupt),
        what="GC mark",
    )


def condemned_in(db: Database, window: Window, cutoff: dt.datetime) -> list[tuple[str, int]]:
    """(digest, stored bytes) of the blobs in ``window`` condemned before ``cutoff``, without
    the protection check (read without a lock): a sweep's candidates, each checked under the
    lock by :func:`sweep` -- protection too, so checking it here as well would look every
    candidate's references up twice."""
    with db.read() as session:
        return collect.condemned_rows(session, *window, cutoff)


def sweepable_in(
    db: Database, window: Window, cutoff: dt.datetime, *, release_corrupt: bool
) -> list[tuple[str, int]]:
    """(digest, stored bytes) of the blobs in ``window`` condemned before ``cutoff`` and still
    unprotected (read without a lock)."""
    with db.read() as session:
        return collect.sweepable_rows(session, *window, cutoff, release_corrupt=release_corrupt)


def sweep(
    db: Database,
    batch: Sequence[str],
    cutoff: dt.datetime,
    *,
    release_corrupt: bool,
    delete_objects: DeleteObjects,
) -> tuple[int, int]:
    """Sweep: check ``batch`` under the GC lock (still condemned, past the grace, and
    unprotected -- the only protection check a real sweep makes), then delete the rows and,
    beside them on another thread, the objects, both before the commit."""
    return db.write(
        lambda s: collect.delete_swept(
            s, batch, cutoff, release_corrupt=release_corrupt, delete_objects=delete_objects
        ),
        what="GC sweep",
    )


def unknown_digests(db: Database, digests: Sequence[str]) -> set[str]:
    """The digests that have no blob row (orphan objects, if old enough)."""
    with db.read() as session:
        return set(digests) - collect.known_digests(session, digests)


def delete_orphans(db: Database, digests: Sequence[str], delete_objects: DeleteObjects) -> set[str]:
    """Delete the objects of ``digests`` that still have no row, under the GC lock."""
    return db.write(
        lambda s: collect.delete_orphan_objects(s, digests, delete_objects),
        what="GC orphan sweep",
    )
