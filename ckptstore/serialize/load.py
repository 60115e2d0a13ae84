"""Loading a component, some of its entries, or a byte range of one tensor.

Only the blobs the requested entries reference are fetched; each is verified against its
digest on the way in. Blobs are fetched on a thread pool and copied into their destinations as
they arrive, so at most ``max_workers`` decoded blobs are held besides the results. A tensor that
is exactly one raw blob becomes a view of the fetched buffer (no copy).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptstore.cas.blobs import get_blob
from ckptstore.cas.header import Kind
from ckptstore.errors import IntegrityError, SerializationError
from ckptstore.objectstore.base import ObjectStore
from ckptstore.serialize.dtypes import numpy_dtype, torch_dtype
from ckptstore.serialize.index import ComponentIndex, Entry, decode_index
from ckptstore.serialize.tree import rebuild

#: The largest index blob a load accepts (an index of a million entries is ~200 MiB).
MAX_INDEX_BYTES = 1 << 30


def max_blob_len(targets: Iterable[tuple[str, int, int]]) -> int:
    """The most raw bytes a data blob can hold, given the (path, offset, length) of every
    index entry that points into it: its items, plus a pack's table of contents (JSON of the
    items' names and offsets) and trailer."""
    end, toc = 0, 64 << 10
    for path, offset, length in targets:
        end = max(end, offset + length)
        toc += 6 * len(path.encode()) + 96
    return end + toc


def read_index(
    store: ObjectStore, index_digest: str, *, context: str = "", index_len: int | None = None
) -> ComponentIndex:
    """Fetch, verify and validate a component's index.

    ``index_len`` is the index's raw length as the manifest recorded it, when known: a stored
    object declaring another length is refused before anything is allocated for it.
    """
    bound = MAX_INDEX_BYTES if index_len is None else min(index_len, MAX_INDEX_BYTES)
    header, raw = get_blob(store, index_digest, context=_ctx(context, "index"), max_raw_len=bound)
    where = f"index {index_digest}" + (f" ({context})" if context else "")
    if header.kind is not Kind.INDEX:
        raise IntegrityError(f"{where}: blob is a {header.kind.name.lower()}, not an index")
    return decode_index(raw, where)


def _ctx(context: str, detail: str) -> str:
    return f"{context}, {detail}" if context else detail


@dataclass(slots=True)
class _Target:
    """Where one segment's bytes go: ``buffer[dest:dest+length]`` from ``offset`` in the blob."""

    entry: int
    offset: int
    length: int
    dest: int


class _Assembler:
    """Collects entry buffers while blobs arrive."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.buffers: list[Any] = [None] * len(entries)
        self._lock = threading.Lock()

    def place(self, digest: str, raw: memoryview, targets: list[_Target], where: str) -> None:
        """Copy (or hand over) one verified blob's bytes to every entry segment it holds.

        Called from several threads at once; segments of one entry never overlap, so only
        the allocation of an entry's buffer needs the lock.
        """
        for t in targets:
            if t.offset + t.length > raw.nbytes:
                path = self.entries[t.entry].path
                raise IntegrityError(f"{where}: entry {path!r} points past the end of the blob")
        handed_over = False
        for t in targets:
            entry = self.entries[t.entry]
            whole = t.offset == 0 and t.length == raw.nbytes == entry.nbytes
            if whole and not raw.readonly and not handed_over:
                # The blob's buffer becomes the tensor's memory: no copy. Only once, so two
                # equal tensors never share memory.
                self.buffers[t.entry] = raw
                handed_over = True
                continue
            with self._lock:
                if self.buffers[t.entry] is None:
                    self.buffers[t.entry] = _allocate(entry.nbytes, where)
            self.buffers[t.entry][t.dest : t.dest + t.length] = raw[t.offset : t.offset + t.length]


def _allocate(nbytes: int, where: str) -> memoryview:
    """An uninitialized buffer (every byte is written before use; zero-filling would only
    cost a second pass over the memory)."""
    try:
        return memoryview(np.empty(nbytes, dtype=np.uint8).data)
    except (MemoryError, ValueError):
        raise IntegrityError(
            f"{where}: cannot allocate {nbytes} bytes for an entry (a corrupt index, or too "
            "little memory)"
        ) from None


def _materialize(entry: Entry, buffer: memoryview | None, where: str) -> Any:
    if not entry.is_array:
        if entry.kind == "dtype":
            return torch_dtype(entry.value, where)
        if entry.kind == "float":
            return struct.unpack("<d", bytes.fromhex(entry.value))[0]
        return entry.value
    data = buffer if buffer is not None else _allocate(entry.nbytes, where)
    if entry.kind == "bytes":
        return bytes(data)
    if entry.kind == "bytearray":
        return bytearray(data)
    if entry.kind == "tensor":
        dtype = torch_dtype(entry.dtype, where)
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        flat = torch.frombuffer(data, dtype=torch.uint8)
        return flat.view(dtype).reshape(entry.shape)
    array = np.frombuffer(data, dtype=numpy_dtype(entry.dtype, where)).reshape(entry.shape)
    return array[()] if entry.kind == "npscalar" else array


def load_entries(
    store: ObjectStore,
    index: ComponentIndex,
    entries: Iterable[int],
    *,
    context: str = "",
    max_workers: int = 0,
) -> dict[int, Any]:
    """Load the given entries (by position in ``index.entries``); returns position -> value."""
    wanted = sorted(set(entries))
    chosen = [index.entries[i] for i in wanted]
    assembler = _Assembler(chosen)
    by_blob: dict[str, list[_Target]] = {}
    for n, entry in enumerate(chosen):
        dest = 0
        for seg in entry.segments:
            by_blob.setdefault(seg.digest, []).append(_Target(n, seg.offset, seg.length, dest))
            dest += seg.length

    def fetch(digest: str) -> None:
        paths = ", ".join(sorted({chosen[t.entry].path for t in by_blob[digest]})[:3])
        blob_context = _ctx(context, f"entry {paths}")
        bound = max_blob_len((chosen[t.entry].path, t.offset, t.length) for t in by_blob[digest])
        header, raw = get_blob(store, digest, context=blob_context, max_raw_len=bound)
        if header.kind is Kind.INDEX:
            raise IntegrityError(f"blob {digest} ({blob_context}) is an index, not data")
        assembler.place(digest, raw, by_blob[digest], blob_context)

    workers = max_workers or store.read_concurrency
    with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-load") as pool:
        for future in [pool.submit(fetch, d) for d in by_blob]:
            future.result()
    where = f"component {context}" if context else "component"
    return {
        i: _materialize(entry, assembler.buffers[n], where)
        for n, (i, entry) in enumerate(zip(wanted, chosen, strict=True))
    }


def load_component(
    store: ObjectStore,
    index_digest: str,
    *,
    context: str = "",
    max_workers: int = 0,
    index_len: int | None = None,
) -> Any:
    """Load a whole component back into its original structure."""
    index = read_index(store, index_digest, context=context, index_len=index_len)
    values = load_entries(
        store, index, range(len(index.entries)), context=context, max_workers=max_workers
    )
    ordered = [values[i] for i in range(len(index.entries))]
    return rebuild(
        index.tree, ordered, f"index {index_digest}" + (f" ({context})" if context else "")
    )


def select(index: ComponentIndex, paths: Iterable[str]) -> list[int]:
    """Positions of entries named by ``paths``: exact paths, or ``prefix/`` for a subtree."""
    chosen: list[int] = []
    for path in paths:
        hits = [
            i
            for i, e in enumerate(index.entries)
            if e.path == path or (path.endswith("/") and e.path.startswith(path))
        ]
        if not hits:
            raise KeyError(f"no entry {path!r} in this component")
        chosen.extend(hits)
    return chosen


def load_paths(
    store: ObjectStore,
    index_digest: str,
    paths: Iterable[str],
    *,
    context: str = "",
    index_len: int | None = None,
    max_workers: int = 0,
) -> dict[str, Any]:
    """Load only the named entries (or subtrees); returns path -> value."""
    index = read_index(store, index_digest, context=context, index_len=index_len)
    positions = select(index, paths)
    values = load_entries(store, index, positions, context=context, max_workers=max_workers)
    return {index.entries[i].path: values[i] for i in positions}


def load_byte_range(
    store: ObjectStore,
    index_digest: str,
    path: str,
    start: int,
    stop: int,
    *,
    context: str = "",
) -> bytearray:
    """Bytes ``[start, stop)`` of one array entry, fetching only the blobs that hold them.

    Each fetched blob is verified whole, so the granularity is one chunk (64 MiB by default).
    """
    index = read_index(store, index_digest, context=context)
    try:
        entry = index.entry(path)
    except KeyError:
        raise KeyError(f"no entry {path!r} in this component") from None
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
                for e in index.entries
                for s in e.segments
                if s.digest == seg.digest
            )
            _, raw = get_blob(
                store, seg.digest, context=_ctx(context, f"entry {path}"), max_raw_len=bound
            )
            if seg.offset + seg.length > raw.nbytes:
                raise IntegrityError(f"entry {path!r} points past the end of blob {seg.digest}")
            out[lo - start : hi - start] = raw[seg.offset + lo - pos : seg.offset + hi - pos]
        pos += seg.length
    return out
