"""Small helpers shared by the blob, serialization and checkpointer tests."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore.cas import BlobWriter, WriterOptions
from ckptstore.errors import ObjectStoreError
from ckptstore.objectstore import LocalStore, ObjectStore, PutData
from ckptstore.objectstore.base import ObjectReader
from ckptstore.serialize import ComponentResult, write_component


def save(store: ObjectStore, state: Any, **options: Any) -> ComponentResult:
    """Store ``state`` with a fresh BlobWriter (``options`` are WriterOptions fields)."""
    options.setdefault("max_workers", 4)
    with BlobWriter(store, WriterOptions(**options)) as writer:
        return write_component(writer, state)


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)


class FlakyStore(LocalStore):
    """A real LocalStore whose writes fail while ``failing`` is set."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, fsync=False)
        self.failing = False

    def put(self, key: str, data: PutData) -> bool:
        if self.failing:
            raise ObjectStoreError(f"injected failure writing {self.url}/{key}")
        return super().put(key, data)


class RecordingStore(LocalStore):
    """A real LocalStore that records the keys it is asked to read ahead (``prefetched``) and
    the keys it opens for reads in pieces (``opened``), in order."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, fsync=False)
        self.prefetched: list[str] = []
        self.opened: list[str] = []
        self._lock = threading.Lock()

    def prefetch(self, key: str) -> int:
        with self._lock:
            self.prefetched.append(key)
        return super().prefetch(key)

    def open_reader(self, key: str) -> AbstractContextManager[ObjectReader]:
        with self._lock:
            self.opened.append(key)
        return super().open_reader(key)
