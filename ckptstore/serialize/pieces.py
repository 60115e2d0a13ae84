"""A whole tensor of a sharded checkpoint as the stored pieces that tile it.

What a DCP checkpoint's metadata or a Megatron checkpoint's layout says of each tensor, once the
integration has checked it (``ckptstore.integrations.formats``: ``Format.tensors``): its name,
dtype and global shape, and for each stored box the component entry that holds it and where
the box sits. Nothing is read to describe it; an export plans its files from these alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

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
