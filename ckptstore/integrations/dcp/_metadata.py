"""torch DCP's ``Metadata`` as JSON, so no rank ever unpickles a checkpoint's description.

DCP's own ``FileSystemWriter`` pickles ``Metadata`` (every rank unpickles it on load). Here it
is a JSON document stored as one value of the checkpoint's ``dcp/metadata`` component, and
decoding it builds only DCP's plain dataclasses, validating every field first -- each tensor's
chunks must tile it exactly (:mod:`ckptstore.serialize.tiling`) before torch sees a size.

The document also says where each written item lives: the rank whose component holds it and
its position in that component's item list, and each rank component's index digest -- so a
worker with nothing but object-store access can load from the metadata's digest alone. Decoded,
those locations are DCP's ``storage_data``: a read-only mapping (:class:`Locations`) kept by
plain tuple keys, since a document of 10^6 chunks is parsed by every rank of a job.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptstore.errors import (
    CkptStoreError,
    IntegrityError,
    MalformedMetadataError,
    SerializationError,
    UnreadableError,
)
from ckptstore.extending import (
    WRONG_METADATA,
    check_digest,
    check_shape,
    check_tiling,
    torch_dtype,
    torch_dtype_name,
)
from ckptstore.integrations._common.documents import collector_paused, json_list, json_str, naturals
from ckptstore.integrations._common.names import DCP_METADATA

FORMAT = "ckptstore/dcp-metadata"
VERSION = 1
#: The component holding DCP's metadata (JSON) and the rank components' index digests.
METADATA_COMPONENT = DCP_METADATA
METADATA_FORMAT = "ckptstore/dcp"

_MEMORY_FORMATS = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve": torch.preserve_format,
}


class Location(NamedTuple):
    """Where one written item is stored: item ``position`` of rank ``rank``'s component (a
    tuple: a document of 10^6 chunks builds 10^6 of them)."""

    rank: int
    position: int


#: A location's key without DCP's ``MetadataIndex``: (fqn, offsets or None for a plain value).
Key = tuple[str, tuple[int, ...] | None]


class Locations(Mapping[MetadataIndex, Location]):
    """A decoded document's item locations: a read-only mapping of DCP's ``MetadataIndex`` to
    :class:`Location`, kept by plain tuple keys (``by_key``). A document of 10^6 chunks would
    otherwise build 10^6 ``MetadataIndex`` objects (0.7 us each, with a ``torch.Size``) that
    a load looks up only for the items its plan reads; iterating makes them one at a time."""

    __slots__ = ("by_key",)

    def __init__(self, by_key: dict[Key, Location]) -> None:
        self.by_key = by_key

    @classmethod
    def keyed(cls, locations: Mapping[MetadataIndex, Location]) -> Locations:
        """``locations`` as a :class:`Locations` (itself if it is one)."""
        if isinstance(locations, Locations):
            return locations
        return cls({location_key(index): place for index, place in locations.items()})

    def __getitem__(self, index: MetadataIndex) -> Location:
        if not isinstance(index, MetadataIndex):
            raise KeyError(index)
        return self.by_key[location_key(index)]

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, offset in self.by_key:
            yield MetadataIndex(fqn, offset)

    def __len__(self) -> int:
        return len(self.by_key)

    def __repr__(self) -> str:
        return f"Locations({len(self.by_key)} items)"


def location_key(index: MetadataIndex) -> Key:
    """The plain tuple key :class:`Locations` keeps for ``index``."""
    return (index.fqn, None if index.offset is None else tuple(index.offset))


@dataclass(frozen=True, slots=True)
class StoredMetadata:
    """A decoded metadata document: DCP's ``Metadata`` (its ``storage_data`` a
    :class:`Locations`, mapping each ``MetadataIndex`` to a :class:`Location`) and each rank
    component's index digest."""

    metadata: Metadata
    rank_indexes: dict[int, str]


def encode_metadata(
    metadata: Metadata, locations: Mapping[MetadataIndex, Location], rank_indexes: dict[int, str]
) -> str:
    """The JSON document for ``metadata`` with the items' ``locations``."""
    with collector_paused():
        return _encode(metadata, locations, rank_indexes)


def _encode(
    metadata: Metadata, locations: Mapping[MetadataIndex, Location], rank_indexes: dict[int, str]
) -> str:
    tensors: dict[str, Any] = {}
    values: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            values.append(fqn)
            continue
        props = md.properties
        tensors[fqn] = {
            "dtype": torch_dtype_name(props.dtype, fqn),
            "size": list(md.size),
            "requires_grad": bool(props.requires_grad),
            "memory_format": _memory_format_name(props.memory_format, fqn),
            "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
        }
    storage_meta = metadata.storage_meta
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "dcp_version": metadata.version,
        "tensors": tensors,
        "values": values,
        "planner_data": _planner_data(metadata.planner_data),
        "storage_meta": None
        if storage_meta is None
        else {"save_id": storage_meta.save_id, "modules": list(storage_meta.modules)},
        "locations": [
            [
                index.fqn,
                None if index.offset is None else list(index.offset),
                loc.rank,
                loc.position,
            ]
            for index, loc in locations.items()
        ],
        "ranks": [[rank, digest] for rank, digest in sorted(rank_indexes.items())],
    }
    return json.dumps(doc, separators=(",", ":"))


def decode_metadata(text: str, where: str) -> StoredMetadata:
    """See :func:`_decode` (with the cyclic garbage collector paused: :func:`collector_paused`)."""
    with collector_paused():
        return _decode(text, where)


def _decode(text: str, where: str) -> StoredMetadata:
    """Parse and validate a metadata document: ``MalformedMetadataError`` (an IntegrityError
    and a SerializationError) names what is malformed, ``IntegrityError`` a tensor whose
    chunks do not tile it or whose shape no tensor has (or a document nested deeper than any
    writer nests it): either way the checkpoint is corrupt. A newer version of the document is
    ``UnreadableError`` (not damage: upgrade)."""
    try:
        doc = _parse(text, where)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("not a ckptstore DCP metadata document")
        version = doc.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
            raise UnreadableError(
                f"{where}: DCP metadata version {version} is newer than this ckptstore reads "
                f"({VERSION}); upgrade ckptstore (nothing was marked corrupt)"
            )
        if version != VERSION:
            raise ValueError(f"version {version!r} is not one any ckptstore writes")
        state: dict[str, Any] = {fqn: BytesStorageMetadata() for fqn in _strs(doc["values"])}
        for fqn, md in _dict(doc["tensors"]).items():
            if fqn in state:
                raise ValueError(f"{fqn!r} is both a tensor and a plain value")
            state[fqn] = _tensor_metadata(_dict(md), fqn, where)
        rows = json_list(doc["locations"])
        locations = Locations(dict(map(_location, rows)))
        if len(locations) != len(rows):
            raise ValueError("an item is given two locations")
        ranks = {_int(rank): _digest(digest) for rank, digest in json_list(doc["ranks"])}
        sm = doc.get("storage_meta")
        storage_meta = (
            None
            if sm is None
            else StorageMeta(
                save_id=_optional_str(sm.get("save_id")), modules=_strs(sm.get("modules", []))
            )
        )
        planner_data = doc.get("planner_data")
        metadata = Metadata(
            state_dict_metadata=state,
            planner_data=None
            if planner_data is None
            else {json_str(k): tuple(_path(v)) for k, v in _dict(planner_data).items()},
            storage_data=locations,
            storage_meta=storage_meta,
            version=_optional_str(doc.get("dcp_version")),
        )
    except (IntegrityError, UnreadableError):
        raise
    except (ValueError, TypeError, KeyError, AttributeError, CkptStoreError) as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise MalformedMetadataError(f"{where}: malformed DCP metadata ({detail})") from None
    return StoredMetadata(metadata, ranks)


def _parse(text: str, where: str) -> Any:
    """The JSON document; no deeper than Python's parser goes (the format is 5 levels deep)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise IntegrityError(
            f"{where}: the DCP metadata is nested deeper than any writer nests it {WRONG_METADATA}"
        ) from None


def _tensor_metadata(md: dict[str, Any], fqn: str, where: str) -> TensorStorageMetadata:
    """One tensor's metadata, its chunks checked to tile it (before torch sees a number)."""
    memory_format = _MEMORY_FORMATS.get(md.get("memory_format", "contiguous"))
    if memory_format is None:
        raise ValueError(f"{fqn}: unknown memory format {md.get('memory_format')!r}")
    dtype = torch_dtype(json_str(md["dtype"]), fqn)
    size = _ints(md["size"])
    boxes = list(map(_box, json_list(md["chunks"])))
    what = f"{where}: tensor {fqn!r}"
    check_shape(size, dtype.itemsize, what)
    check_tiling(size, boxes, what)
    props = TensorProperties(
        dtype=dtype,
        requires_grad=bool(md.get("requires_grad", False)),
        memory_format=memory_format,
    )
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in boxes]
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


# A document of 10^6 chunks is 10^6 of each of the next two: each checks the usual, well-formed
# row in a few C-level operations and hands anything else to the field-by-field validators,
# which raise the error that names it (the same answers, a third of the time).


def _box(chunk: Any) -> tuple[list[int], list[int]]:
    """A chunk's ``[offsets, sizes]``, both lists of non-negative integers."""
    if type(chunk) is list and len(chunk) == 2:
        offsets, sizes = chunk
        if type(offsets) is list and type(sizes) is list and naturals(offsets + sizes):
            return offsets, sizes
    offsets, sizes = chunk
    return _ints(offsets), _ints(sizes)


def _location(row: Any) -> tuple[Key, Location]:
    """One ``[fqn, offset or null, rank, position]`` row of the item locations."""
    if type(row) is list and len(row) == 4:
        fqn, offset, rank, position = row
        if (
            type(fqn) is str
            and (offset is None or (type(offset) is list and naturals(offset)))
            and type(rank) is int
            and type(position) is int
            and rank >= 0
            and position >= 0
        ):
            return (fqn, None if offset is None else tuple(offset)), Location(rank, position)
    fqn, offset, rank, position = row
    key = (json_str(fqn), None if offset is None else tuple(_ints(offset)))
    return key, Location(_int(rank), _int(position))


def _memory_format_name(memory_format: torch.memory_format, fqn: str) -> str:
    for name, known in _MEMORY_FORMATS.items():
        if memory_format == known:
            return name
    raise SerializationError(f"{fqn}: memory format {memory_format} cannot be recorded")


def _planner_data(data: Any) -> Any:
    """DefaultSavePlanner's planner data (flattened fqn -> original key path) as JSON."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise SerializationError(
            f"the save planner's planner_data is a {type(data).__name__}; ckptstore records the "
            "DefaultSavePlanner's mapping only (fqn -> key path)"
        )
    out = {}
    for fqn, path in data.items():
        keys = list(path) if isinstance(path, tuple | list) else [path]
        if not all(isinstance(k, str | int) and not isinstance(k, bool) for k in keys):
            raise SerializationError(f"{fqn}: planner data key path {path!r} is not str/int keys")
        out[str(fqn)] = keys
    return out


def _path(value: Any) -> list[str | int]:
    keys = json_list(value)
    if not all(isinstance(k, str | int) and not isinstance(k, bool) for k in keys):
        raise ValueError("a planner key path holds str and int keys")
    return keys


def _dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    return value


def _digest(value: Any) -> str:
    try:
        return check_digest(json_str(value))
    except CkptStoreError as exc:  # malformed text, not a damaged blob
        raise ValueError(str(exc)) from None


def _optional_str(value: Any) -> str | None:
    return None if value is None else json_str(value)


def _strs(value: Any) -> list[str]:
    return [json_str(v) for v in json_list(value)]


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"expected a non-negative integer, got {value!r}")
    return value


def _ints(value: Any) -> list[int]:
    return [_int(v) for v in json_list(value)]


def rank_component(rank: int) -> str:
    """The component that holds rank ``rank``'s items."""
    return f"dcp/rank{rank}"
