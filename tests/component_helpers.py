"""Small helpers shared by the blob, serialization and checkpointer tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ckptstore.cas import BlobWriter, WriterOptions
from ckptstore.errors import ObjectStoreError
from ckptstore.objectstore import LocalStore, ObjectStore, PutData
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
