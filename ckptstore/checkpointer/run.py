"""The run handle: ``save`` / ``latest`` / ``load`` / ``close`` as short guards over the save
protocol (``commit.py``), the one-save-in-flight queue (``handle.py``) and loading
(``restore.py``). Open one with :func:`ckptstore.open_run`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

from ckptstore.cas.writer import BlobWriter, WriterOptions
from ckptstore.checkpointer import commit, restore
from ckptstore.checkpointer.handle import SaveHandle, SaveQueue
from ckptstore.checkpointer.jsonvalues import plain_json
from ckptstore.checkpointer.retention import RetentionPolicy
from ckptstore.checkpointer.shards import ShardReceipt
from ckptstore.checkpointer.snapshot import Snapshotter
from ckptstore.errors import ConfigError, RunStateError
from ckptstore.manifest import reads
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import Trigger
from ckptstore.manifest.records import CheckpointInfo
from ckptstore.names import check_component_name, check_kind, check_step
from ckptstore.objectstore import ObjectStore

log = logging.getLogger("ckptstore.checkpointer")


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
        owns: Sequence[Any] = (),
    ) -> None:
        self.db = db
        self.store = store
        self.id = run_id
        self.name = name
        self.epoch = epoch
        self.retention = retention
        self.async_save = async_save
        self._owns = list(owns)
        self._snapshotter = Snapshotter()
        self._blobs = BlobWriter(store, writer_options, known=self._is_live_blob)
        self._queue = SaveQueue(name)
        self._closed = False

    def __repr__(self) -> str:
        mode = "writer" if self.epoch is not None else "reader"
        return f"Run({self.name!r}, {mode}, db={self.db!r}, store={self.store.url!r})"

    # -- saving -----------------------------------------------------------------------------

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
    ) -> SaveHandle:
        """Checkpoint ``components`` (name -> state) and workers' ``receipts`` at ``step``.

        Returns once the state is snapshotted; the upload and the commit run in the background
        (or before returning if the run was opened with ``async_save=False``). A previous save
        that failed raises its error here, before anything new starts.
        """
        started = time.perf_counter()
        writer = self._writer()
        check_step(step)
        if trigger not in set(Trigger):
            raise ConfigError(f"trigger={trigger!r} is not one of {[t.value for t in Trigger]}")
        components = dict(components or {})
        receipts = list(receipts)
        names = [*components, *(r.component for r in receipts)]
        for name in names:
            check_component_name(name)
        for kind in [*(kinds or {}).values(), *(r.kind for r in receipts)]:
            check_kind(kind)
        if len(set(names)) != len(names):
            raise ConfigError(f"component names must be unique within a save: {names}")
        if not names:
            raise ConfigError("a checkpoint needs at least one component or receipt")
        self._queue.wait_previous()
        request = commit.SaveRequest(
            step=step,
            flats=self._snapshotter.take(components),
            receipts=receipts,
            training_info=plain_json(training_info, "training_info"),
            metrics=plain_json(metrics, "metrics"),
            trigger=str(trigger),
            started=started,
            kinds=dict(kinds or {}),
        )
        request.blocked = time.perf_counter() - started
        handle = self._queue.submit(step, lambda: commit.run_save(writer, request), request.blocked)
        if not self.async_save:
            handle.wait()
        return handle

    def _writer(self) -> commit.Writer:
        if self._closed:
            raise RunStateError(f"run {self.name!r} is closed")
        if self.epoch is None:
            raise RunStateError(
                f"run {self.name!r} was opened read-only; open it with writable=True to save"
            )
        return commit.Writer(
            self.db, self.store, self._blobs, self.id, self.name, self.epoch, self.retention
        )

    def _is_live_blob(self, digest: str) -> bool:
        """The writer's dedup question: is this blob already stored (a live row)?"""
        return reads.is_live_blob(self.db, digest)

    def finalize(self) -> CheckpointInfo | None:
        """Wait for the save in flight; raise its error if it failed and was not reported."""
        return self._queue.finalize()

    # -- reading ----------------------------------------------------------------------------

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint, or None. One indexed query."""
        return reads.latest(self.db, (self.id, self.name))

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
    ) -> restore.LoadedCheckpoint:
        """Load a committed checkpoint: ``step``, or the newest one.

        ``components`` limits which components load; ``paths`` maps a component to the entry
        paths (or ``prefix/`` subtrees) to load from it. When loading the newest checkpoint and
        it fails verification, it is marked corrupt and the previous committed one is tried
        (``fallback``); the skipped ones are reported in the result and in the log.
        """
        reader = restore.Reader(self.db, self.store, self.id, self.name)
        return restore.load(reader, step, components=components, paths=paths, fallback=fallback)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Flush the pending save (raising its error), then release threads and connections."""
        if self._closed:
            return
        try:
            self.finalize()
        finally:
            self._closed = True
            self._queue.shutdown()
            self._blobs.close()
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
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as flush_error:
            # Never mask the exception already propagating; attach the flush failure to it.
            log.exception("while handling %r, the pending checkpoint save failed too", exc)
            exc.add_note(f"ckptstore: the pending checkpoint save also failed: {flush_error!r}")
            if flush_error.__cause__ is not None:
                exc.add_note(f"ckptstore: caused by {flush_error.__cause__!r}")
