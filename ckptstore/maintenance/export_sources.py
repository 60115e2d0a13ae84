"""The whole tensors an export writes, described before any data is read, and put together one
at a time from the stored pieces.

A :class:`SourceTensor` is a tensor's name, dtype and shape with the stored pieces (one entry of
a component each, at an offset) that tile it -- what a DCP checkpoint's metadata or a Megatron
checkpoint's layout says, checked by the integration before anything is read. An export plans
its files from these alone, then calls :meth:`PieceReader.assemble` for one tensor at a time.

:class:`PieceReader` fetches every blob once over the whole export: a blob that several of the
pieces share (a pack of small tensors) is kept, verified, until the last piece that needs it has
been copied out (``serialize.reader.BlobCache``); a tensor stored in one blob is a view of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptstore.errors import ConfigError, IntegrityError
from ckptstore.serialize.assemble import with_context
from ckptstore.serialize.dtypes import torch_dtype
from ckptstore.serialize.reader import BlobCache

if TYPE_CHECKING:
    import torch

    from ckptstore.manifest.records import CheckpointInfo
    from ckptstore.objectstore import ObjectStore
    from ckptstore.serialize.index import Entry
    from ckptstore.serialize.reader import ComponentReader


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored box of a tensor: an array entry of a component, placed at ``offsets``."""

    reader: ComponentReader
    entry: Entry
    offsets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SourceTensor:
    """A whole tensor of a checkpoint and the stored pieces that tile it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def renamed(self, name: str) -> SourceTensor:
        """The same tensor under another name."""
        return SourceTensor(name, self.dtype, self.shape, self.pieces)


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


# -- the checkpoints that consolidate ---------------------------------------------------------


def dcp_sources(store: ObjectStore, info: CheckpointInfo) -> list[SourceTensor]:
    """The tensors of a torch DCP checkpoint, by fqn, after the checks a load makes."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from ckptstore.integrations.dcp import CkptStoreReader
    from ckptstore.integrations.dcp._validate import item_entry

    reader = CkptStoreReader.for_checkpoint(store, info)
    stored = reader.validate()
    locations = stored.metadata.storage_data
    sources = []
    for fqn, md in stored.metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        pieces = []
        for chunk in md.chunks:
            location = locations[MetadataIndex(fqn, chunk.offsets)]
            rank_reader = reader._rank_reader(stored, location.rank)
            _, entry = item_entry(rank_reader, location.position)
            pieces.append(Piece(rank_reader, entry, tuple(chunk.offsets)))
        sources.append(SourceTensor(fqn, md.properties.dtype, tuple(md.size), tuple(pieces)))
    return sources


def megatron_sources(store: ObjectStore, info: CheckpointInfo) -> list[SourceTensor]:
    """The tensors of a Megatron-Core checkpoint, by ShardedTensor key, after the checks a
    load makes (Megatron itself is not imported)."""
    from ckptstore.integrations._common.megatron_source import Source

    source = Source(store, info)
    source.validate()
    sources = []
    for key, shards in source.layout.by_key().items():
        pieces = []
        for shard in shards:
            reader = source.reader(shard.component)
            pieces.append(Piece(reader, reader.entry(shard.path), shard.offset))
        first = shards[0]
        sources.append(SourceTensor(key, first.torch_dtype, first.global_shape, tuple(pieces)))
    return sources


def iter_assembled(
    store: ObjectStore, sources: list[SourceTensor], context: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor, whole, in order (one held at a time by this iterator)."""
    reader = PieceReader(store, sources, context)
    for source in sources:
        yield source.name, reader.assemble(source)
