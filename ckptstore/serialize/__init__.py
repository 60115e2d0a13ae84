"""State <-> entries + index, without pickle (DESIGN.md §5)."""

from __future__ import annotations

from ckptstore.serialize.index import ComponentIndex, Entry, Segment, decode_index
from ckptstore.serialize.load import (
    load_byte_range,
    load_component,
    load_entries,
    load_paths,
    read_index,
)
from ckptstore.serialize.save import ComponentResult, tensor_leaf, write_component

__all__ = [
    "ComponentIndex",
    "ComponentResult",
    "Entry",
    "Segment",
    "decode_index",
    "load_byte_range",
    "load_component",
    "load_entries",
    "load_paths",
    "read_index",
    "tensor_leaf",
    "write_component",
]
