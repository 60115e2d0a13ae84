"""The checkpointer: save / load / latest over the manifest and the blob store (DESIGN.md §7-§8).

Save protocol: snapshot (the only blocking part) -> pending row -> background encode + upload
-> one commit transaction (writer epoch checked, every referenced blob re-validated) ->
retention. Any failure before the commit marks the row failed; nothing uncommitted is ever
visible to ``latest`` or ``load``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from sqlalchemy.exc import IntegrityError as SQLIntegrityError
from sqlalchemy.orm import Session

from ckptstore.cas.blobs import MissingBlobError, quarantine_blob
from ckptstore.cas.digest import blob_key
from ckptstore.cas.writer import BlobWriter, WriterOptions
from ckptstore.checkpointer.retention import Candidate, RetentionPolicy, to_delete
from ckptstore.checkpointer.shards import ShardReceipt, check_component_name
from ckptstore.checkpointer.snapshot import Snapshotter
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ConfigError,
    FencedError,
    IntegrityError,
    ObjectNotFoundError,
    SaveError,
    StoreNotFoundError,
)
from ckptstore.manifest import queries as q
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import Blob, BlobState, Checkpoint, Status, Trigger
from ckptstore.objectstore import ObjectStore, open_store
from ckptstore.serialize.load import load_component, load_paths
from ckptstore.serialize.save import write_flat

log = logging.getLogger("ckptstore.checkpointer")

DEFAULT_ROOT = ".ckptstore"


def default_db() -> str:
    return os.environ.get("CKPTSTORE_DB") or str(Path(DEFAULT_ROOT) / "manifest.db")


def default_store() -> str:
    return os.environ.get("CKPTSTORE_STORE") or str(Path(DEFAULT_ROOT) / "store")


def config_fingerprint(config: Mapping[str, Any]) -> str:
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


#: One component of a checkpoint (name, kind, index digest, bytes, entries).
ComponentInfo = q.ComponentRow


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One checkpoint row, as users see it."""

    id: int
    run: str
    step: int
    status: str
    trigger: str
    writer_epoch: int
    training_info: dict[str, Any] | None
    metrics: dict[str, Any] | None
    logical_bytes: int
    stored_bytes: int
    uploaded_bytes: int
    save_seconds: float | None
    blocked_seconds: float | None
    error: str | None
    components: tuple[ComponentInfo, ...] = ()

    @property
    def deduplicated_bytes(self) -> int:
        """Bytes this checkpoint references that were already stored before it."""
        return max(0, self.stored_bytes - self.uploaded_bytes)


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    info: CheckpointInfo
    #: Component name -> its state (or, for a partial load, path -> value).
    state: dict[str, Any]
    #: Newer checkpoints that failed verification and were marked corrupt on the way.
    skipped: tuple[tuple[int, str], ...] = ()


def _info(row: Checkpoint, run: str, components: Sequence[Any] = ()) -> CheckpointInfo:
    return CheckpointInfo(
        id=row.id,
        run=run,
        step=row.step,
        status=row.status,
        trigger=row.trigger,
        writer_epoch=row.writer_epoch,
        training_info=row.training_info,
        metrics=row.metrics,
        logical_bytes=row.logical_bytes,
        stored_bytes=row.stored_bytes,
        uploaded_bytes=row.uploaded_bytes,
        save_seconds=row.save_seconds,
        blocked_seconds=row.blocked_seconds,
        error=row.error,
        components=tuple(ComponentInfo.of(c) for c in components),
    )


class SaveHandle:
    """An asynchronous save. ``wait()`` returns the committed checkpoint or raises SaveError."""

    def __init__(self, step: int, future: Future[CheckpointInfo], blocked_seconds: float) -> None:
        self.step = step
        self.blocked_seconds = blocked_seconds
        self._future = future
        self._reported = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """The committed checkpoint. Raises ``TimeoutError`` (the save goes on) if ``timeout``
        seconds pass first, ``SaveError`` (or ``FencedError``) if the save failed."""
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise  # still running: neither a failure nor reported
        except CkptStoreError as exc:
            self._reported = True
            if isinstance(exc, SaveError | FencedError):
                raise
            raise SaveError(f"checkpoint save at step {self.step} failed: {exc}") from exc
        except Exception as exc:
            self._reported = True
            raise SaveError(
                f"checkpoint save at step {self.step} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _unreported_error(self) -> BaseException | None:
        if self._reported or not self._future.done():
            return None
        return self._future.exception()


@dataclass(slots=True)
class _SaveRequest:
    step: int
    flats: dict[str, Any]
    receipts: list[ShardReceipt]
    training_info: dict[str, Any] | None
    metrics: dict[str, Any] | None
    trigger: str
    started: float
    blocked: float = 0.0
    kinds: dict[str, str] = field(default_factory=dict)


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
        self._writer = BlobWriter(store, writer_options, known=self._is_live_blob)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-save-{name}")
        self._pending: SaveHandle | None = None
        self._closed = False
        self._lock = threading.Lock()

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
        self._check_writable()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative integer, got {step!r}")
        if trigger not in set(Trigger):
            raise ConfigError(f"trigger={trigger!r} is not one of {[t.value for t in Trigger]}")
        components = dict(components or {})
        receipts = list(receipts)
        names = [*components, *(r.component for r in receipts)]
        for name in names:
            check_component_name(name)
        if len(set(names)) != len(names):
            raise ConfigError(f"component names must be unique within a save: {names}")
        if not names:
            raise ConfigError("a checkpoint needs at least one component or receipt")
        self._wait_previous()
        request = _SaveRequest(
            step=step,
            flats=self._snapshotter.take(components),
            receipts=receipts,
            training_info=_plain_json(training_info, "training_info"),
            metrics=_plain_json(metrics, "metrics"),
            trigger=str(trigger),
            started=started,
            kinds=dict(kinds or {}),
        )
        request.blocked = time.perf_counter() - started
        future = self._executor.submit(self._save_job, request)
        handle = SaveHandle(step, future, request.blocked)
        self._pending = handle
        if not self.async_save:
            handle.wait()
        return handle

    def _wait_previous(self) -> None:
        previous = self._pending
        if previous is None:
            return
        try:
            previous._future.exception()  # wait, without raising yet
        finally:
            self._pending = None if previous.done() else previous
        error = previous._unreported_error()
        if error is not None:
            previous._reported = True
            raise SaveError(
                f"the previous checkpoint save (step {previous.step}) of run {self.name!r} "
                f"failed: {error}; nothing from it was committed"
            ) from error

    def _save_job(self, request: _SaveRequest) -> CheckpointInfo:
        assert self.epoch is not None
        epoch = self.epoch
        checkpoint_id = self.db.write(
            lambda s: q.begin_checkpoint(s, self.id, request.step, epoch, request.trigger),
            what=f"starting checkpoint at step {request.step}",
        )
        try:
            self._writer.forget()
            receipts = [
                ShardReceipt(name, write_flat(self._writer, flat), request.kinds.get(name, "state"))
                for name, flat in request.flats.items()
            ]
            request.flats.clear()  # the snapshot's views are no longer needed
            receipts.extend(request.receipts)
            info = self._commit(checkpoint_id, request, receipts)
        except Exception as exc:
            # The answer to a COMMIT that took effect can be lost with the connection: trust
            # the row, not the error, so the writer and resume always agree.
            done = self._committed_despite(checkpoint_id, exc)
            if done is None:
                self._mark_failed(checkpoint_id, exc)
                raise
            info = done
        except BaseException as exc:
            self._mark_failed(checkpoint_id, exc)
            raise
        self._apply_retention()
        return info

    def _committed_despite(self, checkpoint_id: int, exc: Exception) -> CheckpointInfo | None:
        try:
            with self.db.read() as session:
                row = session.get(Checkpoint, checkpoint_id)
                if row is None or row.status != Status.COMMITTED:
                    return None
                info = _info(row, self.name, q.components_of(session, checkpoint_id))
        except Exception:  # the database is still unreachable: report the original error
            return None
        log.warning(
            "checkpoint at step %d of run %r committed although the commit reported %r",
            info.step,
            self.name,
            exc,
        )
        return info

    def _commit(
        self, checkpoint_id: int, request: _SaveRequest, receipts: list[ShardReceipt]
    ) -> CheckpointInfo:
        claims: dict[str, q.BlobClaim] = {}
        for receipt in receipts:
            for ref in receipt.result.blobs:
                claim = q.BlobClaim(
                    ref.digest,
                    ref.kind.name.lower(),
                    ref.logical_bytes,
                    ref.stored_bytes,
                    ref.codec.name.lower() if ref.codec is not None else None,
                    ref.uploaded,
                )
                known = claims.get(ref.digest)
                if known is None or (claim.uploaded and not known.uploaded):
                    claims[ref.digest] = claim
        logical = sum(r.result.logical_bytes for r in receipts)
        uploaded = sum(c.stored_bytes for c in claims.values() if c.uploaded)
        rows = [
            q.ComponentRow(
                r.component,
                r.kind,
                r.result.index_digest,
                r.result.logical_bytes,
                r.result.stored_bytes,
                r.result.entries,
            )
            for r in receipts
        ]

        def transaction(session: Session) -> None:
            assert self.epoch is not None
            q.lock_run(session, self.id, self.epoch)
            q.hold_gc_lock_shared(session)
            existing = q.blob_rows(session, list(claims))
            for digest, size in self._revalidate(claims, existing).items():
                claim = claims[digest]
                if digest not in existing and not claim.uploaded and claim.stored_bytes != size:
                    # Claimed as "already stored" from a row GC has since removed: the new
                    # row takes the object's real size, not the claim's placeholder.
                    claims[digest] = dataclasses.replace(claim, stored_bytes=size)
            stored = sum(
                existing[d].stored_bytes if d in existing else c.stored_bytes
                for d, c in claims.items()
            )
            q.record_blobs(session, checkpoint_id, claims.values())
            q.record_components(session, checkpoint_id, rows)
            q.finish_commit(
                session,
                checkpoint_id,
                {
                    "training_info": request.training_info,
                    "metrics": request.metrics,
                    "logical_bytes": logical,
                    "stored_bytes": stored,
                    "uploaded_bytes": uploaded,
                    "save_seconds": time.perf_counter() - request.started,
                    "blocked_seconds": request.blocked,
                },
            )

        self.db.write(transaction, what=f"committing checkpoint at step {request.step}")
        with self.db.read() as session:
            row = session.get(Checkpoint, checkpoint_id)
            assert row is not None
            return _info(row, self.name, q.components_of(session, checkpoint_id))

    def _revalidate(
        self, claims: Mapping[str, q.BlobClaim], existing: Mapping[str, Blob]
    ) -> dict[str, int]:
        """Every blob must exist: live rows are trusted (GC condemns before it deletes), anything
        else is checked in the store now, while the commit holds the GC lock — also blobs this
        save uploaded, since a save slower than the GC grace period could see them swept as
        orphans before their rows exist. Returns the checked objects' sizes.
        """
        to_check = [d for d in claims if d not in existing or existing[d].state != BlobState.LIVE]
        if not to_check:
            return {}
        with ThreadPoolExecutor(min(16, len(to_check))) as pool:
            sizes = dict(zip(to_check, pool.map(self._object_size, to_check), strict=True))
        missing = [d for d, size in sizes.items() if size is None]
        if missing:
            raise SaveError(
                f"{len(missing)} blob(s) this checkpoint references are missing from "
                f"{self.store.url}, e.g. {blob_key(missing[0])} (garbage-collected while the "
                "save ran?); nothing was committed and the next save uploads them again"
            )
        return {d: size for d, size in sizes.items() if size is not None}

    def _object_size(self, digest: str) -> int | None:
        try:
            return self.store.head(blob_key(digest)).size
        except ObjectNotFoundError:
            return None

    def _is_live_blob(self, digest: str) -> bool:
        with self.db.read() as session:
            return q.blob_state(session, digest) == BlobState.LIVE

    def _mark_failed(self, checkpoint_id: int, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        try:
            self.db.write(
                lambda s: q.mark(s, checkpoint_id, Status.FAILED, reason, only_if=Status.PENDING),
                what="marking a failed checkpoint",
            )
        except Exception:  # best effort: the row stays pending, which resume never sees
            log.exception("could not mark checkpoint %d as failed", checkpoint_id)

    def _apply_retention(self) -> None:
        if self.retention.keep_top_k is None:
            return

        def transaction(session: Session) -> list[int]:
            assert self.epoch is not None
            # A writer fenced since its commit must not prune the new writer's checkpoints.
            q.lock_run(session, self.id, self.epoch)
            rows = q.checkpoints_of(session, self.id, [Status.COMMITTED])
            doomed = to_delete((Candidate(r.id, r.step, r.metrics) for r in rows), self.retention)
            q.mark_deleted(session, doomed)
            return sorted(doomed)

        try:
            doomed = self.db.write(transaction, what="applying retention")
        except FencedError:
            log.warning("run %r has a newer writer; this stale writer skips retention", self.name)
            return
        except Exception:  # the checkpoint is committed; retention runs again next time
            log.exception("retention failed for run %r; it will be retried", self.name)
            return
        if doomed:
            log.info("retention marked %d checkpoint(s) of %r deleted", len(doomed), self.name)

    def finalize(self) -> CheckpointInfo | None:
        """Wait for the save in flight; raise its error if it failed and was not reported."""
        handle = self._pending
        if handle is None:
            return None
        self._wait_previous()
        return handle._future.result() if handle._future.exception() is None else None

    # -- reading ----------------------------------------------------------------------------

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint, or None. One indexed query."""
        with self.db.read() as session:
            found = q.latest_with_components(session, self.id)
        return None if found is None else _info(found[0], self.name, found[1])

    def checkpoints(self, statuses: Sequence[str] | None = None) -> list[CheckpointInfo]:
        """Every checkpoint of the run (optionally only some statuses), oldest first."""
        with self.db.read() as session:
            return [
                _info(row, self.name, q.components_of(session, row.id))
                for row in q.checkpoints_of(session, self.id, statuses)
            ]

    def load(
        self,
        step: int | None = None,
        *,
        components: Iterable[str] | None = None,
        paths: Mapping[str, Iterable[str]] | None = None,
        fallback: bool = True,
    ) -> LoadedCheckpoint:
        """Load a committed checkpoint: ``step``, or the newest one.

        ``components`` limits which components load; ``paths`` maps a component to the entry
        paths (or ``prefix/`` subtrees) to load from it. When loading the newest checkpoint and
        it fails verification, it is marked corrupt and the previous committed one is tried
        (``fallback``); the skipped ones are reported in the result and in the log.
        """
        wanted = set(components) if components is not None else None
        if step is not None:
            with self.db.read() as session:
                row = q.committed_at_step(session, self.id, step)
                comps = q.components_of(session, row.id)
            return LoadedCheckpoint(
                _info(row, self.name, comps), self._load_components(row.step, comps, wanted, paths)
            )
        skipped: list[tuple[int, str]] = []
        before: int | None = None
        while True:
            with self.db.read() as session:
                found = q.latest_committed(session, self.id, before_step=before)
                comps = q.components_of(session, found.id) if found is not None else []
            if found is None:
                detail = f"; skipped corrupt steps {[s for s, _ in skipped]}" if skipped else ""
                raise CheckpointNotFoundError(
                    f"run {self.name!r} has no committed checkpoint to load{detail}"
                )
            try:
                state = self._load_components(found.step, comps, wanted, paths)
            except IntegrityError as exc:
                if not fallback:
                    raise
                if isinstance(exc, MissingBlobError):
                    self._check_store_holds(found.id, found.step, comps, exc)
                self._mark_corrupt(found.id, found.step, exc)
                skipped.append((found.step, str(exc)))
                before = found.step
                continue
            return LoadedCheckpoint(_info(found, self.name, comps), state, tuple(skipped))

    def _load_components(
        self,
        step: int,
        comps: Sequence[Any],
        wanted: set[str] | None,
        paths: Mapping[str, Iterable[str]] | None,
    ) -> dict[str, Any]:
        names = {c.name for c in comps}
        for name in [*(wanted or ()), *(paths or {})]:
            if name not in names:
                raise KeyError(
                    f"run {self.name!r} step {step} has no component {name!r}; "
                    f"it has {sorted(names)}"
                )
        with self.db.read() as session:
            # The manifest's record of each index's length bounds what a read may allocate.
            rows = q.blob_rows(session, [c.index_digest for c in comps], lock=False)
            sizes = {digest: row.logical_bytes for digest, row in rows.items()}
        state: dict[str, Any] = {}
        for comp in comps:
            if wanted is not None and comp.name not in wanted:
                continue
            context = f"run {self.name!r}, step {step}, component {comp.name!r}"
            size = sizes.get(comp.index_digest)
            if paths is not None and comp.name in paths:
                state[comp.name] = load_paths(
                    self.store, comp.index_digest, paths[comp.name], context=context, index_len=size
                )
            elif paths is None or wanted is not None or comp.name in paths:
                state[comp.name] = load_component(
                    self.store, comp.index_digest, context=context, index_len=size
                )
        return state

    def _check_store_holds(
        self, checkpoint_id: int, step: int, comps: Sequence[Any], exc: MissingBlobError
    ) -> None:
        """A missing blob makes a checkpoint corrupt only if the store is the right one: when
        none of the checkpoint's other blobs are there either, the store URL is wrong (an empty
        directory, another prefix), and marking anything corrupt would condemn good data."""
        with self.db.read() as session:
            others = [c.index_digest for c in comps] + q.checkpoint_digests(
                session, checkpoint_id, limit=16
            )
        others = list(dict.fromkeys(d for d in others if d != exc.digest))
        if not others or any(self.store.exists(blob_key(d)) for d in others):
            return
        raise StoreNotFoundError(
            f"{exc}; none of the other {len(others)} blobs of run {self.name!r} step {step} "
            f"that were looked for exist in {self.store.url} either. Is the store URL right "
            "(--store, CKPTSTORE_STORE, the bucket and prefix)? Nothing was marked corrupt."
        ) from exc

    def _mark_corrupt(self, checkpoint_id: int, step: int, exc: IntegrityError) -> None:
        log.error(
            "CHECKPOINT CORRUPT: run %r step %d failed verification (%s); it is marked corrupt "
            "and the previous committed checkpoint is used instead",
            self.name,
            step,
            exc,
        )
        digest = exc.digest

        def transaction(session: Session) -> None:
            # Commits are held off until the damaged object is out of the way (see verify).
            q.hold_gc_lock_exclusive(session)
            q.mark(session, checkpoint_id, Status.CORRUPT, str(exc))
            if digest is not None:
                q.condemn_blob(session, digest)
                self._quarantine(digest)

        try:
            self.db.write(transaction, what="marking a corrupt checkpoint")
        except Exception:
            log.exception("could not mark checkpoint %d corrupt", checkpoint_id)

    def _quarantine(self, digest: str) -> None:
        try:
            quarantine_blob(self.store, digest)
        except CkptStoreError:
            log.exception("could not quarantine damaged blob %s", blob_key(digest))

    # -- lifecycle --------------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self._closed:
            raise ConfigError(f"run {self.name!r} is closed")
        if self.epoch is None:
            raise ConfigError(
                f"run {self.name!r} was opened read-only; open it with writable=True to save"
            )

    def close(self) -> None:
        """Flush the pending save (raising its error), then release threads and connections."""
        if self._closed:
            return
        try:
            self.finalize()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._writer.close()
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


def _plain_json(value: Mapping[str, Any] | None, what: str) -> dict[str, Any] | None:
    """A JSON copy of ``value`` for the database; NaN and infinities become null (a diverged
    metric must not stop a checkpoint, and SQL JSON has no NaN)."""
    if value is None:
        return None
    try:
        return dict(json.loads(json.dumps(_finite(dict(value)), allow_nan=False)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{what} must be JSON-serializable (it is stored in the manifest database): {exc}"
        ) from exc
    except RecursionError:
        raise ConfigError(
            f"{what} is nested too deeply to store in the manifest database; flatten it"
        ) from None


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _parse_fork(fork_from: str | tuple[str, int]) -> tuple[str, int]:
    if isinstance(fork_from, tuple):
        return fork_from
    name, sep, step = fork_from.rpartition("@")
    if not sep or not step.isdigit():
        raise ConfigError(f"fork_from={fork_from!r}: use 'RUN@STEP', e.g. 'base@100'")
    return name, int(step)


def open_run(
    name: str,
    *,
    db: str | Path | Database | None = None,
    store: str | Path | ObjectStore | None = None,
    config: Mapping[str, Any] | None = None,
    writable: bool = True,
    retention: RetentionPolicy | None = None,
    writer_options: WriterOptions | None = None,
    async_save: bool = True,
    fork_from: str | tuple[str, int] | None = None,
    allow_config_change: bool = False,
) -> Run:
    """Open (or create) the run ``name``.

    Args:
        db: Manifest database URL or SQLite path; default ``$CKPTSTORE_DB`` or
            ``./.ckptstore/manifest.db``.
        store: Object store URL or directory; default ``$CKPTSTORE_STORE`` or
            ``./.ckptstore/store``.
        config: The run's configuration (JSON). Reopening a run with a different config is
            refused unless ``allow_config_change``.
        writable: Open as the run's writer. This bumps the run's writer epoch, so an older
            writer still alive can no longer commit (fencing).
        retention: Which committed checkpoints to keep; default keeps all.
        fork_from: ``"RUN@STEP"`` of the checkpoint a new run starts from (lineage).
    """
    if not name or len(name) > 255:
        raise ConfigError("run name must be 1-255 characters")
    retention = retention or RetentionPolicy()
    owns: list[Any] = []
    database = db if isinstance(db, Database) else Database(db if db is not None else default_db())
    if not isinstance(db, Database):
        owns.append(database)
    try:
        objects = (
            store
            if isinstance(store, ObjectStore)
            else open_store(store if store is not None else default_store())
        )
        if not isinstance(store, ObjectStore):
            owns.append(objects)
        cfg = _plain_json(config, "config")
        fingerprint = config_fingerprint(cfg) if cfg is not None else None

        def open_row(session: Session) -> tuple[int, int | None]:
            run = q.find_run(session, name)
            if run is None:
                if not writable:
                    raise CheckpointNotFoundError(f"no run named {name!r} in {database!r}")
                parent = None
                if fork_from is not None:
                    parent_name, parent_step = _parse_fork(fork_from)
                    parent_run = q.find_run(session, parent_name)
                    if parent_run is None:
                        raise CheckpointNotFoundError(f"fork_from: no run named {parent_name!r}")
                    parent = q.committed_at_step(session, parent_run.id, parent_step).id
                run = q.create_run(
                    session,
                    name,
                    config=cfg,
                    fingerprint=fingerprint,
                    parent_checkpoint_id=parent,
                    metric_name=retention.metric_name,
                    higher_is_better=retention.higher_is_better,
                )
            elif (
                fingerprint is not None
                and run.config_fingerprint not in (None, fingerprint)
                and not allow_config_change
            ):
                changed = _changed_keys(run.config or {}, cfg or {})
                raise ConfigError(
                    f"run {name!r} was created with a different config (changed: {changed}); "
                    "use a new run name, fork it, or pass allow_config_change=True"
                )
            elif writable:
                if fingerprint is not None:
                    run.config, run.config_fingerprint = cfg, fingerprint
                if retention.metric_name is not None:
                    run.metric_name = retention.metric_name
                    run.higher_is_better = retention.higher_is_better
            epoch = q.bump_epoch(session, run.id) if writable else None
            if epoch is not None:
                q.abandon_pending(session, run.id, epoch)
            return run.id, epoch

        try:
            run_id, epoch = database.write(open_row, what=f"opening run {name!r}")
        except SQLIntegrityError:
            # Another process created the same run at the same moment: open the existing row.
            run_id, epoch = database.write(open_row, what=f"opening run {name!r}")
        return Run(
            db=database,
            store=objects,
            run_id=run_id,
            name=name,
            epoch=epoch,
            retention=retention,
            writer_options=writer_options,
            async_save=async_save,
            owns=owns,
        )
    except BaseException:
        for resource in reversed(owns):
            resource.close()
        raise


def _changed_keys(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]
