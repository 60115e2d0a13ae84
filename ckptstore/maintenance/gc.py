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

Only one GC runs at a time (a lease row in ``gc_lease``, renewed while a long pass runs).
``dry_run`` reports what would happen.

Cost (issue 25): each phase walks the blob table in windows of ``_WINDOW`` digests (or of
listed objects). A read without any lock finds a window's candidates; write transactions then
take batches of them, check each blob again under the GC lock and act, with set-based
statements (one per batch, whatever its size). So memory stays bounded by a window, a pass
with nothing to do writes nothing, and commits wait for one batch at most: :class:`Pace` sizes
the batches to hold the lock about half a second (the goal: never a second).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from ckptstore.cas.digest import blob_key, digest_from_key
from ckptstore.checkpointer.tiered import sweep_tiers
from ckptstore.errors import GcBusyError
from ckptstore.manifest import collecting as garbage
from ckptstore.manifest import repairing as transactions
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import utcnow

if TYPE_CHECKING:
    from ckptstore.tiers import TierConfig
from ckptstore.objectstore import ObjectStore

__all__ = ["DEFAULT_GRACE", "GcBusyError", "GcReport", "collect_garbage", "gc_lease"]

log = logging.getLogger("ckptstore.gc")

DEFAULT_GRACE = dt.timedelta(hours=6)
LEASE_TTL = dt.timedelta(minutes=15)
#: Blob rows (or listed objects) one read of a pass takes: what a GC holds in memory at once.
_WINDOW = 10_000
#: Told ``(phase, 0)`` as each phase begins ("mark", "sweep", "orphans", "incomplete",
#: "tiers"), then ``(phase, n)`` as n more blobs are condemned, blobs deleted (or, in a dry
#: run, found) or store objects listed.
Progress = Callable[[str, int], None]
T = TypeVar("T")


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
    #: Wall seconds of each phase: ``mark``, ``sweep``, ``orphans``, ``incomplete``.
    seconds: dict[str, float] = field(default_factory=dict)
    #: The longest write transaction of the pass, in seconds (it held the GC lock, which
    #: commits wait for, at most that long).
    longest_batch_seconds: float = 0.0
    #: Objects on node-local tiers that no copy row knows (older than the grace), and the
    #: nodes whose tiers were reached (``tiers=``; none without).
    tier_orphans: int = 0
    tier_orphan_bytes: int = 0
    tier_nodes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Pace:
    """The size of the next batch a write transaction handles under the GC lock, adjusted
    after each batch so that one holds the lock about ``target`` seconds (commits wait for it):
    a slow store or database gets smaller batches, a fast one larger, never past ``most``."""

    size: int
    most: int
    target: float = 0.5
    least: int = 16

    def batches(self, items: Sequence[T]) -> Iterator[Sequence[T]]:
        """``items`` in consecutive batches of the current size (read again for each)."""
        start = 0
        while start < len(items):
            batch = items[start : start + self.size]
            yield batch
            start += len(batch)

    def took(self, seconds: float, done: int) -> None:
        """A batch of ``done`` items held the lock ``seconds``: size the next one."""
        if done < self.size:  # a short last batch says little about the rate
            return
        wanted = int(done * self.target / max(seconds, 1e-3))
        self.size = max(self.least, min(self.most, 2 * self.size, max(wanted, self.size // 2)))


@contextlib.contextmanager
def gc_lease(db: Database, holder: str | None = None) -> Iterator[Callable[[], None]]:
    """Hold the single GC lease for the duration of the block; yields a function that renews
    it (cheaply, only once a third of its time has passed) for passes longer than its TTL."""
    holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    garbage.take_lease(db, holder, LEASE_TTL)
    taken = time.monotonic()

    def renew() -> None:
        nonlocal taken
        if time.monotonic() - taken > LEASE_TTL.total_seconds() / 3:
            garbage.take_lease(db, holder, LEASE_TTL)
            taken = time.monotonic()

    try:
        yield renew
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
    tiers: TierConfig | None = None,
) -> GcReport:
    """Run one mark-and-sweep pass; see the module docstring. ``tiers``: also remove from the
    node-local tiers it can reach every object older than the grace that no copy row knows
    (copies of blobs this pass deleted, leftovers of crashed saves)."""
    report = GcReport(
        dry_run=dry_run, grace_seconds=grace.total_seconds(), release_corrupt=release_corrupt
    )
    with gc_lease(db) as renew:
        pass_ = _Pass(db, store, report, renew, progress)
        kept = garbage.kept_for_corrupt(db)
        report.kept_for_corrupt, report.kept_for_corrupt_bytes, report.corrupt_checkpoints = kept
        if release_corrupt and not dry_run:
            # Given up on: deleted, so this GC takes their blobs and verify stops reporting them.
            transactions.release_corrupt(db)
        with pass_.timed("mark"):
            pass_.mark(utcnow() - grace)
        with pass_.timed("sweep"):
            pass_.sweep(utcnow() - grace)
        with pass_.timed("orphans"):
            pass_.sweep_orphans((utcnow() - grace).timestamp())
        with pass_.timed("incomplete"):
            report.incomplete, report.incomplete_bytes = store.sweep_incomplete(
                grace.total_seconds(), dry_run=dry_run
            )
        if tiers is not None:
            with pass_.timed("tiers"):
                found = sweep_tiers(db, tiers, older_than=grace.total_seconds(), dry_run=dry_run)
                report.tier_orphans, report.tier_orphan_bytes, report.tier_nodes = found
    return report


@dataclass(slots=True)
class _Pass:
    """One GC's walk over the manifest and the store, window by window."""

    db: Database
    store: ObjectStore
    report: GcReport
    renew: Callable[[], None]
    progress: Progress | None
    condemning: Pace = field(default_factory=lambda: Pace(size=2_000, most=_WINDOW))
    #: A first sweep batch of one S3 DeleteObjects request.
    deleting: Pace = field(default_factory=lambda: Pace(size=1_000, most=_WINDOW))

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        if self.progress:
            self.progress(phase, 0)
        try:
            yield
        finally:
            self.report.seconds[phase] = time.perf_counter() - started

    def held(self, pace: Pace, started: float, done: int) -> None:
        """A batch of ``done`` items, begun at ``started``, has committed: size the next."""
        seconds = time.perf_counter() - started
        pace.took(seconds, done)
        self.report.longest_batch_seconds = max(self.report.longest_batch_seconds, seconds)

    def windows(self) -> Iterator[garbage.Window]:
        """The blob table's digests in windows of ``_WINDOW`` rows (each found when reached)."""
        after = ""
        while True:
            self.renew()
            end = garbage.window_after(self.db, after, _WINDOW)
            yield after, end
            if end is None:
                return
            after = end

    def walk(
        self,
        find: Callable[[garbage.Window], list[tuple[str, int]]],
        act: Callable[[Sequence[str]], tuple[int, int]],
        pace: Pace,
    ) -> Iterator[tuple[int, int]]:
        """(count, bytes) of each step of a pass: for each window, the candidates ``find``
        reads without a lock -- in a dry run, all of them as found; otherwise each batch of
        them that ``act`` checks again and handles under the GC lock, paced by ``pace``.

        A batch may take candidates of several windows: a pass over 10^6 rows of which a
        tenth go finds ~1,000 per window, and one transaction per window (each with its
        commit, its re-check statements and the store's delete threads) removed 1,000 blobs
        in the time a batch of several thousand takes. So what is held between windows is at
        most one batch plus one window's candidates."""
        pending: list[str] = []
        for window in self.windows():
            found = find(window)
            if self.report.dry_run:
                yield len(found), sum(size for _, size in found)
                continue
            pending.extend(d for d, _ in found)
            while len(pending) >= pace.size:  # full batches now; the rest waits for more
                batch, pending = pending[: pace.size], pending[pace.size :]
                yield self.handle(act, pace, batch)
        for rest in pace.batches(pending):
            yield self.handle(act, pace, rest)

    def handle(
        self, act: Callable[[Sequence[str]], tuple[int, int]], pace: Pace, batch: Sequence[str]
    ) -> tuple[int, int]:
        """``act`` on one batch under the GC lock, timed for ``pace``."""
        started = time.perf_counter()
        done = act(batch)
        self.held(pace, started, len(batch))
        return done

    def mark(self, cutoff: dt.datetime) -> None:
        report, corrupt = self.report, self.report.release_corrupt
        for count, size in self.walk(
            lambda window: garbage.unclaimed_in(self.db, window, cutoff, release_corrupt=corrupt),
            lambda batch: garbage.condemn(self.db, batch, cutoff, release_corrupt=corrupt),
            self.condemning,
        ):
            report.condemned += count
            report.condemned_bytes += size
            if self.progress:
                self.progress("mark", count)

    def sweep(self, cutoff: dt.datetime) -> None:
        report, corrupt = self.report, self.report.release_corrupt

        def find(window: garbage.Window) -> list[tuple[str, int]]:
            # A dry run reports what would go; a real sweep checks protection once, under the
            # lock (a condemned blob is rarely protected: one a verify took out of service).
            if report.dry_run:
                return garbage.sweepable_in(self.db, window, cutoff, release_corrupt=corrupt)
            return garbage.condemned_in(self.db, window, cutoff)

        for count, size in self.walk(
            find,
            lambda batch: garbage.sweep(
                self.db,
                batch,
                cutoff,
                release_corrupt=corrupt,
                delete_objects=self.delete_objects,
            ),
            self.deleting,
        ):
            report.swept += count
            report.swept_bytes += size
            if self.progress:
                self.progress("sweep", count)

    def delete_objects(self, digests: Sequence[str]) -> None:
        self.store.delete([blob_key(d) for d in digests])

    def sweep_orphans(self, cutoff: float) -> None:
        candidates: dict[str, int] = {}
        for info in self.store.list("cas/"):
            digest = digest_from_key(info.key)
            if digest is not None and info.mtime < cutoff:
                candidates[digest] = info.size
            if len(candidates) >= _WINDOW:
                self.delete_orphans(candidates)
                candidates = {}
        if candidates:
            self.delete_orphans(candidates)

    def delete_orphans(self, sizes: dict[str, int]) -> None:
        """Of these listed objects, delete those without a row (checked again under the lock
        only where the unlocked read found some)."""
        self.renew()
        report = self.report
        unknown = sorted(garbage.unknown_digests(self.db, list(sizes)))
        if report.dry_run:
            orphans: set[str] = set(unknown)
        else:
            orphans = set()
            for batch in self.deleting.batches(unknown):
                started = time.perf_counter()
                orphans |= garbage.delete_orphans(self.db, batch, self.delete_objects)
                self.held(self.deleting, started, len(batch))
        report.orphans += len(orphans)
        report.orphan_bytes += sum(sizes[d] for d in orphans)
        if self.progress:
            self.progress("orphans", len(sizes))
