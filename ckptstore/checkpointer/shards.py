"""Worker-side saving: processes that hold shards store them and hand back receipts.

A :class:`ShardWriter` needs only the object store, never database write access, so it works
inside a Ray actor, a torch rank or a multiprocessing child. The controller commits the
receipts of one step in a single transaction (``Run.save(..., receipts=[...])``), where every
blob a receipt names is checked again against the store.

A worker saves one of two ways:

- ``write(component, state)`` stores one component and returns its receipt; the caller is
  blocked (and must not mutate ``state``) until the upload is done.
- ``save({component: state, ...})`` blocks only for the snapshot -- a copy into host buffers
  that are reused from save to save -- and returns a :class:`ShardSave`; encoding, hashing and
  uploading run on a background thread. The caller may mutate its state as soon as ``save``
  returns, then collects the receipts with ``ShardSave.receipts()`` (or ``finalize()``).

As with ``Run.save`` (DESIGN.md §7), a writer has at most one save in flight: the next
``save``/``write`` first waits for it, and a failure nobody has seen yet raises ``SaveError``
there, at ``finalize()`` or at ``close()`` -- once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from ckptstore.cas.writer import BlobWriter, WriterOptions
from ckptstore.checkpointer.handle import OneInFlight, Pending, close_on_exit
from ckptstore.checkpointer.snapshot import Snapshotter
from ckptstore.errors import ConfigError, RunStateError, SaveError
from ckptstore.names import check_component_name, check_kind
from ckptstore.objectstore import ObjectStore, open_store
from ckptstore.serialize.save import ComponentResult, FlatState, flatten_state, write_flat
from ckptstore.tiers.stores import ReplicatingStore


@dataclass(frozen=True, slots=True)
class ShardReceipt:
    """What a worker stored for one component: small and picklable."""

    component: str
    result: ComponentResult
    kind: str = "state"
    #: ``time.time()`` when the writer began the save this receipt belongs to.
    started_at: float | None = None
    #: How long the writer's caller was blocked by that save (the snapshot, for ``save``).
    blocked_seconds: float = 0.0
    #: Encoding, hashing and uploading this component (in the background, for ``save``).
    upload_seconds: float = 0.0
    #: The nodes whose local tiers hold every blob it names, fsynced (a writer saving through
    #: the tiers, ``ckptstore.tiers``); empty: the object store holds them.
    nodes: tuple[str, ...] = ()

    @property
    def uploaded_bytes(self) -> int:
        """Bytes this worker uploaded (not already stored)."""
        return self.result.uploaded_bytes


class ShardSave(Pending[list[ShardReceipt]]):
    """An asynchronous :meth:`ShardWriter.save`; ``receipts()`` waits for its receipts."""

    def __init__(
        self,
        components: tuple[str, ...],
        future: Future[list[ShardReceipt]],
        *,
        started_at: float,
        blocked_seconds: float,
        store_url: str,
    ) -> None:
        super().__init__(future)
        self.components = components
        self.started_at = started_at
        self.blocked_seconds = blocked_seconds
        self._store_url = store_url

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"ShardSave({list(self.components)}, {state}, store={self._store_url!r})"

    def receipts(self, timeout: float | None = None) -> list[ShardReceipt]:
        """The receipts, one per component. Raises ``TimeoutError`` (the save goes on) if
        ``timeout`` seconds pass first, ``SaveError`` if the save failed."""
        return list(self._result(timeout))

    def _failure(self, error: BaseException) -> SaveError:
        return SaveError(
            f"the shard save of {list(self.components)} to {self._store_url} failed: "
            f"{type(error).__name__}: {error}; nothing from it can be committed -- save again"
        )


class ShardWriter:
    """Stores components from a worker process. Use one per process; close it when done."""

    def __init__(
        self,
        store: str | ObjectStore,
        *,
        options: WriterOptions | None = None,
        keep_snapshot_buffers: bool = True,
    ) -> None:
        """``keep_snapshot_buffers``: keep ``save``'s host buffers resident between saves (the
        default: a copy of the state held from the first async save to ``close``); False hands
        their memory back to the kernel once each save is stored (see
        :mod:`ckptstore.checkpointer.snapshot`)."""
        self._owns_store = not isinstance(store, ObjectStore)
        self.store = open_store(store) if not isinstance(store, ObjectStore) else store
        self._writer = BlobWriter(self.store, options)
        # Its buffers are reused by every save: safe, since one save at most is in flight.
        self._snapshotter = Snapshotter(keep_buffers=keep_snapshot_buffers)
        self._inflight: OneInFlight[ShardSave] = OneInFlight("ckpt-shards")
        self._closed = False

    def __repr__(self) -> str:
        return f"ShardWriter(store={self.store.url!r})"

    def write(self, component: str, state: Any, *, kind: str = "state") -> ShardReceipt:
        """Store ``state`` (do not mutate it until this returns) and return the receipt: a
        :meth:`save` of one component whose caller waits, with no snapshot copy."""
        started_at, started = time.time(), time.perf_counter()
        self._check_open()
        check_component_name(component)
        check_kind(kind)
        self._inflight.settle()
        upload_started = time.perf_counter()
        flats = {component: flatten_state(state)}
        (receipt,) = self._store(flats, {component: kind}, started_at, 0.0)
        ended = time.perf_counter()
        # The caller waited for all of it: the upload is blocked time too.
        return replace(
            receipt, blocked_seconds=ended - started, upload_seconds=ended - upload_started
        )

    def save(
        self, components: Mapping[str, Any], *, kinds: Mapping[str, str] | None = None
    ) -> ShardSave:
        """Snapshot every component (name -> state) and return; store them in the background.

        GPU tensors are copied into pinned host buffers. A previous save that failed unseen
        raises ``SaveError`` here, before anything new starts. ``kinds`` maps a component to
        its kind (default ``"state"``).
        """
        started_at, started = time.time(), time.perf_counter()
        self._check_open()
        kind_of = check_components(components, kinds)
        self._inflight.settle()
        flats = self._snapshotter.take(components)
        blocked = time.perf_counter() - started
        return self._inflight.submit(
            lambda: self._store_snapshot(flats, kind_of, started_at, blocked),
            lambda future: ShardSave(
                tuple(kind_of),
                future,
                started_at=started_at,
                blocked_seconds=blocked,
                store_url=self.store.url,
            ),
        )

    def finalize(self) -> list[ShardReceipt] | None:
        """Wait for the save in flight: its receipts, or its unreported failure raised as
        ``SaveError``; None if no save was in flight (or its failure was already reported)."""
        settled = self._inflight.settle()
        receipts = None if settled is None else settled._outcome()
        return None if receipts is None else list(receipts)

    def close(self) -> None:
        """Finalize (raising an unreported failure), then release the threads (and the store,
        if this writer opened it). Closing again does nothing."""
        if self._closed:
            return
        try:
            self.finalize()
        finally:
            self._closed = True
            self._inflight.shutdown()
            self._snapshotter.clear()
            self._writer.close()
            if self._owns_store:
                self.store.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        close_on_exit(self.close, exc, "shard save")

    def _check_open(self) -> None:
        if self._closed:
            raise RunStateError(f"{self!r} is closed; create a new ShardWriter to save")

    def _store_snapshot(
        self,
        flats: dict[str, FlatState],
        kind_of: dict[str, str],
        started_at: float,
        blocked: float,
    ) -> list[ShardReceipt]:
        """The background half of ``save``: the snapshot stored, then its memory may go."""
        try:
            return self._store(flats, kind_of, started_at, blocked)
        finally:
            self._snapshotter.release()

    def _store(
        self,
        flats: dict[str, FlatState],
        kind_of: dict[str, str],
        started_at: float,
        blocked: float,
    ) -> list[ShardReceipt]:
        """Every flattened component, stored in turn and made durable: their receipts."""
        self._writer.forget()
        receipts = []
        nodes = self.store.nodes if isinstance(self.store, ReplicatingStore) else ()
        for name, flat in flats.items():
            began = time.perf_counter()
            result = write_flat(self._writer, flat)
            upload = time.perf_counter() - began
            receipts.append(
                ShardReceipt(name, result, kind_of[name], started_at, blocked, upload, nodes)
            )
        self.store.flush()  # a receipt promises durable objects: the commit relies on it
        return receipts


def check_components(
    components: Mapping[str, Any], kinds: Mapping[str, str] | None
) -> dict[str, str]:
    """Each component's kind, after checking names and kinds; ConfigError names the problem."""
    if not isinstance(components, Mapping):
        raise ConfigError(
            f"components must be a mapping of name -> state, not {type(components).__name__}"
        )
    if not components:
        raise ConfigError("a shard save needs at least one component")
    for name in components:
        check_component_name(name)
    return check_kinds(components, kinds)


def check_kinds(components: Mapping[str, Any], kinds: Mapping[str, str] | None) -> dict[str, str]:
    """Each component's kind (default ``"state"``); ``kinds`` may name only these components,
    with valid kinds."""
    kinds = dict(kinds or {})
    unknown = sorted(set(kinds) - set(components))
    if unknown:
        raise ConfigError(
            f"kinds names {unknown}, which this save does not contain; "
            f"its components are {list(components)}"
        )
    for kind in kinds.values():
        check_kind(kind)
    return {name: kinds.get(name, "state") for name in components}
