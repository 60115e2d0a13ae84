"""Reading one stored component through its index: the index once, then any part of it.

The index is fetched, verified against its digest and validated on first use, and kept: every
load after that fetches only the data blobs it needs (see :mod:`ckptstore.serialize.assemble`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ckptstore.cas.blobs import get_blob
from ckptstore.cas.header import MAX_RAW_LEN, Kind
from ckptstore.errors import IntegrityError, SerializationError
from ckptstore.objectstore.base import ObjectStore
from ckptstore.serialize.assemble import load_entries, max_blob_len, with_context
from ckptstore.serialize.index import ComponentIndex, Entry, decode_index
from ckptstore.serialize.tree import rebuild

#: The largest index blob a load accepts (an index of a million entries is ~200 MiB).
MAX_INDEX_BYTES = 1 << 30


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
        # The manifest's length is evidence about the blob (a header declaring more is
        # damaged); MAX_INDEX_BYTES is only this reader's cap (more is unreadable here).
        header, raw = get_blob(
            self.store,
            self.index_digest,
            context=with_context(self.context, "index"),
            max_raw_len=MAX_RAW_LEN if self.index_len is None else self.index_len,
            limit=MAX_INDEX_BYTES,
        )
        if header.kind is not Kind.INDEX:
            raise IntegrityError(
                f"{self._where}: blob is a {header.kind.name.lower()}, not an index"
            )
        return decode_index(raw, self._where)

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

    def load_entries(self, positions: Iterable[int], *, max_workers: int = 0) -> dict[int, Any]:
        """The values of the entries at ``positions`` in :attr:`entries`: position -> value."""
        return load_entries(
            self.store, self.index, positions, context=self.context, max_workers=max_workers
        )

    def values(self, *, max_workers: int = 0) -> list[Any]:
        """Every entry's value, in the order of :attr:`entries`."""
        positions = range(len(self.entries))
        loaded = self.load_entries(positions, max_workers=max_workers)
        return [loaded[i] for i in positions]

    def load(self, *, max_workers: int = 0) -> Any:
        """The whole component, rebuilt into its original structure."""
        return rebuild(self.index.tree, self.values(max_workers=max_workers), self._where)

    def load_paths(self, paths: Iterable[str], *, max_workers: int = 0) -> dict[str, Any]:
        """Only the named entries, or ``prefix/`` for a subtree; returns path -> value."""
        positions = self.index.select(paths)
        values = self.load_entries(positions, max_workers=max_workers)
        return {self.entries[i].path: values[i] for i in positions}

    def byte_range(self, path: str, start: int, stop: int) -> bytearray:
        """Bytes ``[start, stop)`` of one array entry, fetching only the blobs that hold them.

        Each fetched blob is verified whole, so the granularity is one chunk (64 MiB by default).
        """
        entry = self.entry(path)
        if not entry.is_array:
            raise SerializationError(f"{path}: not an array entry, it has no bytes")
        if not 0 <= start <= stop <= entry.nbytes:
            raise SerializationError(
                f"{path}: byte range [{start}, {stop}) is outside its {entry.nbytes} bytes"
            )
        out = bytearray(stop - start)
        pos = 0
        for seg in entry.segments:
            lo, hi = max(start, pos), min(stop, pos + seg.length)
            if lo < hi:
                bound = max_blob_len(
                    (e.path, s.offset, s.length)
                    for e in self.entries
                    for s in e.segments
                    if s.digest == seg.digest
                )
                _, raw = get_blob(
                    self.store,
                    seg.digest,
                    context=with_context(self.context, f"entry {path}"),
                    max_raw_len=bound,
                )
                if seg.offset + seg.length > raw.nbytes:
                    raise IntegrityError(f"entry {path!r} points past the end of blob {seg.digest}")
                out[lo - start : hi - start] = raw[seg.offset + lo - pos : seg.offset + hi - pos]
            pos += seg.length
        return out
