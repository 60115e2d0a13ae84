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
from ckptstore.serialize.reader import ComponentReader
from ckptstore.serialize.save import (
    ComponentResult,
    FlatState,
    flatten_state,
    tensor_leaf,
    write_component,
    write_flat,
)

__all__ = [
    "ComponentIndex",
    "ComponentReader",
    "ComponentResult",
    "FlatState",
    "Entry",
    "Segment",
    "decode_index",
    "flatten_state",
    "load_byte_range",
    "load_component",
    "load_entries",
    "load_paths",
    "read_index",
    "tensor_leaf",
    "write_component",
    "write_flat",
]
