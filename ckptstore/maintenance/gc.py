"""Garbage collection: mark, then sweep, with a grace period (DESIGN.md §8).

- **Mark**: a live blob that no committed, pending or corrupt checkpoint references, and that
  nobody claimed within the grace period, is condemned (``condemned_at`` = now). Corrupt
  checkpoints keep their blobs: corruption is repairable (checkpointer/repair.py), and a blob
  must never be deleted because of damage that was later repaired. ``release_corrupt=True``
  lets them go, when their owner has given up on repair.
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
from typing import TYPE_CHECKING

from ckptstore.cas.digest import blob_key, digest_from_key
from ckptstore.errors import GcBusyError
from ckptstore.manifest import collecting as garbage
from ckptstore.manifest import repairing as transactions
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import utcnow

if TYPE_CHECKING:
    from ckptstore.objectstore import ObjectStore

__all__ = ["DEFAULT_GRACE", "GcBusyError", "GcReport", "collect_garbage", "gc_lease"]

log = logging.getLogger("ckptstore.gc")

DEFAULT_GRACE = dt.timedelta(hours=6)
LEASE_TTL = dt.timedelta(minutes=15)
_BATCH = 500
Progress = Callable[[str, int], None]


@dataclass(slots=True)
class GcReport:
    """What one GC pass did (or, dry run, would do)."""

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
    #: Blobs kept only because corrupt checkpoints reference them (repairable history).
    kept_for_corrupt: int = 0
    kept_for_corrupt_bytes: int = 0
    corrupt_checkpoints: int = 0
    release_corrupt: bool = False
    errors: list[str] = field(default_factory=list)


@contextlib.contextmanager
def gc_lease(db: Database, holder: str | None = None) -> Iterator[str]:
    """Hold the single GC lease for the duration of the block."""
    holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    garbage.take_lease(db, holder, LEASE_TTL)
    try:
        yield holder
    finally:
        with contextlib.suppress(Exception):  # an expired lease frees itself anyway
            garbage.release_lease(db, holder)


def collect_garbage(
    db: Database,
    store: ObjectStore,
    *,
    grace: dt.timedelta = DEFAULT_GRACE,
    dry_run: bool = False,
    release_corrupt: bool = False,
    progress: Progress | None = None,
) -> GcReport:
    """Run one mark-and-sweep pass; see the module docstring."""
    report = GcReport(
        dry_run=dry_run, grace_seconds=grace.total_seconds(), release_corrupt=release_corrupt
    )
    with gc_lease(db):
        kept = garbage.kept_for_corrupt(db)
        report.kept_for_corrupt, report.kept_for_corrupt_bytes, report.corrupt_checkpoints = kept
        if release_corrupt and not dry_run:
            # Given up on: deleted, so this GC takes their blobs and verify stops reporting them.
            transactions.release_corrupt(db)
        report.condemned, report.condemned_bytes = garbage.condemn(
            db, utcnow() - grace, release_corrupt=release_corrupt, dry_run=dry_run
        )
        _sweep(db, store, grace, report, progress)
        _sweep_orphans(db, store, grace, report, progress)
        report.incomplete, report.incomplete_bytes = store.sweep_incomplete(
            grace.total_seconds(), dry_run=dry_run
        )
    return report


def _sweep(
    db: Database,
    store: ObjectStore,
    grace: dt.timedelta,
    report: GcReport,
    progress: Progress | None,
) -> None:
    cutoff = utcnow() - grace
    doomed = garbage.sweepable(db, cutoff, release_corrupt=report.release_corrupt)
    if report.dry_run:
        report.swept = len(doomed)
        report.swept_bytes = sum(size for _, size in doomed)
        return
    for i in range(0, len(doomed), _BATCH):
        batch = [d for d, _ in doomed[i : i + _BATCH]]
        count, size = garbage.sweep(
            db,
            batch,
            cutoff,
            release_corrupt=report.release_corrupt,
            delete_objects=lambda digests: store.delete(blob_key(d) for d in digests),
        )
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
    candidates: Sequence[tuple[str, int]],
    report: GcReport,
    progress: Progress | None,
) -> None:
    sizes = dict(candidates)
    if report.dry_run:
        orphans = garbage.unknown_digests(db, list(sizes))
    else:
        orphans = garbage.delete_orphans(
            db, list(sizes), lambda digests: store.delete(blob_key(d) for d in digests)
        )
    report.orphans += len(orphans)
    report.orphan_bytes += sum(sizes[d] for d in orphans)
    if progress and not report.dry_run:
        progress("orphans", len(candidates))
