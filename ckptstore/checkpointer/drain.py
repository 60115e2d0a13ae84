"""Draining a local-durable checkpoint to the object store (DESIGN.md §13).

A drain reads each blob the store may not hold from its nearest tier copy, verifies it against
its digest (a bad copy is forgotten and the next one read), uploads it as stored (the same
self-describing object), and makes the uploads durable (``store.flush``). Then one transaction
looks for every such blob in the store, and only if all are there marks them ``in_store`` and
the checkpoint ``committed`` (:func:`~ckptstore.manifest.tiering.mark_drained`). A drain killed
at any point leaves the checkpoint local-durable, never claims more: the next drain finds what
was uploaded already (one batched size check) and sends the rest.

With a deadline the drain sends a blob only if, at the rate measured so far, it ends before the
deadline, and stops otherwise (``DrainReport.drained`` False): a job stopping on its time budget
never overruns it, and the next start drains the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from ckptstore.cas.blobs import decode_object
from ckptstore.cas.digest import blob_key
from ckptstore.errors import (
    CkptStoreError,
    IntegrityError,
    ObjectNotFoundError,
    ObjectStoreError,
    SaveError,
)
from ckptstore.manifest import tiering
from ckptstore.manifest.db import Database
from ckptstore.manifest.records import CheckpointInfo
from ckptstore.objectstore import ObjectStore
from ckptstore.tiers.placement import read_order

log = logging.getLogger("ckptstore.tiers")

#: Seconds kept in hand before a deadline for the drain's own commit.
COMMIT_MARGIN = 1.0


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What one drain of one checkpoint did."""

    step: int
    #: The checkpoint is remote-durable now (it may have been already).
    drained: bool
    #: Blobs (and their stored bytes) uploaded by this drain.
    uploaded_blobs: int
    uploaded_bytes: int
    #: Blobs the store held already (an earlier, interrupted drain; another run's save).
    present_blobs: int
    seconds: float
    #: Why it stopped short (the deadline), or None.
    stopped: str | None = None


@dataclass(frozen=True, slots=True)
class Source:
    """Where a drain reads tier copies: this node, a function that opens a node's tier, the
    nodes reachable now; and whether it may forget the bad copies it meets (a writer)."""

    node: str
    tier: Callable[[str], ObjectStore]
    reachable: frozenset[str]
    forget: bool


def drain_checkpoint(
    db: Database,
    store: ObjectStore,
    info: CheckpointInfo,
    source: Source,
    *,
    deadline: float | None = None,
    workers: int = 8,
    progress: Callable[[int], None] | None = None,
) -> DrainReport:
    """Upload what ``info`` (a local checkpoint) needs to the store and mark it committed;
    ``deadline`` is a ``time.monotonic()`` instant it must not run past; ``progress`` is
    called with the stored bytes of each blob uploaded (from the upload threads)."""
    began = time.monotonic()
    work = tiering.drain_work(db, info.id)
    keys = {digest: blob_key(digest) for digest in work}
    held = store.sizes(sorted(keys.values())) if keys else {}
    todo = sorted((d for d in work if held.get(keys[d]) is None), key=lambda d: -work[d][0])
    present = len(work) - len(todo)
    upload = _Uploader(db, store, source, info, deadline, progress)
    stopped = upload.all(todo, work, workers)
    if stopped is not None:
        return DrainReport(
            info.step, False, upload.blobs, upload.bytes, present, time.monotonic() - began, stopped
        )
    store.flush()
    if deadline is not None and time.monotonic() > deadline:
        stopped = "the deadline passed before the drain's commit"
        return DrainReport(
            info.step, False, upload.blobs, upload.bytes, present, time.monotonic() - began, stopped
        )
    drained = tiering.mark_drained(db, info.id, lambda digests: _sizes(store, digests))
    if not drained:
        log.info("step %d of run %r was drained (or dropped) meanwhile", info.step, info.run)
    return DrainReport(
        info.step, True, upload.blobs, upload.bytes, present, time.monotonic() - began
    )


def _sizes(store: ObjectStore, digests: Sequence[str]) -> Mapping[str, int | None]:
    found = store.sizes([blob_key(d) for d in digests])
    return {d: found[blob_key(d)] for d in digests}


class _Uploader:
    """The uploads of one drain, on a few threads, each holding one blob at a time."""

    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        source: Source,
        info: CheckpointInfo,
        deadline: float | None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.db, self.store, self.source, self.info = db, store, source, info
        self.deadline, self.progress = deadline, progress
        self.blobs = self.bytes = 0
        self._lock = threading.Lock()

    def all(
        self, todo: Sequence[str], work: Mapping[str, tuple[int, set[str]]], workers: int
    ) -> str | None:
        """Upload ``todo``; the reason it stopped early, or None."""
        if not todo:
            return None
        started = time.monotonic()
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="ckpt-drain") as pool:
            pending: set[Future[None]] = set()
            for digest in todo:
                size, nodes = work[digest]
                if len(pending) >= workers:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()
                if not self._fits(size, started, workers):
                    for future in pending:
                        future.result()
                    return (
                        f"the deadline: {len(todo) - self.blobs} blob(s) of step "
                        f"{self.info.step} left for the next drain"
                    )
                pending.add(pool.submit(self.one, digest, nodes))
            for future in pending:
                future.result()
        return None

    def _fits(self, size: int, started: float, workers: int) -> bool:
        """Whether uploading ``size`` more bytes ends before the deadline at the rate so far
        (the store's hint before anything was measured)."""
        if self.deadline is None:
            return True
        now = time.monotonic()
        with self._lock:
            rate = (
                self.bytes / max(now - started, 1e-3)
                if self.bytes
                else self.store.write_bandwidth_hint
            )
        return now + size / max(rate, 1.0) + COMMIT_MARGIN <= self.deadline

    def one(self, digest: str, holders: set[str]) -> None:
        """Read a verified copy of ``digest`` (nearest first) and put it in the store."""
        key = blob_key(digest)
        bad: list[tuple[str, str]] = []
        try:
            for node in read_order(
                self.source.node, holders, self.source.reachable, in_store=False
            ):
                try:
                    data = self.source.tier(node).get_view(key)
                    decode_object(data, digest, f"tier copy {key} on node {node!r}")
                except ObjectNotFoundError:
                    log.warning("tier copy of %s on node %r is gone", key, node)
                    bad.append((digest, node))
                    continue
                except IntegrityError as exc:
                    log.error("BAD TIER COPY: %s on node %r (%s)", key, node, exc)  # noqa: TRY400
                    bad.append((digest, node))
                    continue
                except ObjectStoreError as exc:  # the node does not answer: not the copy's fault
                    log.warning("tier of node %r does not answer (%s)", node, exc)
                    continue
                self.store.put(key, data)
                with self._lock:
                    self.blobs += 1
                    self.bytes += data.nbytes
                    if self.progress is not None:
                        self.progress(data.nbytes)
                return
        finally:
            if bad and self.source.forget:
                try:
                    tiering.forget(self.db, bad)
                except CkptStoreError:
                    log.exception("could not forget bad tier copies %s", bad)
        raise SaveError(
            f"no good copy of blob {digest} of run {self.info.run!r} step {self.info.step} is "
            f"left on the reachable nodes ({', '.join(sorted(self.source.reachable))}); it "
            "cannot be drained and stays local-durable (it is not recoverable either unless "
            "the node that held it comes back)"
        )
