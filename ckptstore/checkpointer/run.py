"""The run handle: ``save`` / ``latest`` / ``load`` / ``close`` as short guards over the save
protocol (``commit.py``), the one-save-in-flight queue (``handle.py``) and loading
(``restore.py``). Open one with :func:`ckptstore.open_run`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

from ckptstore.cas.writer import BlobWriter, WriterOptions
from ckptstore.checkpointer import commit, drain, recovery, restore
from ckptstore.checkpointer.drain import DrainReport
from ckptstore.checkpointer.handle import OneInFlight, SaveHandle, close_on_exit
from ckptstore.checkpointer.jsonvalues import plain_json
from ckptstore.checkpointer.retention import RetentionPolicy, check_trigger
from ckptstore.checkpointer.shards import ShardReceipt, check_kinds
from ckptstore.checkpointer.snapshot import Snapshotter
from ckptstore.checkpointer.step_log import StepLog
from ckptstore.checkpointer.tiered import Tiers
from ckptstore.errors import ConfigError, RunStateError
from ckptstore.manifest import reading as reads
from ckptstore.manifest import tiering
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import Trigger
from ckptstore.manifest.records import CheckpointInfo
from ckptstore.names import check_component_name, check_kind, check_step
from ckptstore.objectstore import ObjectStore


class Run:
    """A run opened for writing (``save``) and reading (``latest``, ``load``).

    Create it with :func:`open_run`. Not meant to be shared between threads for saving.
    """

    def __init__(
        self,
        *,
        db: Database,
        store: ObjectStore,
        run_id: int,
        name: str,
        epoch: int | None,
        retention: RetentionPolicy,
        writer_options: WriterOptions | None,
        async_save: bool,
        keep_snapshot_buffers: bool = True,
        owns: Sequence[Any] = (),
        tiers: Tiers | None = None,
    ) -> None:
        self.db = db
        self.store = store
        #: The run's node-local tiers (``open_run(tiers=...)``), or None.
        self.tiers = tiers
        self.id = run_id
        self.name = name
        self.epoch = epoch
        self.retention = retention
        self.async_save = async_save
        self._owns = list(owns)
        self._snapshotter = Snapshotter(keep_buffers=keep_snapshot_buffers)
        #: The live blobs this run's current save will likely share (refreshed per save).
        self._live: frozenset[str] = frozenset()
        self._blobs = BlobWriter(store, writer_options, known=self._is_live_blob)
        #: Writes this process's components to the tiers (a local save; made at the first):
        #: its own tier answers what is there already, so no manifest query decides it.
        self._tier_blobs: BlobWriter | None = None
        self.writer_options = writer_options  # open_run's; its integrations' saves use them too
        self._queue: OneInFlight[SaveHandle] = OneInFlight(f"ckpt-save-{name}")
        self._closed = False
        #: Per-step metrics not written yet (``log_metrics``; made at the first call).
        self._step_log: StepLog | None = None

    def __repr__(self) -> str:
        mode = "writer" if self.epoch is not None else "reader"
        return f"Run({self.name!r}, {mode}, db={self.db!r}, store={self.store.url!r})"

    # -- saving -----------------------------------------------------------------------------

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record per-step ``metrics`` (name -> number) at ``step`` in ``step_metrics``: kept
        in memory and written in one transaction every 100 steps or 30 s, and at each save
        and at close (never a write per step). Logging a step again replaces its values."""
        if self.epoch is None or self._closed:
            state = "closed" if self._closed else "open read-only"
            raise RunStateError(f"run {self.name!r} is {state}: it cannot log metrics")
        if self._step_log is None:
            self._step_log = StepLog(self.db, self.id)
        self._step_log.log(step, metrics)

    def flush_metrics(self) -> int:
        """Write the metrics ``log_metrics`` buffered now; how many values."""
        return self._step_log.flush() if self._step_log is not None else 0

    def save(
        self,
        step: int,
        components: Mapping[str, Any] | None = None,
        *,
        receipts: Iterable[ShardReceipt] = (),
        training_info: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        trigger: str = Trigger.MANUAL,
        kinds: Mapping[str, str] | None = None,
        started_at: float | None = None,
        blocked_seconds: float = 0.0,
        expect_changed: Iterable[str] = (),
        durability: str | None = None,
    ) -> SaveHandle:
        """Checkpoint ``components`` (name -> state) and workers' ``receipts`` at ``step``.

        ``durability``: ``"remote"`` stores it in the object store (``committed``);
        ``"local"`` stores it on the node-local tiers of ``replicas`` nodes (``local``: a
        :meth:`drain` makes it remote-durable later), which needs ``open_run(tiers=...)`` and
        receipts written through the tiers. Default: local when the run has tiers.

        Returns once the state is snapshotted; the upload and the commit run in the background
        (or before returning if the run was opened with ``async_save=False``). A previous save
        that failed raises its error here, before anything new starts.

        Timings recorded in the checkpoint's row (and ``SaveHandle.blocked_seconds``):
        ``blocked_seconds`` is the longest any participant was blocked -- this call plus the
        ``blocked_seconds`` argument (time the caller already spent blocked for this save
        elsewhere, e.g. asking workers to snapshot), or a receipt's own blocked time if longer;
        with ``async_save=False`` this call lasts until the commit, and all of it counts.
        ``save_seconds`` runs from the earliest of this call, ``started_at`` (a ``time.time()``
        instant) and every receipt's ``started_at``, to the commit.

        ``expect_changed`` names components that must differ from the previous committed
        checkpoint: one that did not is logged as a warning and listed in the committed row's
        ``training_info["stale_components"]`` (a guard against saving stale weights).
        """
        call_started_at = time.time()
        started = time.perf_counter()
        writer = self._writer(self._local(durability))
        check_step(step)
        check_trigger(trigger)
        components = dict(components or {})
        receipts = list(receipts)
        names = check_save_names(components, receipts, kinds)
        changed = check_expect_changed(expect_changed, names)
        check_timings(started_at, blocked_seconds)
        self._queue.settle()
        self.flush_metrics()
        request = commit.SaveRequest(
            step=step,
            # A synchronous save stores straight from the caller's tensors (it waits anyway).
            flats=self._snapshotter.take(components, copy=self.async_save),
            receipts=receipts,
            training_info=plain_json(training_info, "training_info"),
            metrics=plain_json(metrics, "metrics"),
            trigger=str(trigger),
            # The earliest start of any participant: this call, the caller's, every receipt's.
            started_at=min(
                [call_started_at, *([] if started_at is None else [started_at])]
                + [r.started_at for r in receipts if r.started_at is not None]
            ),
            kinds=dict(kinds or {}),
            expect_changed=changed,
        )
        own = time.perf_counter() - started + blocked_seconds
        request.blocked = max([own, *(r.blocked_seconds for r in receipts)])
        blocking_since = None if self.async_save else started - blocked_seconds
        request.blocking_since = blocking_since
        handle = self._queue.submit(
            lambda: self._store(writer, request),
            lambda future: SaveHandle(step, future, request.blocked, run=self.name),
        )
        if blocking_since is not None:
            handle.wait()
            handle.blocked_seconds = max(request.blocked, time.perf_counter() - blocking_since)
        return handle

    def _store(self, writer: commit.Writer, request: commit.SaveRequest) -> CheckpointInfo:
        """The background half of a save; the snapshot's memory may go once it is over."""
        try:
            return commit.run_save(writer, request)
        finally:
            self._snapshotter.release()

    def _local(self, durability: str | None) -> bool:
        """Whether a save of ``durability`` goes to the tiers."""
        if durability is None:
            return self.tiers is not None
        if durability not in ("local", "remote"):
            raise ConfigError(f"durability={durability!r}: use 'local' or 'remote'")
        if durability == "local" and self.tiers is None:
            raise ConfigError(
                f"run {self.name!r} has no node-local tiers: open it with "
                "tiers=TierConfig(local_dir=...) to save with durability='local'"
            )
        return durability == "local"

    def _writer(self, local: bool = False) -> commit.Writer:
        if self._closed:
            raise RunStateError(f"run {self.name!r} is closed")
        if self.epoch is None:
            raise RunStateError(
                f"run {self.name!r} was opened read-only; open it with writable=True to save"
            )
        if not local:
            return commit.Writer(
                self.db,
                self.store,
                self._blobs,
                self.id,
                self.name,
                self.epoch,
                self.retention,
                refresh_live=self._refresh_live,
            )
        tiers = self.tiers
        assert tiers is not None
        store = tiers.writer(self.db)
        if self._tier_blobs is None:
            self._tier_blobs = BlobWriter(store, self.writer_options)
        return commit.Writer(
            self.db,
            store,
            self._tier_blobs,
            self.id,
            self.name,
            self.epoch,
            self.retention,
            local=commit.LocalCommit(
                replicas=tiers.replicas,
                check_copies=tiers.check_copies,
                nodes=store.nodes,
                after=lambda: tiers.keep_bounded(self.db, self.id, tiers.reachable(self.db)),
            ),
        )

    def _refresh_live(self) -> None:
        """At the start of each save: one query for the live blobs it will likely reuse (the
        newest committed checkpoint's). Blobs outside that set are probed in the store (an
        existing object is not uploaded again); the commit re-checks every blob either way."""
        self._live = reads.live_digests_to_reuse(self.db, self.id)

    def _is_live_blob(self, digest: str) -> bool:
        """The writer's dedup question: is this blob already stored (a live row)?"""
        return digest in self._live

    def finalize(self) -> CheckpointInfo | None:
        """Wait for the save in flight; raise its error if it failed and was not reported."""
        settled = self._queue.settle()
        return None if settled is None else settled._outcome()

    def release(self, step: int) -> bool:
        """Mark the committed checkpoint at ``step`` deleted, as retention does (GC reclaims
        its unshared blobs): for frameworks that choose what to keep (Lightning's top-k)."""
        return commit.release(self._writer(), check_step(step))

    # -- reading ----------------------------------------------------------------------------

    @property
    def writable(self) -> bool:
        """Whether this is the run's writer (it saves, and acts on damage a load finds)."""
        return self.epoch is not None

    def latest(self, *, before_step: int | None = None) -> CheckpointInfo | None:
        """The newest committed checkpoint (below ``before_step``, if given), or None. One
        indexed query. A run with tiers: the newest checkpoint recoverable now, local or
        committed (one query more asks which nodes' tiers answer)."""
        if self.tiers is not None:
            return recovery.newest(self._reader(), self.tiers, before_step=before_step)
        if before_step is not None:
            return reads.newest_committed(self.db, (self.id, self.name), before_step=before_step)
        return reads.latest(self.db, (self.id, self.name))

    def checkpoint(self, step: int) -> CheckpointInfo:
        """The committed checkpoint at ``step`` (a run with tiers: local or committed, if
        recoverable now); ``CheckpointNotFoundError`` saying why not."""
        if self.tiers is not None:
            return tiering.recoverable_at(
                self.db, (self.id, self.name), check_step(step), self.tiers.reachable(self.db)
            )
        return reads.committed_at(self.db, (self.id, self.name), check_step(step))

    def copies(self, info: CheckpointInfo) -> dict[str, tuple[bool, tuple[str, ...]]]:
        """Where each blob of ``info`` is: digest -> (the store holds it, the nodes whose
        tiers hold a copy). What a coordinator hands ranks that read through the tiers
        (``nearest_copies``) without opening the manifest."""
        return {
            digest: (in_store, tuple(sorted(nodes)))
            for digest, (in_store, nodes) in tiering.copies_of(self.db, info.id).items()
        }

    def reachable(self) -> tuple[str, ...]:
        """The nodes whose tiers answer now (none without tiers): what a coordinator hands
        ranks with ``copies`` so they read through the tiers (``nearest_copies``)."""
        return () if self.tiers is None else tuple(sorted(self.tiers.reachable(self.db)))

    def save_target(self) -> ObjectStore:
        """The store this process's own shards of a save go to: the object store, or (a run
        with tiers) this node's writer store on the tiers (its receipts name the nodes)."""
        return self.store if self.tiers is None else self.tiers.writer(self.db)

    def source(self, info: CheckpointInfo) -> ObjectStore:
        """The store a load of ``info`` reads through: the object store, or (a run with tiers)
        each blob's nearest verified copy."""
        if self.tiers is None:
            return self.store
        reachable = self.tiers.reachable(self.db)
        return self.tiers.nearest(tiering.copies_of(self.db, info.id), reachable, self.store)

    def checkpoints(self, statuses: Sequence[str] | None = None) -> list[CheckpointInfo]:
        """Every checkpoint of the run (optionally only some statuses), oldest first."""
        return reads.checkpoints(self.db, (self.id, self.name), statuses)

    def load(
        self,
        step: int | None = None,
        *,
        components: Iterable[str] | None = None,
        paths: Mapping[str, Iterable[str]] | None = None,
        fallback: bool = True,
        into: Mapping[str, Any] | None = None,
        atomic: bool = True,
    ) -> restore.LoadedCheckpoint:
        """Load a committed checkpoint: ``step``, or the newest one.

        ``components`` limits which components load; ``paths`` maps a component to the entry
        paths (or ``prefix/`` subtrees) to load from it. When loading the newest checkpoint and
        its stored bytes fail verification, the previous committed one is tried
        (``fallback``); the skipped ones are reported in the result and in the log. A writer
        marks them corrupt (and quarantines the damaged blob); a read-only run changes
        nothing. Bytes this process cannot read (``UnreadableError``) are never a reason to
        skip a checkpoint: that error is raised.

        ``into`` loads into the caller's tensors, as ``dcp.load`` does: it maps a component
        name to a state of the structure that was saved (``{"policy": model.state_dict(),
        "optimizer": optim.state_dict()}``), and every tensor of it whose path matches an
        entry is filled with the stored bytes and appears in the result as that same tensor.
        A tensor whose dtype or shape differs from the stored one is a ``ConfigError`` before
        anything is read. ``atomic`` (the default): the tensors are written only once every
        blob of the checkpoint has verified -- either all are filled from verified bytes or
        none is touched (a fallback's older checkpoint is loaded the same way); the load holds
        the bytes until then (memory as a load without ``into``; for GPU tensors device
        scratch where the device has room, else host memory). ``atomic=False``: a dense CPU or
        GPU tensor is filled as each blob is read and verified (GPU: through reused pinned
        buffers, the copy overlapped with the reads), a strided one by one copy at the end;
        but a checkpoint that fails verification may leave unverified bytes in them until the
        fallback's older checkpoint is loaded over them (a fallback that lacks one of them
        fails, naming it), and if none verifies their contents are undefined.
        """
        if self.tiers is not None:
            return recovery.load_nearest(
                self._reader(),
                self.tiers,
                step,
                components=components,
                paths=paths,
                fallback=fallback,
                into=into,
                atomic=atomic,
            )
        return restore.load(
            self._reader(),
            step,
            components=components,
            paths=paths,
            fallback=fallback,
            into=into,
            atomic=atomic,
        )

    def _reader(self) -> restore.Reader:
        return restore.Reader(self.db, self.store, self.id, self.name, self.writable)

    def drain(
        self,
        step: int | None = None,
        *,
        deadline: float | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> DrainReport | None:
        """Make a local-durable checkpoint remote-durable: ``step``, or the newest checkpoint if
        it is local.

        Uploads what the store does not hold from the nearest verified tier copies, then marks
        it committed (see :mod:`ckptstore.checkpointer.drain`). ``deadline`` (a
        ``time.monotonic()`` instant): send only what ends before it; the report says the
        checkpoint is still local if that was not all. None if there is nothing to drain; a
        checkpoint already remote-durable reports ``drained`` with nothing uploaded. A writer
        then applies retention and keeps the tiers bounded. ``progress`` is called with the
        stored bytes of each blob uploaded (from the upload threads: a progress bar's update)."""
        if self._closed:
            raise RunStateError(f"run {self.name!r} is closed")
        tiers = self.tiers
        if tiers is None:
            raise ConfigError(
                f"run {self.name!r} has no node-local tiers to drain: open it with "
                "tiers=TierConfig(local_dir=...)"
            )
        reachable = tiers.reachable(self.db)
        if step is not None:
            info = reads.checkpoint_at(self.db, (self.id, self.name), check_step(step))
        else:
            # The newest checkpoint recoverable now, if it is local (an older local one is of
            # no use in the store: a newer one is remote-durable already).
            newest = tiering.newest_recoverable(self.db, (self.id, self.name), reachable)
            info = newest if newest is not None and newest.status == "local" else None
        if info is None:
            return None
        if info.status != "local":
            return DrainReport(info.step, info.status == "committed", 0, 0, 0, 0.0)
        source = drain.Source(tiers.node, tiers.tier, frozenset(reachable), self.writable)
        report = drain.drain_checkpoint(
            self.db, self.store, info, source, deadline=deadline, progress=progress
        )
        if report.drained and self.writable:
            commit.apply_retention(self._writer())
            # Older local checkpoints are of no use now; the tiers drop their copies after the
            # next local commit (evictions never run beside a save's writes: see tiered.py).
            tiering.drop_superseded_locals(self.db, self.id, tiers.config.keep_last)
        return report

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Flush the pending save (raising its error), then release threads and connections."""
        if self._closed:
            return
        try:
            try:
                self.flush_metrics()
            finally:
                self.finalize()
            if self.tiers is not None and self.writable:
                # The last save (or drain) may have left copies no checkpoint keeps any more:
                # nothing saves now, so the tiers drop them (bounded disk after the job too).
                self.tiers.keep_bounded(self.db, self.id, self.tiers.reachable(self.db))
        finally:
            self._closed = True
            self._queue.shutdown()
            self._snapshotter.clear()
            self._blobs.close()
            if self._tier_blobs is not None:
                self._tier_blobs.close()
            for resource in reversed(self._owns):
                resource.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        close_on_exit(self.close, exc, "checkpoint save")


def check_save_names(
    components: Mapping[str, Any],
    receipts: Sequence[ShardReceipt],
    kinds: Mapping[str, str] | None,
) -> list[str]:
    """The component names of one save, checked: valid, unique, at least one; kinds valid."""
    names = [*components, *(r.component for r in receipts)]
    for name in names:
        check_component_name(name)
    check_kinds(components, kinds)
    for receipt in receipts:
        check_kind(receipt.kind)
    if len(set(names)) != len(names):
        raise ConfigError(f"component names must be unique within a save: {names}")
    if not names:
        raise ConfigError("a checkpoint needs at least one component or receipt")
    return names


def check_expect_changed(expect_changed: Iterable[str], names: Sequence[str]) -> tuple[str, ...]:
    """``expect_changed`` as a tuple; each must name a component of this save."""
    if isinstance(expect_changed, str):
        raise ConfigError(
            f"expect_changed={expect_changed!r} must be a collection of component names, "
            f"e.g. [{expect_changed!r}], not one string"
        )
    changed = tuple(dict.fromkeys(expect_changed))
    absent = [n for n in changed if n not in names]
    if absent:
        raise ConfigError(
            f"expect_changed names {absent}, which this save does not contain; "
            f"its components are {names}"
        )
    return changed


def check_timings(started_at: float | None, blocked_seconds: float) -> None:
    """``started_at`` (a ``time.time()`` instant) and ``blocked_seconds`` are usable."""
    if started_at is not None and not math.isfinite(started_at):
        raise ConfigError(f"started_at={started_at!r} must be a time.time() value")
    if not (math.isfinite(blocked_seconds) and blocked_seconds >= 0):
        raise ConfigError(f"blocked_seconds={blocked_seconds!r} must be a finite number >= 0")
