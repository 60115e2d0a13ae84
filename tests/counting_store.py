"""A real local store that counts the reads of each object (tests that a blob is fetched once)."""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import AbstractContextManager
from pathlib import Path

from ckptstore.objectstore import LocalStore
from ckptstore.objectstore.base import ObjectReader


class CountingStore(LocalStore):
    """A LocalStore (no fsync) whose every read of a key -- whole, ranged or opened for reads in
    pieces -- adds one to ``reads[key]``."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, fsync=False)
        self.reads: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _count(self, key: str) -> None:
        with self._lock:
            self.reads[key] += 1

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        self._count(key)
        return super().get(key, byte_range)

    def get_view(self, key: str) -> memoryview:
        self._count(key)
        return super().get_view(key)

    def open_reader(self, key: str) -> AbstractContextManager[ObjectReader]:
        self._count(key)
        return super().open_reader(key)
