"""A DCP checkpoint's state dict by name, read from its metadata document without torch: what
``ckptstore show --entries`` prints (``formats.Items``). Importing torch.distributed.checkpoint
costs seconds; a listing needs only the JSON document that ``dcp._metadata`` writes.

Only what a listing shows is checked here (the document's format and version, each field's
type); :func:`ckptstore.integrations.dcp.validate_checkpoint` checks what a load checks (each
tensor's chunks tile it, each rank component holds what the document places there)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ckptstore.errors import MalformedMetadataError, SerializationError, UnreadableError
from ckptstore.formats import json_values
from ckptstore.integrations._common.documents import json_list, json_str
from ckptstore.integrations._common.names import DCP_METADATA

if TYPE_CHECKING:
    from ckptstore.extending import CheckpointInfo, ObjectStore

#: The metadata component's ``format`` value (``dcp._metadata.METADATA_FORMAT``).
COMPONENT_FORMAT = "ckptstore/dcp"
#: The document's ``format`` and the newest ``version`` read (``dcp._metadata``'s).
DOCUMENT_FORMAT = "ckptstore/dcp-metadata"
DOCUMENT_VERSION = 1


def state_dict_items(store: ObjectStore, info: CheckpointInfo) -> list[dict[str, Any]]:
    """The checkpoint's state dict by name: each item's global dtype and shape (None for a
    plain value) and the ranks whose components hold its data, values first, as
    ``dcp._reader.state_dict_items`` lists them."""
    where = f"run {info.run!r}, step {info.step}"
    component = next(c for c in info.components if c.name == DCP_METADATA)
    values = json_values(store, component, where)
    where = f"{where}, component {DCP_METADATA!r}"
    if values.get("format") != COMPONENT_FORMAT or not isinstance(values.get("metadata"), str):
        raise SerializationError(f"{where}: not the metadata of a DCP checkpoint")
    return document_items(values["metadata"], where)


def document_items(text: str, where: str) -> list[dict[str, Any]]:
    """The state dict a metadata document (JSON ``text``) describes, as
    :func:`state_dict_items` lists it. A malformed document is ``MalformedMetadataError``
    naming ``where`` and what is wrong; a newer version ``UnreadableError`` (upgrade)."""
    try:
        return _items(json.loads(text), where)
    except UnreadableError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise MalformedMetadataError(f"{where}: malformed DCP metadata ({detail})") from None


def _items(doc: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(doc, dict) or doc.get("format") != DOCUMENT_FORMAT:
        raise ValueError("not a ckptstore DCP metadata document")
    version = doc.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > DOCUMENT_VERSION:
        raise UnreadableError(
            f"{where}: DCP metadata version {version} is newer than this ckptstore reads "
            f"({DOCUMENT_VERSION}); upgrade ckptstore"
        )
    if version != DOCUMENT_VERSION:
        raise ValueError(f"version {version!r} is not one any ckptstore writes")
    ranks: dict[str, set[int]] = {}
    for row in json_list(doc["locations"]):
        fqn, _offset, rank, _position = json_list(row)
        ranks.setdefault(json_str(fqn), set()).add(_natural(rank))
    items: list[dict[str, Any]] = [
        {"name": fqn, "kind": "value", "dtype": None, "shape": None}
        for fqn in map(json_str, json_list(doc["values"]))
    ]
    tensors = doc["tensors"]
    if not isinstance(tensors, dict):
        raise TypeError(f"expected an object, got {type(tensors).__name__}")
    for fqn, md in tensors.items():
        if not isinstance(md, dict):
            raise TypeError(f"{fqn!r}: expected an object, got {type(md).__name__}")
        shape = [_natural(n) for n in json_list(md["size"])]
        items.append(
            {"name": fqn, "kind": "tensor", "dtype": json_str(md["dtype"]), "shape": shape}
        )
    return [item | {"ranks": sorted(ranks.get(item["name"], ()))} for item in items]


def _natural(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"expected a non-negative integer, got {value!r}")
    return value
