"""The registry of checkpoint formats: what a format is (:class:`Format`), and the lookups that
tell a checkpoint's format from its component names.

It sits below both the integrations, which write the formats and register them
(:mod:`ckptstore.integrations.formats` registers DCP and Megatron-Core), and ``maintenance``
(``verify`` checks a checkpoint's metadata as its loader would) and the CLI, which look a
format up here without knowing any. ``import ckptstore`` registers the integrations' formats
(importing that table costs nothing: a format's code is imported when a checkpoint of it is
checked), so the lookups see every format whatever was imported first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptstore.manifest.records import CheckpointInfo, ComponentInfo
    from ckptstore.objectstore import ObjectStore
    from ckptstore.serialize.pieces import SourceTensor

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


_REGISTERED: dict[str, Format] = {}


def register_format(found: Format) -> Format:
    """Add ``found`` to the formats the lookups try (again under its name: replaced); returns
    it. Two formats may not share a marker component."""
    clash = next(
        (f for f in _REGISTERED.values() if f.marker == found.marker and f.name != found.name),
        None,
    )
    if clash is not None:
        raise ValueError(f"formats {clash.name!r} and {found.name!r} share {found.marker!r}")
    _REGISTERED[found.name] = found
    return found


def registered_formats() -> tuple[Format, ...]:
    """Every registered format, in the order they are tried."""
    return tuple(_REGISTERED.values())


def detect(component_names: Iterable[str]) -> Format | None:
    """The format of a checkpoint with these components; None for a plain checkpoint."""
    names = set(component_names)
    return next((f for f in _REGISTERED.values() if f.detect(names)), None)


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
    is of no registered format). Raises what the load raises: ``IntegrityError`` without a
    ``digest``, naming the tensor, when the metadata is wrong; ``IntegrityError`` with one
    when a blob read on the way is damaged or missing; ``SerializationError``,
    ``UnreadableError`` or another ``CkptStoreError`` when this process cannot check it."""
    found = format_of(info)
    if found is not None:
        found.validate(store, info)


def json_values(store: ObjectStore, component: ComponentInfo, where: str) -> dict[str, Any]:
    """``component``'s JSON values by path, read from its index alone: no tensor data and no
    torch, for listings of a format's metadata (``ckptstore show --entries``). ``where`` (run,
    step) goes into error messages."""
    from ckptstore.serialize.indexes import fetch_index

    context = f"{where}, component {component.name!r}"
    index = fetch_index(store, component.index_digest, context=context)
    return {e.path: e.value for e in index.entries if not e.is_array}
