"""Writing safetensors files one tensor at a time.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a
JSON header -- each tensor's ``dtype``, ``shape`` and ``data_offsets`` ``[begin, end)`` into the
data that follows, and an optional ``__metadata__`` of strings -- padded with spaces to a
multiple of 8 bytes, then every tensor's bytes, contiguous, with no gap.

Everything in the header is known before any tensor is read (names, dtypes and shapes come from
a checkpoint's metadata), so the header is written first and each tensor's bytes go straight to
their place as the tensor arrives: a file of any size is written while holding one tensor. The
tensors are laid out largest element size first, as safetensors' own writer does, so each
starts at a multiple of its element size and readers may map it in place.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from ckptstore.errors import SerializationError
from ckptstore.names import printable

if TYPE_CHECKING:
    import torch

#: The permissions of exported files (less the umask): anyone may read a model file.
FILE_MODE = 0o644


def dtype_names() -> dict[torch.dtype, str]:
    """torch dtype -> the safetensors name of it (every dtype both sides know)."""
    import torch

    names = {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
        torch.float8_e4m3fn: "F8_E4M3",
        torch.float8_e5m2: "F8_E5M2",
        torch.uint16: "U16",
        torch.uint32: "U32",
        torch.uint64: "U64",
    }
    return names


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor as a file's header describes it, before its data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def header(
    specs: list[TensorSpec], metadata: dict[str, str], context: str = ""
) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (length, JSON header, padding) and each tensor's offset in it."""
    where = f"{context}: " if context else ""
    names = dtype_names()
    seen: set[str] = set()
    doc: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    begins: dict[str, int] = {}
    pos = 0
    for spec in sorted(specs, key=lambda s: -s.dtype.itemsize):
        if spec.name in seen or spec.name == "__metadata__":
            raise SerializationError(f"{where}two tensors would be named {spec.name!r} in one file")
        seen.add(spec.name)
        if spec.dtype not in names:
            raise SerializationError(
                f"{where}tensor {spec.name!r} is {str(spec.dtype).removeprefix('torch.')}, which "
                "safetensors cannot hold; use --format torch"
            )
        end = pos + spec.nbytes
        doc[spec.name] = {
            "dtype": names[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [pos, end],
        }
        begins[spec.name] = pos
        pos = end
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, {name: begin + len(prefix) for name, begin in begins.items()}


class SafetensorsFile:
    """One safetensors file being written: opening it writes the header; :meth:`write` puts
    one tensor's bytes at its place (tensors in any order); :meth:`commit` checks that every
    tensor was written and renames the file into place. Leaving the ``with`` block without
    committing removes the partial file."""

    def __init__(
        self, path: Path, specs: list[TensorSpec], metadata: dict[str, str], *, context: str = ""
    ) -> None:
        self.path = path
        self.context = context
        self._specs = {spec.name: spec for spec in specs}
        self._prefix, self._offsets = header(specs, metadata, context)
        self._pending = set(self._specs)
        self._tmp = path.with_name(f".{path.name}.partial")
        self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            self._pwrite(memoryview(self._prefix), 0)
        except BaseException:
            self._discard()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._fd >= 0:
            self._discard()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor``'s bytes as the tensor ``name`` of the header (same dtype and
        shape, or a :class:`SerializationError` naming both)."""
        import torch

        spec = self._specs.get(name)
        if spec is None or name not in self._pending:
            raise SerializationError(
                f"{self.context}: tensor {name!r} is not expected in {printable(self.path)}"
            )
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise SerializationError(
                f"{self.context}: tensor {name!r} arrived as {tensor.dtype}{list(tensor.shape)}, "
                f"planned as {spec.dtype}{list(spec.shape)} (a --map function must return the "
                "same names and shapes every time it is called)"
            )
        if spec.nbytes:
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            self._pwrite(flat.numpy().data, self._offsets[name])
        self._pending.discard(name)

    def commit(self) -> Path:
        """Flush, close and rename the finished file into place; returns its path."""
        if self._pending:
            missing = sorted(self._pending)[:3]
            raise SerializationError(
                f"{self.context}: {len(self._pending)} tensors of {printable(self.path)} were "
                f"never written (e.g. {missing})"
            )
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        self._tmp.replace(self.path)
        return self.path

    def _pwrite(self, data: memoryview, offset: int) -> None:
        # One pwrite moves at most ~2 GiB on Linux: loop until every byte is out.
        done = 0
        while done < data.nbytes:
            done += os.pwrite(self._fd, data[done:], offset + done)

    def _discard(self) -> None:
        os.close(self._fd)
        self._fd = -1
        self._tmp.unlink(missing_ok=True)


def save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], *, context: str = ""
) -> Path:
    """Write tensors already in memory as the safetensors file ``path``."""
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with SafetensorsFile(path, specs, metadata, context=context) as out:
        for name, tensor in tensors.items():
            out.write(name, tensor)
        return out.commit()
