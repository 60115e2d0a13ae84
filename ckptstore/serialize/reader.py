"""Reading one stored component through its index: the index once, then any part of it.

The index is fetched, verified against its digest and validated on first use, and kept: every
load after that fetches only the data blobs it needs (see :mod:`ckptstore.serialize.assemble`).

Byte ranges of array entries (for resharding) are read through a :class:`BlobCache`, which a
batch of reads -- over one component or several -- shares: each data blob the batch needs is
fetched and verified once, by whichever read asks first, and dropped after the last read that
counted on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from ckptstore.cas.blobs import decode_held, get_blob
from ckptstore.errors import IntegrityError, SerializationError
from ckptstore.objectstore.base import ObjectStore
from ckptstore.serialize.assemble import (
    EntryLoad,
    fetch_all,
    load_entries,
    max_blob_len,
    with_context,
)
from ckptstore.serialize.index import ComponentIndex, Entry, Segment
from ckptstore.serialize.indexes import fetch_index
from ckptstore.serialize.tree import rebuild, tensor_paths


class PlannedLoad:
    """A component's load planned by :meth:`ComponentReader.plan`: its blobs' destinations,
    and how its entries' values become the value the caller gets."""

    def __init__(self, load: EntryLoad, finish: Callable[[dict[int, Any]], Any]) -> None:
        self.load, self._finish = load, finish

    def value(self) -> Any:
        """The loaded value, once :func:`load_components` has fetched every blob."""
        return self._finish(self.load.results())


def load_components(
    store: ObjectStore, plans: Sequence[PlannedLoad], *, max_workers: int = 0
) -> list[Any]:
    """Fetch the blobs of every plan as one load (one pool, one read-ahead over all of them:
    see :func:`ckptstore.serialize.assemble.fetch_all`); each plan's value, in order."""
    fetch_all(store, [plan.load for plan in plans], max_workers=max_workers)
    return [plan.value() for plan in plans]


class ComponentReader:
    """One component of a checkpoint, read through its index (fetched once, on first use).

    ``context`` (run, step, component) goes into every error message. ``index_len`` is the
    index's raw length as the manifest recorded it, when known: a stored object declaring
    another length is refused before anything is allocated for it. A reader may be shared
    between threads; a failed index fetch is tried again at the next use.
    """

    def __init__(
        self,
        store: ObjectStore,
        index_digest: str,
        *,
        context: str = "",
        index_len: int | None = None,
    ) -> None:
        self.store = store
        self.index_digest = index_digest
        self.context = context
        self.index_len = index_len
        self._where = f"index {index_digest}" + (f" ({context})" if context else "")
        self._index: ComponentIndex | None = None
        self._lock = threading.Lock()

    @property
    def index(self) -> ComponentIndex:
        """The component's index: fetched, verified and validated on first use, then kept."""
        with self._lock:
            if self._index is None:
                self._index = self._fetch_index()
            return self._index

    def _fetch_index(self) -> ComponentIndex:
        return fetch_index(
            self.store, self.index_digest, context=self.context, index_len=self.index_len
        )

    @property
    def entries(self) -> tuple[Entry, ...]:
        """The component's entries, in index order (the order of :meth:`values`)."""
        return self.index.entries

    @property
    def digests(self) -> set[str]:
        """Every data blob the index references (the index blob itself excluded)."""
        return self.index.digests

    def entry(self, path: str) -> Entry:
        """The entry at ``path``; ``KeyError`` if the component has none."""
        try:
            return self.index.entry(path)
        except KeyError:
            raise KeyError(f"no entry {path!r} in this component") from None

    def plan(
        self, paths: Iterable[str] | None = None, *, into: Any = None, atomic: bool = True
    ) -> PlannedLoad:
        """The load of the whole component (``paths`` None: its value is what :meth:`load`
        returns) or of ``paths`` (as :meth:`load_paths`), planned, nothing fetched yet:
        :func:`load_components` fetches several components' plans as one load. ``into`` and
        ``atomic`` as for :meth:`load`; a tensor of ``into`` that does not match is a
        ``ConfigError`` here."""
        targets = tensor_paths(into) if into is not None else None
        whole = paths is None
        positions = range(len(self.entries)) if paths is None else self.index.select(paths)
        load = EntryLoad(
            self.store, self.index, positions, context=self.context, into=targets, atomic=atomic
        )

        def finish(values: dict[int, Any]) -> Any:
            if whole:
                return rebuild(self.index.tree, [values[i] for i in positions], self._where)
            return {self.entries[i].path: values[i] for i in positions}

        return PlannedLoad(load, finish)

    def load_entries(
        self, positions: Iterable[int], *, max_workers: int = 0, into: Any = None
    ) -> dict[int, Any]:
        """The values of the entries at ``positions`` in :attr:`entries`: position -> value.
        ``into``: a state like the saved one (see :meth:`load`)."""
        return load_entries(
            self.store,
            self.index,
            positions,
            context=self.context,
            max_workers=max_workers,
            into=tensor_paths(into) if into is not None else None,
        )

    def values(self, *, max_workers: int = 0, into: Any = None) -> list[Any]:
        """Every entry's value, in the order of :attr:`entries`."""
        positions = range(len(self.entries))
        loaded = self.load_entries(positions, max_workers=max_workers, into=into)
        return [loaded[i] for i in positions]

    def load(self, *, max_workers: int = 0, into: Any = None, atomic: bool = True) -> Any:
        """The whole component, rebuilt into its original structure.

        ``into``: a state of the same structure (e.g. the ``model.state_dict()`` that was
        saved): each of its tensors whose path matches an entry is filled with the stored
        bytes and the result holds that same tensor. A matching tensor of another dtype or
        shape is a ``ConfigError`` before anything is read. ``atomic`` (the default): the
        tensors are written once every blob has verified (all or nothing; the load holds the
        bytes until then); ``atomic=False``: a dense CPU (or GPU, through pinned staging
        buffers) tensor is written as its blobs arrive -- no new memory, no second copy -- and
        may hold unverified bytes if the load fails.
        """
        plan = self.plan(into=into, atomic=atomic)
        return load_components(self.store, [plan], max_workers=max_workers)[0]

    def load_paths(
        self, paths: Iterable[str], *, max_workers: int = 0, into: Any = None
    ) -> dict[str, Any]:
        """Only the named entries, or ``prefix/`` for a subtree; returns path -> value."""
        plan = self.plan(paths, into=into)
        loaded: dict[str, Any] = load_components(self.store, [plan], max_workers=max_workers)[0]
        return loaded

    def load_subtree(self, key: str) -> Any:
        """The value under top-level ``key`` of a dict component, rebuilt from the entries it
        holds only (the others are not fetched); ``KeyError`` if the component has no such key."""
        tree = self.index.tree
        pairs = tree.get("d", []) if isinstance(tree, dict) else []
        nodes = [p[1] for p in pairs if isinstance(p, list) and len(p) == 2 and p[0] == key]
        if len(nodes) != 1:
            raise KeyError(f"no top-level key {key!r} in this component")
        count = len(self.entries)
        positions = sorted({i for i in _entry_ids(nodes[0]) if 0 <= i < count})
        loaded = self.load_entries(positions)
        return rebuild(nodes[0], [loaded.get(i) for i in range(count)], self._where)

    def byte_range(self, path: str, start: int, stop: int) -> bytearray:
        """Bytes ``[start, stop)`` of one array entry, fetching only the blobs that hold them.

        Each fetched blob is verified whole, so the granularity is one chunk (64 MiB by default).
        For many ranges, share one :class:`BlobCache` between them instead.
        """
        entry = self.entry(path)
        if not entry.is_array:
            raise SerializationError(f"{path}: not an array entry, it has no bytes")
        if not 0 <= start <= stop <= entry.nbytes:
            raise SerializationError(
                f"{path}: byte range [{start}, {stop}) is outside its {entry.nbytes} bytes"
            )
        cache = BlobCache(self.store)
        cache.need(self, entry, [(start, stop)])
        span = cache.read(self, entry, start, stop)
        return span if isinstance(span, bytearray) else bytearray(span)


class BlobCache:
    """The data blobs one batch of byte-range reads needs, shared by the batch's threads.

    Announce every read first (:meth:`need`), then :meth:`read` each span: a blob is fetched
    (and verified) once, by whichever read asks first, and dropped when the last read that
    announced it has taken its bytes. The readers may belong to different components of one
    store (a blob two components share is fetched once). ``objects`` maps digests to stored
    objects already in hand (e.g. sent by another rank): those are decoded and verified from
    there, as if read from the store, and not fetched.
    """

    def __init__(self, store: ObjectStore, objects: dict[str, memoryview] | None = None) -> None:
        self.store = store
        self._objects = objects or {}
        self._lock = threading.Lock()
        self._refs: dict[str, int] = {}
        self._bounds: dict[str, int] = {}
        self._blobs: dict[str, Future[memoryview]] = {}
        #: Per index digest: data blob digest -> (path, offset, length) of the entries in it.
        self._targets: dict[str, dict[str, list[tuple[str, int, int]]]] = {}

    def need(self, reader: ComponentReader, entry: Entry, spans: Iterable[tuple[int, int]]) -> None:
        """Announce reads of the byte ``spans`` ``[lo, hi)`` of ``reader``'s ``entry``."""
        targets = self._targets.get(reader.index_digest)
        if targets is None:
            targets = self._targets[reader.index_digest] = {}
            for e in reader.entries:
                for s in e.segments:
                    targets.setdefault(s.digest, []).append((e.path, s.offset, s.length))
        for lo, hi in spans:
            for seg, _, _, _ in _pieces(entry, lo, hi):
                self._refs[seg.digest] = self._refs.get(seg.digest, 0) + 1
                bound = max_blob_len(targets.get(seg.digest, []))
                self._bounds[seg.digest] = max(self._bounds.get(seg.digest, 0), bound)

    def read(
        self, reader: ComponentReader, entry: Entry, lo: int, hi: int
    ) -> memoryview | bytearray:
        """Bytes ``[lo, hi)`` of ``entry`` (announced with :meth:`need`), writable: a view of
        the blob when one blob holds them all and may be written, else a copy."""
        where = with_context(reader.context, f"entry {entry.path}")
        pieces = _pieces(entry, lo, hi)
        if len(pieces) == 1:
            seg, a, b, pos = pieces[0]
            raw = self._get(seg.digest, seg.offset + seg.length, entry, where)
            try:
                start = seg.offset + a - pos
                span = raw[start : start + b - a]
                # A read-only blob (a decoded one) is copied from here: taking it again below
                # would release it twice, and the cache would drop it while reads still need it.
                return span if not raw.readonly else bytearray(span)
            finally:
                self._release(seg.digest)
        out = bytearray(hi - lo)
        for seg, a, b, pos in pieces:
            raw = self._get(seg.digest, seg.offset + seg.length, entry, where)
            try:
                start = seg.offset + a - pos
                out[a - lo : b - lo] = raw[start : start + b - a]
            finally:
                self._release(seg.digest)
        return out

    def _get(self, digest: str, needed: int, entry: Entry, where: str) -> memoryview:
        with self._lock:
            future = self._blobs.get(digest)
            owner = future is None
            if future is None:
                future = self._blobs[digest] = Future()
        if owner:
            try:
                bound = self._bounds.get(digest, needed)
                held = self._objects.pop(digest, None)
                if held is not None:
                    _, raw = decode_held(self.store, digest, held, context=where, max_raw_len=bound)
                else:
                    _, raw = get_blob(self.store, digest, context=where, max_raw_len=bound)
                if raw.nbytes < needed:
                    raise IntegrityError(
                        f"{where}: entry {entry.path!r} points past the end of blob {digest}"
                    )
            except BaseException as exc:
                future.set_exception(exc)
                raise
            future.set_result(raw)
        return future.result()

    def _release(self, digest: str) -> None:
        with self._lock:
            self._refs[digest] = self._refs.get(digest, 1) - 1
            if self._refs[digest] <= 0:
                self._blobs.pop(digest, None)


def blob_ends(entry: Entry, lo: int, hi: int) -> list[tuple[str, int]]:
    """(digest, the byte of the blob the span reaches) for each blob that bytes ``[lo, hi)``
    of ``entry`` touch."""
    return [(seg.digest, seg.offset + b - pos) for seg, _, b, pos in _pieces(entry, lo, hi)]


def _pieces(entry: Entry, lo: int, hi: int) -> list[tuple[Segment, int, int, int]]:
    """The segments of ``entry`` that bytes ``[lo, hi)`` touch: (segment, start, stop, where
    the segment starts in the entry)."""
    pieces, pos = [], 0
    for seg in entry.segments:
        a, b = max(lo, pos), min(hi, pos + seg.length)
        if a < b:
            pieces.append((seg, a, b, pos))
        pos += seg.length
    return pieces


def _entry_ids(node: Any) -> Iterator[int]:
    """The entry numbers a structure node refers to (rebuild validates the node itself)."""
    if isinstance(node, dict):
        for tag, body in node.items():
            if tag == "e" and isinstance(body, int):
                yield body
            else:
                yield from _entry_ids(body)
    elif isinstance(node, list):
        for item in node:
            yield from _entry_ids(item)
