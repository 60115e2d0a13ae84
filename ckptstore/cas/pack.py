"""Packs: many small items in one blob, with a trailing table of contents.

Raw layout: the items back to back (each starting at a multiple of 8 bytes), then the table of
contents as JSON, then its length (u32) and the magic ``CKTC``. The table makes a pack readable
on its own; loading uses the offsets recorded in the component index.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

from ckptstore.errors import IntegrityError

TOC_MAGIC = b"CKTC"
_TRAILER = struct.Struct("<I4s")
_ALIGN = 8


@dataclass(frozen=True, slots=True)
class PackItem:
    """One item of a pack: its name and where its bytes lie in the pack's raw bytes."""

    name: str
    offset: int
    length: int


@dataclass(slots=True)
class PackBuilder:
    """Collects small items (by view, no copy) until :meth:`build` lays them out."""

    limit: int
    items: list[tuple[str, memoryview]] = field(default_factory=list)
    size: int = 0

    def fits(self, nbytes: int) -> bool:
        """Whether an item of ``nbytes`` still fits (an empty pack takes any one item)."""
        return not self.items or self.size + _aligned(nbytes) <= self.limit

    def add(self, name: str, data: memoryview) -> None:
        """Append ``data`` under ``name`` (kept as a view until :meth:`build`)."""
        self.items.append((name, data))
        self.size += _aligned(data.nbytes)

    def build(self) -> tuple[bytearray, list[PackItem]]:
        """The pack's raw bytes (items, table of contents, trailer) and its items."""
        toc: list[PackItem] = []
        out = bytearray(self.size)
        offset = 0
        for name, data in self.items:
            out[offset : offset + data.nbytes] = data
            toc.append(PackItem(name, offset, data.nbytes))
            offset += _aligned(data.nbytes)
        table = json.dumps(
            [[i.name, i.offset, i.length] for i in toc], separators=(",", ":")
        ).encode()
        out += table
        out += _TRAILER.pack(len(table), TOC_MAGIC)
        return out, toc


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def read_toc(raw: memoryview, where: str) -> list[PackItem]:
    """The table of contents of a pack's raw bytes."""
    if raw.nbytes < _TRAILER.size:
        raise IntegrityError(f"{where}: too short to be a pack")
    length, magic = _TRAILER.unpack_from(raw, raw.nbytes - _TRAILER.size)
    end = raw.nbytes - _TRAILER.size
    if magic != TOC_MAGIC or length > end:
        raise IntegrityError(f"{where}: no pack table of contents")
    try:
        entries = json.loads(bytes(raw[end - length : end]))
        items = [PackItem(str(n), int(o), int(sz)) for n, o, sz in entries]
    except (ValueError, TypeError) as exc:
        raise IntegrityError(f"{where}: unreadable pack table of contents") from exc
    if any(i.offset < 0 or i.length < 0 or i.offset + i.length > end - length for i in items):
        raise IntegrityError(f"{where}: pack table of contents points outside the pack")
    return items
