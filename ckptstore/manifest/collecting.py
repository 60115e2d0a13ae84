"""Collecting garbage: the manifest's side of ``ckptstore gc`` (DESIGN.md §8), one named
operation per step, each its own transaction.

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
    "condemn",
    "delete_orphans",
    "kept_for_corrupt",
    "release_lease",
    "sweep",
    "sweepable",
    "take_lease",
    "unknown_digests",
]


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


def condemn(
    db: Database, cutoff: dt.datetime, *, release_corrupt: bool, dry_run: bool
) -> tuple[int, int]:
    """Mark: condemn live, unprotected blobs nobody claimed since ``cutoff``; (count, bytes)."""
    return db.write(
        lambda s: collect.condemn_unclaimed(
            s, cutoff, release_corrupt=release_corrupt, dry_run=dry_run
        ),
        what="GC mark",
    )


def sweepable(db: Database, cutoff: dt.datetime, *, release_corrupt: bool) -> list[tuple[str, int]]:
    """(digest, stored bytes) of blobs condemned before ``cutoff`` and still unprotected."""
    with db.read() as session:
        return collect.sweepable_rows(session, cutoff, release_corrupt=release_corrupt)


def sweep(
    db: Database,
    batch: Sequence[str],
    cutoff: dt.datetime,
    *,
    release_corrupt: bool,
    delete_objects: DeleteObjects,
) -> tuple[int, int]:
    """Sweep: re-check ``batch`` under the GC lock, delete the rows, then the objects."""
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
