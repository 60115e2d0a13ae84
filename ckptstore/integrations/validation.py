"""A DCP or Megatron checkpoint's metadata checked as its loader checks it, without loading it:
what ``ckptstore verify`` adds to re-hashing the blobs. A checkpoint whose metadata lies --
chunks that leave a gap, overlap or lie past the tensor's end, a size no tensor has, a rank
component that holds something else -- has healthy blobs and is still no checkpoint a load
accepts.

The checks are the loaders' own (``dcp_reader.validate_checkpoint``,
``_megatron_source.validate_checkpoint``); they read the metadata component and the rank
components' indexes, never tensor data. torch.distributed.checkpoint is imported for a DCP
checkpoint only, Megatron-Core never (the Megatron checks are ckptstore's own code).
"""

from __future__ import annotations

from ckptstore.integrations._megatron_source import validate_checkpoint as validate_megatron
from ckptstore.integrations._names import DCP_METADATA, MEGATRON_META
from ckptstore.manifest.records import CheckpointInfo, ComponentInfo
from ckptstore.objectstore import ObjectStore


def metadata_component(info: CheckpointInfo) -> ComponentInfo | None:
    """The component holding a DCP or Megatron checkpoint's metadata; None for any other."""
    for name in (DCP_METADATA, MEGATRON_META):
        for component in info.components:
            if component.name == name:
                return component
    return None


def validate_checkpoint(store: ObjectStore, info: CheckpointInfo) -> None:
    """Make the checks a load of ``info`` makes before reading data (none for a checkpoint that
    is neither DCP nor Megatron). Raises what the load raises: ``IntegrityError`` without a
    ``digest``, naming the tensor, when the metadata is wrong; ``IntegrityError`` with one
    when a blob read on the way is damaged or missing; ``SerializationError``,
    ``UnreadableError`` or another ``CkptStoreError`` when this process cannot check it."""
    found = metadata_component(info)
    if found is None:
        return
    if found.name == DCP_METADATA:
        # Imported here: torch.distributed.checkpoint is for DCP checkpoints only.
        from ckptstore.integrations.dcp_reader import validate_checkpoint as validate_dcp

        validate_dcp(store, info)
    else:
        validate_megatron(store, info)
