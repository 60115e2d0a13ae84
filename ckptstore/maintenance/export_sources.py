"""The whole tensors an export writes, described before any data is read, and put together one
at a time from the stored pieces.

A :class:`~ckptstore.serialize.pieces.SourceTensor` is a tensor's name, dtype and shape with the
stored pieces (one entry of a component each, at an offset) that tile it -- what a DCP
checkpoint's metadata or a Megatron checkpoint's layout says, checked by the integration before
anything is read (``Format.tensors`` in ``ckptstore.integrations.formats``). An export plans
its files from these alone, then calls :meth:`PieceReader.assemble` for one tensor at a time.

:class:`PieceReader` fetches every blob once over the whole export: a blob that several of the
pieces share (a pack of small tensors) is kept, verified, until the last piece that needs it has
been copied out (``serialize.reader.BlobCache``); a tensor stored in one blob is a view of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from ckptstore.errors import ConfigError, IntegrityError
from ckptstore.serialize.assemble import with_context
from ckptstore.serialize.dtypes import torch_dtype
from ckptstore.serialize.pieces import Piece, SourceTensor
from ckptstore.serialize.reader import BlobCache

if TYPE_CHECKING:
    import torch

    from ckptstore.objectstore import ObjectStore


def with_prefix(sources: Iterable[SourceTensor], key: str) -> list[SourceTensor]:
    """Only the tensors named ``key.<name>``, renamed ``<name>``; none at all is an error."""
    head = key.rstrip(".") + "."
    chosen = [s.renamed(s.name[len(head) :]) for s in sources if s.name.startswith(head)]
    if not chosen:
        raise ConfigError(f"no tensor is named {head}<name> in this checkpoint; check --prefix")
    return chosen


class PieceReader:
    """Reads the pieces of a planned list of tensors, fetching (and verifying) each blob once:
    every piece is announced to one :class:`BlobCache` up front, so a blob that several pieces
    share is kept until the last of them has been read, and dropped then."""

    def __init__(self, store: ObjectStore, sources: Iterable[SourceTensor], context: str) -> None:
        self.context = context
        self._cache = BlobCache(store)
        for source in sources:
            for piece in source.pieces:
                self._cache.need(piece.reader, piece.entry, [(0, piece.entry.nbytes)])

    def assemble(self, source: SourceTensor) -> torch.Tensor:
        """The whole tensor, its pieces copied into place (a single piece is the tensor)."""
        import torch

        where = with_context(self.context, f"tensor {source.name!r}")
        if len(source.pieces) == 1 and tuple(source.pieces[0].entry.shape) == source.shape:
            return self._read(source.pieces[0], source.dtype, where)
        full = torch.empty(source.shape, dtype=source.dtype)
        for piece in source.pieces:
            data = self._read(piece, source.dtype, where)
            box = tuple(slice(o, o + n) for o, n in zip(piece.offsets, data.shape, strict=True))
            full[box] = data
            del data
        return full

    def _read(self, piece: Piece, dtype: torch.dtype, where: str) -> torch.Tensor:
        """One piece's entry as a tensor of ``dtype`` (checked against the entry's own)."""
        import torch

        entry = piece.entry
        size = math.prod(entry.shape) * dtype.itemsize
        if torch_dtype(entry.dtype, where) != dtype or entry.nbytes != size:
            raise IntegrityError(
                f"{where}: a stored piece is {entry.dtype}{list(entry.shape)} in "
                f"{entry.nbytes} bytes, the tensor is {dtype}"
            )
        if not entry.nbytes:
            return torch.empty(entry.shape, dtype=dtype)
        data = self._cache.read(piece.reader, entry, 0, entry.nbytes)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(entry.shape)


def iter_assembled(
    store: ObjectStore, sources: list[SourceTensor], context: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor, whole, in order (one held at a time by this iterator)."""
    reader = PieceReader(store, sources, context)
    for source in sources:
        yield source.name, reader.assemble(source)


__all__ = ["Piece", "PieceReader", "SourceTensor", "iter_assembled", "with_prefix"]
