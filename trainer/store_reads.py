"""The bytes a policy rank reads from the object store during a load: a read-only view of the
store that adds up what every read returned (what a resume costs the store, and the measure of
read-once sharing between data-parallel replicas)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from ckptstore.errors import ObjectStoreError
from ckptstore.extending import ObjectStore

# The store's record and payload types are not on ckptstore's public surface (extending):
# ``Any`` stands for ObjectInfo (head, list) and PutData (put) below.


class CountedReads(ObjectStore):
    """``store`` for a load: every byte its reads return is counted in :attr:`read_bytes`.
    Read-only (a load never writes); the reads are the wrapped store's own."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        # A load through this store behaves as through the wrapped one (read-once on remote
        # stores, the same read concurrency).
        self.remote = store.remote
        self.read_concurrency = store.read_concurrency
        #: Bytes the reads returned so far (objects whole or ranges of them).
        self.read_bytes = 0
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        """The wrapped store's URL."""
        return self._store.url

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.read_bytes += nbytes

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        """The wrapped store's bytes, counted."""
        data = self._store.get(key, byte_range)
        self._count(len(data))
        return data

    def get_view(self, key: str) -> memoryview:
        """The wrapped store's object, counted."""
        view = self._store.get_view(key)
        self._count(view.nbytes)
        return view

    def head(self, key: str) -> Any:
        """The wrapped store's answer (no data is read)."""
        return self._store.head(key)

    def put(self, key: str, data: Any) -> bool:
        """Read-only: never called by a load."""
        raise ObjectStoreError(f"{self.url} is opened read-only here (a load never writes)")

    def delete(self, keys: Iterable[str]) -> None:
        """Read-only: never called by a load."""
        raise ObjectStoreError(f"{self.url} is opened read-only here (a load never deletes)")

    def list(self, prefix: str = "") -> Iterator[Any]:
        """Not listed: a load reads the keys its checkpoint names."""
        raise ObjectStoreError(f"{self.url} is not listed here (a load reads named keys)")
