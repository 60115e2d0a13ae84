"""The component index: the entry list and structure of one component, stored as a blob.

The index is JSON. Reading one never runs code, and every field is validated before anything
is allocated, so a crafted index from an untrusted bucket fails with ``SerializationError``.
Decoding one imports neither torch nor numpy (numpy only for an ``ndarray`` entry's dtype), so
readers without torch (the web UI) use :func:`decode_index` too.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckptstore.cas.digest import check_digest
from ckptstore.cas.header import MAX_RAW_LEN
from ckptstore.errors import CkptStoreError, SerializationError
from ckptstore.serialize.dtypes import element_size, numpy_dtype

FORMAT = "ckptstore/index"
VERSION = 1
MAX_DIMS = 64
#: Kinds of entries: array-like ones own bytes in blobs; the rest are JSON values.
ARRAY_KINDS = frozenset({"tensor", "ndarray", "npscalar", "bytes", "bytearray"})
JSON_KINDS = frozenset({"json", "dtype", "float"})


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` bytes at ``offset`` of blob ``digest``'s raw bytes."""

    digest: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Entry:
    """One value of a component: an array's bytes (in segments of blobs), or a JSON value."""

    path: str
    kind: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    segments: tuple[Segment, ...] = ()
    value: Any = None

    @property
    def is_array(self) -> bool:
        """Whether the entry owns bytes in blobs (else it holds a JSON ``value``)."""
        return self.kind in ARRAY_KINDS

    def to_json(self) -> dict[str, Any]:
        """The entry as the index document stores it."""
        if not self.is_array:
            return {"path": self.path, "kind": self.kind, "value": self.value}
        return {
            "path": self.path,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "segments": [[s.digest, s.offset, s.length] for s in self.segments],
        }


@dataclass(frozen=True, slots=True)
class ComponentIndex:
    """A component's structure tree and entry list, as its index blob stores them."""

    tree: Any
    entries: tuple[Entry, ...]

    def encode(self) -> bytes:
        """The index document as stored (compact JSON)."""
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "tree": self.tree,
            "entries": [e.to_json() for e in self.entries],
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()

    @property
    def digests(self) -> set[str]:
        """Every blob the entries reference (the index blob itself excluded)."""
        return {s.digest for e in self.entries for s in e.segments}

    @property
    def logical_bytes(self) -> int:
        """Bytes of array data the entries hold."""
        return sum(e.nbytes for e in self.entries)

    def entry(self, path: str) -> Entry:
        """The entry at ``path``; ``KeyError`` if there is none."""
        for e in self.entries:
            if e.path == path:
                return e
        raise KeyError(path)

    def select(self, paths: Iterable[str]) -> list[int]:
        """Positions of entries named by ``paths``: exact paths, or ``prefix/`` for a subtree."""
        chosen: list[int] = []
        for path in paths:
            hits = [
                i
                for i, e in enumerate(self.entries)
                if e.path == path or (path.endswith("/") and e.path.startswith(path))
            ]
            if not hits:
                raise KeyError(f"no entry {path!r} in this component")
            chosen.extend(hits)
        return chosen


def decode_index(data: bytes | memoryview, where: str) -> ComponentIndex:
    """Parse and validate an index blob's raw bytes."""
    try:
        doc = json.loads(bytes(data))
    except (ValueError, RecursionError) as exc:
        raise SerializationError(f"{where}: index is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SerializationError(f"{where}: not a ckptstore component index")
    if doc.get("version") != VERSION:
        raise SerializationError(
            f"{where}: index version {doc.get('version')!r} is not supported (this ckptstore "
            f"reads version {VERSION}); upgrade ckptstore"
        )
    raw_entries = doc.get("entries")
    if not isinstance(raw_entries, list):
        raise SerializationError(f"{where}: index has no entry list")
    entries = tuple(_entry(e, f"{where}, entry {i}") for i, e in enumerate(raw_entries))
    return ComponentIndex(tree=doc.get("tree"), entries=entries)


#: Sizes and offsets are 64-bit signed in every format ckptstore reads; a larger number is damage
#: (and would not even print: Python refuses to format ints of over 4,300 digits).
_MAX_INT = (1 << 63) - 1


def _int(value: Any, what: str, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= _MAX_INT:
        raise SerializationError(f"{where}: {what} must be an integer from {minimum} to 2**63-1")
    return value


def _entry(raw: Any, where: str) -> Entry:
    if not isinstance(raw, dict) or not isinstance(raw.get("path"), str):
        raise SerializationError(f"{where}: malformed entry")
    path, kind = raw["path"], raw.get("kind")
    where = f"{where} ({path!r})"
    if not isinstance(kind, str):
        raise SerializationError(f"{where}: entry kind must be a string, not {type(kind).__name__}")
    if kind in JSON_KINDS:
        value = raw.get("value")
        if kind == "dtype":
            element_size(str(value), where)
        elif kind == "float":
            if not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{16}", value)):
                raise SerializationError(f"{where}: a float entry holds 16 hex digits")
        elif not (value is None or isinstance(value, bool | int | float | str)):
            raise SerializationError(f"{where}: JSON entry holds a {type(value).__name__}")
        return Entry(path, kind, value=value)
    if kind not in ARRAY_KINDS:
        raise SerializationError(f"{where}: unknown entry kind {kind!r}")
    dtype = raw.get("dtype")
    if not isinstance(dtype, str):
        raise SerializationError(f"{where}: dtype must be a string")
    if kind == "tensor":
        itemsize = element_size(dtype, where)
    elif kind in ("bytes", "bytearray"):
        if dtype != "uint8":
            raise SerializationError(f"{where}: byte strings must have dtype uint8")
        itemsize = 1
    else:
        itemsize = numpy_dtype(dtype, where).itemsize
    shape = raw.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise SerializationError(f"{where}: shape must be a list of at most {MAX_DIMS} dims")
    dims = tuple(_int(d, "every dimension", where) for d in shape)
    nbytes = _int(raw.get("nbytes"), "nbytes", where)
    if math.prod(dims) * itemsize != nbytes:
        raise SerializationError(
            f"{where}: shape {list(dims)} of {dtype} needs {math.prod(dims) * itemsize} bytes, "
            f"the entry says {nbytes}"
        )
    segments = raw.get("segments")
    if not isinstance(segments, list):
        raise SerializationError(f"{where}: segments must be a list")
    segs = tuple(_segment(s, where) for s in segments)
    if sum(s.length for s in segs) != nbytes:
        raise SerializationError(
            f"{where}: segments cover {sum(s.length for s in segs)} bytes, not {nbytes}"
        )
    return Entry(path, kind, dtype, dims, nbytes, segs)


def _segment(raw: Any, where: str) -> Segment:
    if not isinstance(raw, list) or len(raw) != 3:
        raise SerializationError(f"{where}: malformed segment {raw!r}")
    try:
        digest = check_digest(raw[0])
    except CkptStoreError as exc:
        raise SerializationError(f"{where}: {exc}") from exc
    offset = _int(raw[1], "segment offset", where)
    length = _int(raw[2], "segment length", where, 1)
    if offset + length > MAX_RAW_LEN:
        raise SerializationError(f"{where}: segment [{offset}, +{length}) exceeds any blob")
    return Segment(digest, offset, length)
