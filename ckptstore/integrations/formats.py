"""The checkpoint formats the integrations write, one entry each: its name, how to recognise
one from its component names and how to check its metadata as its loader does. Each is
registered in :mod:`ckptstore.formats` (the registry below both the integrations and
``maintenance``), where ``verify``, ``export`` and ``show`` look formats up instead of knowing
them; this module re-exports the lookups.

Importing this module costs nothing: a format's code (torch.distributed.checkpoint for DCP) is
imported when one of its checkpoints is checked. Megatron checkpoints never need
Megatron-Core here (their layout and reader are ckptstore's own code).

The checks are the loaders' own (``dcp._reader.validate_checkpoint``,
``_common.megatron_source.validate_checkpoint``); they read the metadata component and the rank
components' indexes, never tensor data. A checkpoint whose metadata lies -- chunks that leave a
gap, overlap or lie past the tensor's end, a size no tensor has, a rank component that holds
something else -- has healthy blobs and is still no checkpoint a load accepts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptstore.formats import (
    Format,
    detect,
    format_of,
    metadata_component,
    register_format,
    validate_checkpoint,
)
from ckptstore.integrations._common.names import DCP_METADATA, MEGATRON_META

if TYPE_CHECKING:
    from ckptstore.extending import CheckpointInfo, ObjectStore, SourceTensor


def _validate_dcp(store: ObjectStore, info: CheckpointInfo) -> None:
    from ckptstore.integrations.dcp._reader import validate_checkpoint

    validate_checkpoint(store, info)


def _validate_megatron(store: ObjectStore, info: CheckpointInfo) -> None:
    from ckptstore.integrations._common.megatron_source import validate_checkpoint

    validate_checkpoint(store, info)


def _dcp_items(store: ObjectStore, info: CheckpointInfo) -> list[dict[str, Any]]:
    # From the metadata document alone: a listing imports neither torch nor DCP.
    from ckptstore.integrations._common.dcp_listing import state_dict_items

    return state_dict_items(store, info)


def _megatron_items(store: ObjectStore, info: CheckpointInfo) -> list[dict[str, Any]]:
    # From the meta component alone: a listing imports no torch.
    from ckptstore.integrations._common.megatron_listing import state_dict_items

    return state_dict_items(store, info)


def _dcp_tensors(store: ObjectStore, info: CheckpointInfo) -> list[SourceTensor]:
    from ckptstore.integrations.dcp._reader import tensor_sources

    return tensor_sources(store, info)


def _megatron_tensors(store: ObjectStore, info: CheckpointInfo) -> list[SourceTensor]:
    from ckptstore.integrations._common.megatron_source import tensor_sources

    return tensor_sources(store, info)


DCP = register_format(
    Format("dcp", DCP_METADATA, _validate_dcp, _dcp_items, "torch DCP", _dcp_tensors)
)
MEGATRON = register_format(
    Format(
        "megatron",
        MEGATRON_META,
        _validate_megatron,
        _megatron_items,
        "Megatron-Core",
        _megatron_tensors,
    )
)
#: Every format the integrations write, in the order they are tried.
FORMATS = (DCP, MEGATRON)

__all__ = [
    "DCP",
    "FORMATS",
    "MEGATRON",
    "Format",
    "detect",
    "format_of",
    "metadata_component",
    "validate_checkpoint",
]
