"""The two stores tiers are used through: one that writes, one that reads.

- :class:`ReplicatingStore` is what a local save writes to: every object goes to this node's
  tier and to its replica peers' tiers at once, and :meth:`~ReplicatingStore.flush` makes all of
  them durable on every one of those nodes before it returns -- so a receipt that names the
  nodes (``ShardReceipt.nodes``) promises fsynced copies there, as a store receipt promises
  durable objects. Anything that saves through an ``ObjectStore`` (``ShardWriter``, the DCP
  writer) saves to the tiers when handed one.
- :class:`NearestCopies` is what a recovery reads through: each blob from the nearest of the
  copies the manifest lists for it (own tier, a peer's, then the object store). A copy that
  fails verification or is gone is reported (:meth:`~NearestCopies.bad_copies`) and the next
  one is read instead (:class:`~ckptstore.objectstore.base.Copies`); a peer that does not answer
  is passed over. Wrong bytes are never handed on: every copy is verified by the reader.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass

from ckptstore.errors import ObjectNotFoundError, ObjectStoreError
from ckptstore.objectstore.base import (
    ObjectInfo,
    ObjectReader,
    ObjectStore,
    PutData,
    RandomAccess,
    as_parts,
)
from ckptstore.tiers.placement import STORE

log = logging.getLogger("ckptstore.tiers")


class ReplicatingStore(ObjectStore):
    """This node's tier, replicated to ``peers``' tiers: puts go to all of them, reads come from
    this node's own. ``nodes`` is where every flushed object is."""

    probe_new_blobs = True

    def __init__(self, node: str, own: ObjectStore, peers: Mapping[str, ObjectStore]) -> None:
        self.node = node
        self.own = own
        self.peers = dict(peers)
        #: The nodes that hold every object this store has put or adopted, once flushed.
        self.nodes: tuple[str, ...] = (node, *self.peers)
        self.write_bandwidth_hint = own.write_bandwidth_hint
        self.read_concurrency = own.read_concurrency
        self._adopted: set[str] = set()
        self._lock = threading.Lock()
        # Peers' puts run beside this node's own, so a put costs the slowest copy, not the sum.
        self._pool = (
            ThreadPoolExecutor(8 * len(self.peers), thread_name_prefix="ckpt-replicate")
            if self.peers
            else None
        )

    @property
    def url(self) -> str:
        """This node's tier, and the peers it replicates to."""
        peers = f" replicated to {', '.join(self.peers)}" if self.peers else ""
        return f"{self.own.url} (tier of node {self.node}{peers})"

    def put(self, key: str, data: PutData) -> bool:
        """Create ``key`` on this node's tier and every peer's; True if this node's was new."""
        parts = as_parts(data)
        pending = (
            [(node, self._pool.submit(peer.put, key, parts)) for node, peer in self.peers.items()]
            if self._pool is not None
            else []
        )
        try:
            created = self.own.put(key, parts)
        finally:
            # The parts are the caller's memory: every peer is done with them before returning.
            for _, future in pending:
                with contextlib.suppress(BaseException):
                    future.exception()
        for node, future in pending:
            if not future.result():  # already there: maybe written, not yet synced, by another
                self.peers[node].adopt(key)
        if not created:
            self.own.adopt(key)
        return created

    def adopt(self, key: str) -> None:
        """``key`` was found on this node's tier: at the next flush it is made durable here and
        copied to every peer that lacks it."""
        self.own.adopt(key)
        with self._lock:
            self._adopted.add(key)

    def flush(self) -> None:
        """Make every object put or adopted since the last flush durable on every node's tier
        (copying adopted ones to the peers that lack them first)."""
        with self._lock:
            adopted, self._adopted = sorted(self._adopted), set()
        self.own.flush()
        if not self.peers:
            return
        assert self._pool is not None
        futures = [
            self._pool.submit(self._complete_peer, node, peer, adopted)
            for node, peer in self.peers.items()
        ]
        for future in futures:
            future.result()

    def _complete_peer(self, node: str, peer: ObjectStore, adopted: Sequence[str]) -> None:
        if adopted:
            for key, size in peer.sizes(adopted).items():
                if size is None:
                    peer.put(key, self.own.get_view(key))
                else:
                    peer.adopt(key)
        peer.flush()

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        """From this node's tier."""
        return self.own.get(key, byte_range)

    def get_view(self, key: str) -> memoryview:
        """From this node's tier."""
        return self.own.get_view(key)

    def head(self, key: str) -> ObjectInfo:
        """On this node's tier (a writer's probe: an object there is not written again)."""
        return self.own.head(key)

    def sizes(self, keys: Sequence[str]) -> dict[str, int | None]:
        """On this node's tier."""
        return self.own.sizes(keys)

    def delete(self, keys: Iterable[str]) -> None:
        """From this node's tier and every peer's."""
        keys = list(keys)
        for store in (self.own, *self.peers.values()):
            store.delete(keys)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """This node's tier."""
        return self.own.list(prefix)

    def check_usable(self) -> None:
        """Every tier it writes to answers."""
        for store in (self.own, *self.peers.values()):
            store.check_usable()

    def close(self) -> None:
        """Stop the replication threads (the tiers belong to their transport)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


@dataclass(frozen=True, slots=True)
class BadCopy:
    """A copy a read found damaged or missing: the manifest should forget it."""

    key: str
    #: The node whose tier held it (never the object store: that is a checkpoint's damage).
    node: str
    reason: str


class NearestCopies(ObjectStore):
    """Reads each key from the nearest of its copies (``sources[key]``: node names nearest
    first, :data:`~ckptstore.tiers.placement.STORE` for the object store), falling back to the
    next when one is damaged, missing or unreachable. Read-only."""

    def __init__(
        self,
        sources: Mapping[str, Sequence[str]],
        open_source: Callable[[str], ObjectStore],
        *,
        store: ObjectStore | None = None,
        read_concurrency: int = 8,
    ) -> None:
        """``open_source(node)`` gives a node's tier (the object store for ``STORE``);
        ``store`` is the object store, read for keys ``sources`` does not list."""
        self._planned = {key: tuple(nodes) for key, nodes in sources.items()}
        self._sources = {key: list(nodes) for key, nodes in sources.items()}
        self._open = open_source
        self._store = store
        self.read_concurrency = read_concurrency
        self._bad: list[BadCopy] = []
        self._unreachable: set[str] = set()
        #: Every source read from, and how many bytes: the recovery's own accounting.
        self.read_from: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        """The object store's URL, said to be read through the tiers."""
        base = self._store.url if self._store is not None else "no object store"
        return f"{base} (nearest copies on node-local tiers first)"

    def sources_of(self, key: str) -> tuple[str, ...]:
        """Where ``key`` was planned to be read from, nearest first (failed ones included)."""
        return self._planned.get(key, (STORE,) if self._store is not None else ())

    def bad_copies(self) -> list[BadCopy]:
        """The tier copies found damaged or missing so far."""
        with self._lock:
            return list(self._bad)

    def _candidates(self, key: str) -> list[str]:
        with self._lock:
            listed = self._sources.get(key)
            if listed is None:
                return [STORE] if self._store is not None else []
            return [n for n in listed if n not in self._unreachable]

    def _source(self, node: str) -> ObjectStore:
        if node == STORE:
            if self._store is None:
                raise ObjectNotFoundError("no object store to read from")
            return self._store
        return self._open(node)

    def _read(self, key: str, action: Callable[[ObjectStore], object]) -> tuple[str, object]:
        """``action`` on the nearest copy of ``key`` that answers: (its node, the result). A
        peer that does not answer (an error other than a missing object) is passed over for
        the rest of the load."""
        failures: list[str] = []
        for node in self._candidates(key):
            try:
                return node, action(self._source(node))
            except ObjectNotFoundError:
                raise  # the copy is gone: the reader reports it through failed()
            except ObjectStoreError as exc:
                if node == STORE:
                    raise
                with self._lock:
                    self._unreachable.add(node)
                log.warning("tier of node %r does not answer (%s); reading other copies", node, exc)
                failures.append(f"{node}: {exc}")
        raise ObjectNotFoundError(
            f"no copy of {key} is left to read ({'; '.join(failures) or 'none listed'})"
        )

    def failed(self, key: str, error: BaseException) -> bool:
        """Skip the copy of ``key`` read last (damaged or missing); True if another is left."""
        with self._lock:
            listed = self._sources.get(key)
            if listed is None:
                return False
            live = [n for n in listed if n not in self._unreachable]
            if not live or live[0] == STORE:
                return False  # the object store's damage is the checkpoint's (restore.py)
            node = live[0]
            listed.remove(node)
            self._bad.append(BadCopy(key, node, f"{type(error).__name__}: {error}"))
            remaining = [n for n in listed if n not in self._unreachable]
        if isinstance(error, FileNotFoundError):  # MissingBlobError: the copy is gone
            log.warning("tier copy of %s on node %r is gone; reading the next copy", key, node)
        else:
            log.error(
                "BAD TIER COPY: %s on node %r failed verification (%s); reading the next copy",
                key,
                node,
                error,
            )
        return bool(remaining)

    def _count(self, node: str, nbytes: int) -> None:
        with self._lock:
            self.read_from[node] = self.read_from.get(node, 0) + nbytes

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        """From the nearest copy."""
        node, data = self._read(key, lambda s: s.get(key, byte_range))
        assert isinstance(data, bytearray)
        self._count(node, len(data))
        return data

    def get_view(self, key: str) -> memoryview:
        """From the nearest copy."""
        node, data = self._read(key, lambda s: s.get_view(key))
        assert isinstance(data, memoryview)
        self._count(node, data.nbytes)
        return data

    def open_reader(self, key: str) -> AbstractContextManager[ObjectReader]:
        """The nearest copy opened for reading in pieces (a copy that cannot be read in pieces
        is fetched whole and read from memory)."""
        node, opened = self._read(key, lambda s: _open_any(s, key))
        assert isinstance(opened, _Opened)
        self._count(node, opened.reader.size)
        return opened.context

    def prefetch(self, key: str) -> int:
        """Advice to the nearest copy's store, if it takes it."""
        try:
            _, size = self._read(key, lambda s: getattr(s, "prefetch", _no_prefetch)(key))
        except ObjectStoreError:
            return 0
        return size if isinstance(size, int) else 0

    def head(self, key: str) -> ObjectInfo:
        """Of the nearest copy."""
        _, info = self._read(key, lambda s: s.head(key))
        assert isinstance(info, ObjectInfo)
        return info

    def put(self, key: str, data: PutData) -> bool:
        """Read-only: never called by a load."""
        raise ObjectStoreError(f"{self.url} is read-only (a recovery reads, it never writes)")

    def delete(self, keys: Iterable[str]) -> None:
        """Read-only: never called by a load."""
        raise ObjectStoreError(f"{self.url} is read-only (a recovery reads, it never deletes)")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Read-only, and no listing: a recovery plans from the manifest."""
        raise ObjectStoreError(f"{self.url} is not listed: the manifest says where copies are")


def _no_prefetch(key: str) -> int:
    return 0


@dataclass(slots=True)
class _Opened:
    reader: ObjectReader
    context: AbstractContextManager[ObjectReader]


def _open_any(store: ObjectStore, key: str) -> _Opened:
    """``key`` opened on ``store``: in pieces where it reads so, else fetched whole (which is
    also where a missing object or an unreachable tier says so, inside the caller's fallback)."""
    if isinstance(store, RandomAccess):
        context = store.open_reader(key)
        reader = context.__enter__()
        return _Opened(reader, _Entered(context, reader))
    reader = _MemoryReader(store.get_view(key))
    return _Opened(reader, contextlib.nullcontext(reader))


class _Entered(AbstractContextManager[ObjectReader]):
    """A context manager already entered (its object opened inside the fallback loop)."""

    def __init__(self, context: AbstractContextManager[ObjectReader], reader: ObjectReader):
        self._context, self._reader = context, reader

    def __enter__(self) -> ObjectReader:
        return self._reader

    def __exit__(self, *exc: object) -> None:
        self._context.__exit__(*exc)  # type: ignore[arg-type]


class _MemoryReader:
    """An object fetched whole, read in pieces."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self.size = data.nbytes

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` from ``offset``."""
        end = offset + view.nbytes
        if end > self.size:
            raise ObjectStoreError(f"object ends at byte {self.size}, before byte {end}")
        view[:] = self._data[offset:end]
