"""Request bodies for S3Store read straight from the caller's buffers: ``put`` takes a list of
them (a header and a payload, say), and a PUT or an uploaded part sends them back to back
without concatenating them first.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any


class _PartsReader(io.RawIOBase):
    """A seekable file over a list of buffers, so a body is sent without concatenating it."""

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self._parts = [p for p in parts if p.nbytes]
        self._size = sum(p.nbytes for p in self._parts)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, min(self._size, base + offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        written = 0
        for piece in _slice_parts(self._parts, self._pos, min(self._size, self._pos + len(out))):
            out[written : written + piece.nbytes] = piece
            written += piece.nbytes
        self._pos += written
        return written

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self._size - self._pos
        pieces = _slice_parts(self._parts, self._pos, min(self._size, self._pos + size))
        self._pos += sum(p.nbytes for p in pieces)
        return b"".join(pieces)


def _slice_parts(parts: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
    """Views of bytes ``[start, stop)`` of the concatenation of ``parts`` (no copies)."""
    out: list[memoryview] = []
    offset = 0
    for part in parts:
        end = offset + part.nbytes
        if end > start and offset < stop:
            out.append(part[max(start, offset) - offset : min(stop, end) - offset])
        offset = end
        if offset >= stop:
            break
    return out
