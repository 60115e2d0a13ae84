"""A DCP checkpoint's metadata checked against itself and against what its ranks stored.

:func:`~ckptstore.integrations.dcp._metadata.decode_metadata` has already checked that every
tensor's chunks tile it. Here, before any data is read:

- :func:`expected_items`: every chunk and plain value has exactly one location, every location
  names a chunk or value of the metadata, and a rank whose index the document records;
- :func:`check_entries`, when a rank's component is opened: the entry at each location holds
  what the metadata says -- a tensor of the chunk's dtype and sizes (so its bytes are the
  chunk's element count times the itemsize), or a plain value.

Every failure is an ``IntegrityError`` naming the tensor, with no ``digest``: the blobs are
healthy, the checkpoint's metadata is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from ckptstore.errors import IntegrityError
from ckptstore.extending import WRONG_METADATA, ComponentReader, Entry, torch_dtype
from ckptstore.integrations._common.documents import collector_paused
from ckptstore.integrations.dcp._metadata import Locations, StoredMetadata, rank_component


@dataclass(frozen=True, slots=True)
class Expected:
    """What one stored item must be: a chunk of tensor ``fqn`` (its offsets, sizes and dtype),
    or the plain value ``fqn`` (``dtype`` None)."""

    fqn: str
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] = ()
    dtype: torch.dtype | None = None

    def describe(self) -> str:
        """The item, for a message."""
        if self.dtype is None:
            return f"plain value {self.fqn!r}"
        return f"tensor {self.fqn!r}: the chunk at offset {list(self.offsets or ())}"


def expected_items(stored: StoredMetadata, where: str) -> dict[int, dict[int, Expected]]:
    """What each rank's component holds where: rank -> position -> item; checks that chunks,
    values and locations match one to one.

    Every load makes this check, over every chunk of the checkpoint (10^6 in a large FSDP job):
    it is first made with the locations keyed by plain tuples, which costs a fraction of
    building DCP's ``MetadataIndex`` for each chunk; a document that fails it anywhere is
    checked again the long way, which names the fault."""
    with collector_paused():  # 10^6 small objects, no cycle among them
        found = _matched(stored)
        return found if found is not None else _checked(stored, where)


def _matched(stored: StoredMetadata) -> dict[int, dict[int, Expected]] | None:
    """:func:`_checked`'s answer for metadata that passes every check, else None."""
    metadata = stored.metadata
    placed = Locations.keyed(metadata.storage_data).by_key
    ranks = stored.rank_indexes
    by_rank: dict[int, dict[int, Expected]] = {}
    matched = 0
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            items = [
                Expected(fqn, tuple(chunk.offsets), tuple(chunk.sizes), dtype)
                for chunk in md.chunks
            ]
        else:
            items = [Expected(fqn)]
        for item in items:
            location = placed.get((fqn, item.offsets))
            if location is None or location.rank not in ranks:
                return None
            held = by_rank.setdefault(location.rank, {})
            if location.position in held:  # also a chunk described twice
                return None
            held[location.position] = item
            matched += 1
    return by_rank if matched == len(placed) else None


def _checked(stored: StoredMetadata, where: str) -> dict[int, dict[int, Expected]]:
    """:func:`expected_items`, one ``MetadataIndex`` per chunk and value: the ``IntegrityError``
    it raises names the first item that is stored nowhere, by a rank the document does not
    record, or at a place another item holds, or the first location that names nothing."""
    metadata = stored.metadata
    claimed: dict[MetadataIndex, Expected] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            claimed[MetadataIndex(fqn)] = Expected(fqn)
            continue
        for chunk in md.chunks:
            offsets = tuple(chunk.offsets)
            index = MetadataIndex(fqn, chunk.offsets)
            claimed[index] = Expected(fqn, offsets, tuple(chunk.sizes), md.properties.dtype)
    by_rank: dict[int, dict[int, Expected]] = {}
    for index, item in claimed.items():
        location = metadata.storage_data.get(index)
        if location is None:
            raise IntegrityError(f"{where}: {item.describe()} is stored nowhere {WRONG_METADATA}")
        if location.rank not in stored.rank_indexes:
            raise IntegrityError(
                f"{where}: {item.describe()} is stored by rank {location.rank}, whose component "
                f"the metadata does not record {WRONG_METADATA}"
            )
        held = by_rank.setdefault(location.rank, {})
        if location.position in held:
            raise IntegrityError(
                f"{where}: {item.describe()} and {held[location.position].describe()} are both "
                f"stored as item {location.position} of {rank_component(location.rank)} "
                + WRONG_METADATA
            )
        held[location.position] = item
    for index in metadata.storage_data:
        if index not in claimed:
            raise IntegrityError(
                f"{where}: the metadata locates a chunk of {index.fqn!r} at offset "
                f"{None if index.offset is None else list(index.offset)} that it does not "
                f"describe {WRONG_METADATA}"
            )
    return by_rank


def check_entries(reader: ComponentReader, expected: dict[int, Expected]) -> None:
    """Check that one rank's component holds the items the metadata places in it."""
    where = reader.context
    for position, item in expected.items():
        _, entry = item_entry(reader, position)
        if item.dtype is None:
            if entry.is_array:
                raise IntegrityError(
                    f"{where}: {item.describe()} is stored as an array ({entry.kind}) "
                    + WRONG_METADATA
                )
            continue
        if entry.kind != "tensor":
            found = f"a {entry.kind} entry"
        elif torch_dtype(entry.dtype, where) != item.dtype or entry.shape != item.sizes:
            found = f"{entry.dtype}{list(entry.shape)}"
        else:
            continue
        raise IntegrityError(
            f"{where}: {item.describe()} is {_name(item.dtype)}{list(item.sizes)} in the "
            f"metadata, but {found} is stored there {WRONG_METADATA}"
        )


def item_entry(reader: ComponentReader, position: int) -> tuple[int, Entry]:
    """The entry (its number and itself) holding item ``position`` of a rank component (a
    list, one entry per item)."""
    tree = reader.index.tree
    nodes = tree.get("l") if isinstance(tree, dict) else None
    if not isinstance(nodes, list) or not 0 <= position < len(nodes):
        raise IntegrityError(f"{reader.context}: no stored item {position}")
    node = nodes[position]
    number = node.get("e") if isinstance(node, dict) else None
    if not isinstance(number, int) or not 0 <= number < len(reader.entries):
        raise IntegrityError(f"{reader.context}: stored item {position} is not one entry")
    return number, reader.entries[number]


def _name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")
