"""The object-store contract (DESIGN.md §3).

Keys are ``/``-separated strings relative to the store's root; an object is immutable once
written. ``put`` is an idempotent create: writing a key that already exists succeeds without
touching the existing object, which is exactly what content-addressed blobs need. ``list`` exists
for garbage collection and fsck only; the save and resume paths never list.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from ckptstore.errors import ConfigError, ObjectNotFoundError

#: Anything exposing the buffer protocol as bytes: ``bytes``, ``bytearray``, ``memoryview``.
BytesLike: TypeAlias = bytes | bytearray | memoryview
#: ``put`` takes one buffer or a sequence written back to back (a header and a payload, say),
#: so callers never concatenate large buffers just to store them.
PutData: TypeAlias = BytesLike | Sequence[BytesLike]

#: Segments starting with this are reserved for temporary files of an object being written.
TMP_PREFIX = ".tmp-"
#: The key :meth:`ObjectStore.check_usable` asks about; no object is ever stored under it.
USABLE_PROBE_KEY = "ckptstore-usable-probe"
# One segment: letters, digits, '.', '_' and '-', but not '.', '..' or a '.tmp-' name.
_KEY_SEGMENT = rf"(?!\.\.?(?:/|\Z))(?!{re.escape(TMP_PREFIX)})[A-Za-z0-9._\-]+"
_KEY_RE = re.compile(rf"{_KEY_SEGMENT}(?:/{_KEY_SEGMENT})*")


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What ``head`` and ``list`` report about one object."""

    key: str
    size: int
    #: Seconds since the epoch (UTC) the object was last written, as the store reports it.
    mtime: float


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise :class:`ConfigError`.

    Keys are restricted to ``[A-Za-z0-9._-]`` segments joined by ``/``; ``.`` and ``..``
    segments are refused, so no key can name a path outside the store's root, and so are
    segments starting with ``.tmp-`` (the local store's in-progress files).
    """
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ConfigError(
            f"invalid object key {key!r}: use '/'-separated segments of letters, digits, "
            f"'.', '_' and '-', without '.', '..' or '{TMP_PREFIX}*' segments"
        )
    return key


def as_parts(data: PutData) -> list[memoryview]:
    """Normalise ``put`` data to a list of flat byte memoryviews (no copies)."""
    if isinstance(data, bytes | bytearray | memoryview):
        data = [data]
    return [_flat(part) for part in data]


def _flat(buf: BytesLike) -> memoryview:
    view = memoryview(buf)
    if view.ndim == 1 and view.format == "B":
        return view
    return view.cast("B")


def clip_range(byte_range: tuple[int, int] | None, size: int) -> tuple[int, int]:
    """``[start, stop)`` of ``byte_range`` clipped to an object of ``size`` bytes."""
    if byte_range is None:
        return 0, size
    start, stop = byte_range
    if start < 0 or stop < start:
        raise ConfigError(f"invalid byte range [{start}, {stop}): need 0 <= start <= stop")
    return min(start, size), min(stop, size)


def uninitialized(size: int) -> memoryview:
    """A writable buffer of ``size`` bytes whose pages are not touched until written: a read
    into it is their first touch, where a ``bytearray`` would zero-fill them all first.
    Raises MemoryError or ValueError for a size that cannot be had."""
    import numpy as np  # here: the read-only CLI imports this module and must not load numpy

    return memoryview(np.empty(size, dtype=np.uint8).data)


def parts_size(parts: Sequence[memoryview]) -> int:
    """Total bytes of ``data`` (bytes-like or a sequence of parts)."""
    return sum(p.nbytes for p in parts)


class ObjectReader(Protocol):
    """One open object, read at any offset into the caller's buffers."""

    #: The object's size in bytes when it was opened.
    size: int

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the object's bytes from ``offset``; ObjectStoreError if the
        object ends before ``view`` is full."""
        ...


@runtime_checkable
class RandomAccess(Protocol):
    """A store whose objects are cheap to read in pieces straight into the caller's memory (a
    local file system; S3, one streamed ranged GET for pieces read in order). The blob reader
    then reads a raw blob into the tensors it fills, hashing each piece while it is still in
    the CPU cache: no intermediate buffer, one pass."""

    def open_reader(self, key: str) -> AbstractContextManager[ObjectReader]:
        """``key`` opened for reading; ObjectNotFoundError if it does not exist."""
        ...


@runtime_checkable
class Copies(Protocol):
    """A store that holds several copies of an object and reads the nearest one (node-local
    tiers, then the object store: ``ckptstore.tiers``). A reader that finds the copy it just
    read damaged or missing calls :meth:`failed`, and reads the key again from the next copy."""

    def failed(self, key: str, error: BaseException) -> bool:
        """The copy of ``key`` read last failed verification (``error``): it is skipped (and
        reported) from now on. True if another copy is left to read."""
        ...


class ObjectStore(abc.ABC):
    """Abstract base of every backend. Implementations must be safe to use from many threads."""

    #: Rough sustained write throughput in bytes/s. The blob codec compares it with its own
    #: speed to decide whether compressing saves wall time on this store.
    write_bandwidth_hint: float = 1.0e9
    #: How many reads to run at once when loading. Reads from a local page cache are CPU work
    #: (copies, page faults), so more threads than cores only contend; network reads wait.
    read_concurrency: int = 8
    #: Whether a writer that has no list of the blobs already stored asks the store before
    #: encoding and sending each new one. False where asking costs a request and :meth:`put`
    #: refuses to overwrite by itself (S3's conditional PUT): a writer that knows the live
    #: blobs (a run's, from its manifest) then sends each new one straight away, and the rare
    #: blob already stored (left by a failed save) is refused and reported as not uploaded.
    probe_new_blobs: bool = True
    #: Whether reads cross a network to a service that every node shares (S3, GCS, Azure),
    #: not this machine's own disk: a load by many ranks then reads each blob they share once
    #: and passes it on (``ckptstore.integrations.dcp``'s read-once), sparing the service.
    remote: bool = False

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The store's URL, safe to print (never contains credentials)."""

    @abc.abstractmethod
    def put(self, key: str, data: PutData) -> bool:
        """Create ``key`` with ``data`` unless it already exists.

        Returns True if this call wrote the object, False if it already existed. The object is
        either absent or complete, never partially visible. It need not be durable before
        :meth:`flush`.
        """

    def adopt(self, key: str) -> None:  # noqa: B027 - a store whose puts are durable
        """This writer will reference ``key``, which it found already stored (maybe written by
        another process that has not flushed yet): make it durable at the next :meth:`flush`
        too."""

    def flush(self) -> None:  # noqa: B027 - a store whose puts are durable has nothing to do
        """Make every object this instance has put or adopted since the last flush durable
        (and, when another thread's flush is running, wait for it). A commit that references
        objects calls this first (DESIGN.md §7): durability costs one batched flush per save,
        not a sync per object. Raises ObjectStoreError."""

    @abc.abstractmethod
    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        """Return the object's bytes, or ``[start, stop)`` of them.

        Raises :class:`~ckptstore.errors.ObjectNotFoundError` if the key does not exist. A range
        that extends past the end is clipped to the object's size.
        """

    def get_view(self, key: str) -> memoryview:
        """The whole object as a writable buffer; backends may skip zero-filling it.

        The blob reader uses this: a raw tensor chunk read here becomes the tensor's memory.
        """
        return memoryview(self.get(key))

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Size and mtime of ``key``; raises ``ObjectNotFoundError`` if it does not exist."""

    def sizes(self, keys: Sequence[str]) -> dict[str, int | None]:
        """Each key's size, None where it does not exist: a commit checks every new blob of
        every rank's receipt this way. The default asks ``head`` for 16 keys at a time on
        threads (network stores); a store whose ``head`` is a system call overrides it with a
        plain loop."""
        if len(keys) <= 1:
            return {key: self._size_or_none(key) for key in keys}
        with ThreadPoolExecutor(min(16, len(keys))) as pool:
            return dict(zip(keys, pool.map(self._size_or_none, keys), strict=True))

    def _size_or_none(self, key: str) -> int | None:
        try:
            return self.head(key).size
        except ObjectNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        """True if ``key`` exists."""
        try:
            self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    @abc.abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Delete every key in ``keys``, in batches; keys that do not exist are ignored."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (for GC and fsck only)."""

    def check_usable(self) -> None:
        """One cheap request that fails now, with one clear error naming the store and the fix,
        if the store cannot be used at all (a missing bucket or directory, an unreachable
        endpoint, refused credentials). A writer calls it when it opens, so such a store fails
        there rather than at the first save, minutes into a job. Raises ObjectStoreError.

        This default asks whether a key exists that none has: a backend's ``head`` raises for a
        missing store or an unreachable service. Backends override it with a sharper check."""
        self.exists(USABLE_PROBE_KEY)

    def sweep_incomplete(self, older_than: float, *, dry_run: bool = False) -> tuple[int, int]:
        """Remove what writes that never finished left behind (a killed writer's temporary
        files, abandoned multipart uploads) started more than ``older_than`` seconds ago.

        Returns (count, bytes). A store whose writes are atomic leaves nothing: (0, 0).
        """
        return 0, 0

    def close(self) -> None:  # noqa: B027 - a store without resources needs no close
        """Release connections and threads. The store must not be used afterwards."""

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
