"""Small helpers shared by the blob and serialization tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptstore.cas import BlobWriter, WriterOptions
from ckptstore.objectstore import ObjectStore
from ckptstore.serialize import ComponentResult, write_component


def save(store: ObjectStore, state: Any, **options: Any) -> ComponentResult:
    """Store ``state`` with a fresh BlobWriter (``options`` are WriterOptions fields)."""
    options.setdefault("max_workers", 4)
    with BlobWriter(store, WriterOptions(**options)) as writer:
        return write_component(writer, state)


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)
