"""The checkpoint formats the integrations write, one entry each: its name, how to recognise
one from its component names and how to check its metadata as its loader does. The CLI
(``verify``, ``export``, ``show``) reads this table instead of knowing the formats.

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

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptstore.integrations._common.names import DCP_METADATA, MEGATRON_META

if TYPE_CHECKING:
    from ckptstore.extending import CheckpointInfo, ComponentInfo, ObjectStore, SourceTensor

#: Checks a checkpoint of the format in a store: ``(store, info)``; raises what a load raises.
Check = Callable[["ObjectStore", "CheckpointInfo"], None]
#: A checkpoint's state dict by name: one dict per item with ``name``, ``kind`` ("tensor" or a
#: value's kind), ``dtype`` and ``shape`` (global; None for values) and ``ranks`` (whose
#: components hold its data).
Items = Callable[["ObjectStore", "CheckpointInfo"], list[dict[str, Any]]]
#: A checkpoint's whole tensors as the stored pieces that tile each (``export`` plans and
#: streams its files from these), after the checks a load makes.
Tensors = Callable[["ObjectStore", "CheckpointInfo"], list["SourceTensor"]]


@dataclass(frozen=True, slots=True)
class Format:
    """One checkpoint format an integration writes."""

    #: What the CLI calls it ("dcp", "megatron").
    name: str
    #: The component every checkpoint of this format has, and no other checkpoint has.
    marker: str
    #: The checks its loader makes before reading data (raises what the load raises).
    validate: Check
    #: Its state dict by name (``ckptstore show --entries``).
    items: Items
    #: How people call it ("torch DCP").
    title: str
    #: Its whole tensors as stored pieces (``ckptstore export``).
    tensors: Tensors

    def detect(self, component_names: Iterable[str]) -> bool:
        """Whether a checkpoint with these components is of this format."""
        return self.marker in set(component_names)


def _validate_dcp(store: ObjectStore, info: CheckpointInfo) -> None:
    from ckptstore.integrations.dcp._reader import validate_checkpoint

    validate_checkpoint(store, info)


def _validate_megatron(store: ObjectStore, info: CheckpointInfo) -> None:
    from ckptstore.integrations._common.megatron_source import validate_checkpoint

    validate_checkpoint(store, info)


def _dcp_items(store: ObjectStore, info: CheckpointInfo) -> list[dict[str, Any]]:
    from ckptstore.integrations.dcp._reader import state_dict_items

    return state_dict_items(store, info)


def _megatron_items(store: ObjectStore, info: CheckpointInfo) -> list[dict[str, Any]]:
    from ckptstore.integrations._common.megatron_source import state_dict_items

    return state_dict_items(store, info)


def _dcp_tensors(store: ObjectStore, info: CheckpointInfo) -> list[SourceTensor]:
    from ckptstore.integrations.dcp._reader import tensor_sources

    return tensor_sources(store, info)


def _megatron_tensors(store: ObjectStore, info: CheckpointInfo) -> list[SourceTensor]:
    from ckptstore.integrations._common.megatron_source import tensor_sources

    return tensor_sources(store, info)


DCP = Format("dcp", DCP_METADATA, _validate_dcp, _dcp_items, "torch DCP", _dcp_tensors)
MEGATRON = Format(
    "megatron",
    MEGATRON_META,
    _validate_megatron,
    _megatron_items,
    "Megatron-Core",
    _megatron_tensors,
)
#: Every format, in the order they are tried.
FORMATS = (DCP, MEGATRON)


def detect(component_names: Iterable[str]) -> Format | None:
    """The format of a checkpoint with these components; None for a plain checkpoint."""
    names = set(component_names)
    return next((f for f in FORMATS if f.detect(names)), None)


def format_of(info: CheckpointInfo) -> Format | None:
    """The format of the checkpoint ``info`` describes; None for a plain checkpoint."""
    return detect(c.name for c in info.components)


def metadata_component(info: CheckpointInfo) -> ComponentInfo | None:
    """The component holding a DCP or Megatron checkpoint's metadata; None for any other."""
    found = format_of(info)
    if found is None:
        return None
    return next(c for c in info.components if c.name == found.marker)


def validate_checkpoint(store: ObjectStore, info: CheckpointInfo) -> None:
    """Make the checks a load of ``info`` makes before reading data (none for a checkpoint that
    is neither DCP nor Megatron). Raises what the load raises: ``IntegrityError`` without a
    ``digest``, naming the tensor, when the metadata is wrong; ``IntegrityError`` with one
    when a blob read on the way is damaged or missing; ``SerializationError``,
    ``UnreadableError`` or another ``CkptStoreError`` when this process cannot check it."""
    found = format_of(info)
    if found is not None:
        found.validate(store, info)
