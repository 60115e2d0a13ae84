"""State <-> entries + index, without pickle (DESIGN.md §5)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptstore._lazy import lazy_exports

if TYPE_CHECKING:
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

__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {
        "ckptstore.serialize.index": ["ComponentIndex", "Entry", "Segment", "decode_index"],
        "ckptstore.serialize.load": [
            "load_byte_range",
            "load_component",
            "load_entries",
            "load_paths",
            "read_index",
        ],
        "ckptstore.serialize.reader": ["ComponentReader"],
        "ckptstore.serialize.save": [
            "ComponentResult",
            "FlatState",
            "flatten_state",
            "tensor_leaf",
            "write_component",
            "write_flat",
        ],
    },
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
