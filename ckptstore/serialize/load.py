"""Loading a component, some of its entries, or a byte range of one tensor, by index digest.

Each function reads the component's index anew: for several reads of one component, use one
:class:`~ckptstore.serialize.reader.ComponentReader`, which these functions wrap.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ckptstore.objectstore.base import ObjectStore
from ckptstore.serialize.assemble import load_entries
from ckptstore.serialize.index import ComponentIndex
from ckptstore.serialize.reader import ComponentReader

__all__ = [
    "load_byte_range",
    "load_component",
    "load_entries",
    "load_paths",
    "read_index",
]


def read_index(
    store: ObjectStore, index_digest: str, *, context: str = "", index_len: int | None = None
) -> ComponentIndex:
    """Fetch, verify and validate a component's index (see :class:`ComponentReader`)."""
    return ComponentReader(store, index_digest, context=context, index_len=index_len).index


def load_component(
    store: ObjectStore,
    index_digest: str,
    *,
    context: str = "",
    max_workers: int = 0,
    index_len: int | None = None,
) -> Any:
    """Load a whole component back into its original structure."""
    reader = ComponentReader(store, index_digest, context=context, index_len=index_len)
    return reader.load(max_workers=max_workers)


def load_paths(
    store: ObjectStore,
    index_digest: str,
    paths: Iterable[str],
    *,
    context: str = "",
    index_len: int | None = None,
    max_workers: int = 0,
) -> dict[str, Any]:
    """Load only the named entries (or ``prefix/`` subtrees); returns path -> value."""
    reader = ComponentReader(store, index_digest, context=context, index_len=index_len)
    return reader.load_paths(paths, max_workers=max_workers)


def load_byte_range(
    store: ObjectStore,
    index_digest: str,
    path: str,
    start: int,
    stop: int,
    *,
    context: str = "",
) -> bytearray:
    """Bytes ``[start, stop)`` of one array entry, fetching only the blobs that hold them."""
    return ComponentReader(store, index_digest, context=context).byte_range(path, start, stop)
