"""A checkpoint's state-dict names, read from its component indexes without torch.

A component's index blob is JSON, decoded and validated by
:func:`ckptstore.serialize.index.decode_index`, which never imports torch: the server must start
and run without it. Indexes are content-addressed, so one read and verified is kept
(:class:`IndexCache`).

Three layouts are told apart by their components:

- **plain** (``Run.save``, ``ShardWriter``): one row per entry of each component; a component
  named ``.../rank<r>`` is rank ``r``'s;
- **DCP** (``dcp/metadata`` + ``dcp/rank<r>``): one row per FQN of DCP's metadata, its chunks
  found through the metadata's locations (rank, item position);
- **Megatron** (``megatron/meta`` + ``megatron/rank<r>``): one row per sharded-tensor key of
  the layout, its shards in the rank components.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptstore.errors import SerializationError
from ckptstore.manifest.records import ComponentInfo
from ckptstore.serialize.index import ARRAY_KINDS, Entry, decode_index

if TYPE_CHECKING:
    from ckptstore.objectstore import ObjectStore

#: The largest index the server reads (an index of ~300,000 entries); beyond it, use
#: ``ckptstore show --entries``.
MAX_INDEX_BYTES = 64 << 20
DCP_METADATA = "dcp/metadata"
DCP_RANK = "dcp/rank"
MEGATRON_META = "megatron/meta"
MEGATRON_RANK = "megatron/rank"
_RANK = re.compile(r"(?:^|/)rank([0-9]{1,9})$")


@dataclass(frozen=True, slots=True)
class Piece:
    """``length`` bytes at ``offset`` of blob ``digest``, holding part of a value; ``at`` is
    where its shard starts in the whole tensor (DCP, Megatron; empty for a plain entry)."""

    digest: str
    offset: int
    length: int
    at: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Index:
    """A component index: its structure tree and entries (also by path)."""

    tree: Any
    entries: tuple[Entry, ...]
    by_path: dict[str, Entry] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TensorRow:
    """One state-dict name of a checkpoint: what it holds and which blob pieces hold it.

    ``component`` is the component for a plain entry, ``dcp`` or ``megatron`` for a name whose
    shards lie in several rank components. ``stored_bytes`` is its share of the stored bytes
    of its blobs (None while unknown); ``value`` the JSON value of a non-array entry.
    """

    component: str
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    ranks: tuple[int, ...]
    pieces: tuple[Piece, ...]
    value: Any = None
    stored_bytes: int | None = None
    codecs: tuple[str, ...] = ()

    @property
    def is_array(self) -> bool:
        """Whether the row's bytes live in blobs (else it holds a JSON ``value``)."""
        return self.kind in ARRAY_KINDS or self.kind == "shard"


# -- parsing an index --------------------------------------------------------------------------


def parse_index(raw: bytes | memoryview, where: str) -> Index:
    """An index blob's raw bytes as an :class:`Index` (decoded by
    :func:`~ckptstore.serialize.index.decode_index`); SerializationError naming ``where``."""
    decoded = decode_index(raw, where)
    return Index(decoded.tree, decoded.entries, {e.path: e for e in decoded.entries})


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dims(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_count(d) for d in value):
        raise SerializationError(f"{where}: a shape is a list of non-negative integers")
    return tuple(value)


class IndexCache:
    """Component indexes by digest, read from the store once, verified, and kept (the least
    recently used are dropped past ``capacity``). Thread-safe."""

    def __init__(self, store: Callable[[], ObjectStore], capacity: int = 256) -> None:
        """A cache over the store that ``store()`` returns (opened on first use)."""
        self._store = store
        self._capacity = capacity
        self._kept: OrderedDict[str, Index] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: str, where: str) -> Index:
        """The index blob ``digest`` (of the component ``where`` names)."""
        with self._lock:
            if digest in self._kept:
                self._kept.move_to_end(digest)
                return self._kept[digest]
        # Imported here: the blob codecs need numpy and zstandard, which pages that show only
        # the manifest never load.
        from ckptstore.cas.blobs import get_blob

        _, raw = get_blob(self._store(), digest, context=where, limit=MAX_INDEX_BYTES)
        index = parse_index(raw, f"index {digest} ({where})")
        with self._lock:
            self._kept[digest] = index
            while len(self._kept) > self._capacity:
                self._kept.popitem(last=False)
        return index


# -- a checkpoint's rows ------------------------------------------------------------------------

#: Reads one component's index: (component) -> Index.
IndexOf = Callable[[ComponentInfo], Index]


def layout_of(components: Iterable[ComponentInfo]) -> str:
    """``dcp``, ``megatron`` or ``plain``: how the checkpoint was saved."""
    names = {c.name for c in components}
    if DCP_METADATA in names:
        return "dcp"
    if MEGATRON_META in names:
        return "megatron"
    return "plain"


def tensor_rows(components: Sequence[ComponentInfo], index_of: IndexOf) -> list[TensorRow]:
    """Every state-dict name of a checkpoint with these components."""
    layout = layout_of(components)
    by_name = {c.name: c for c in components}
    if layout == "dcp":
        rows = _dcp_rows(by_name, index_of)
        rest = [c for c in components if not c.name.startswith("dcp/")]
    elif layout == "megatron":
        rows = _megatron_rows(by_name, index_of)
        rest = [c for c in components if not c.name.startswith(("megatron/rank", MEGATRON_META))]
    else:
        rows, rest = [], list(components)
    for comp in rest:
        rows += [_plain_row(comp.name, e) for e in index_of(comp).entries]
    return rows


def rank_of(component: str) -> tuple[int, ...]:
    """``(r,)`` for a component named ``.../rank<r>``, else ``()``."""
    match = _RANK.search(component)
    return (int(match.group(1)),) if match else ()


def _plain_row(component: str, entry: Entry) -> TensorRow:
    return TensorRow(
        component,
        entry.path,
        entry.kind,
        entry.dtype,
        entry.shape,
        entry.nbytes,
        rank_of(component),
        tuple(Piece(s.digest, s.offset, s.length) for s in entry.segments),
        entry.value,
    )


def _json_value(index: Index, path: str, where: str) -> Any:
    entry = index.by_path.get(path)
    if entry is None or not isinstance(entry.value, str):
        raise SerializationError(f"{where}: no {path!r} text in the component")
    try:
        return json.loads(entry.value)
    except (ValueError, RecursionError) as exc:
        raise SerializationError(f"{where}: {path!r} is not valid JSON ({exc})") from None


def _component(by_name: dict[str, ComponentInfo], name: str, where: str) -> ComponentInfo:
    found = by_name.get(name)
    if found is None:
        raise SerializationError(f"{where}: the checkpoint has no component {name!r}")
    return found


@dataclass(slots=True)
class _Shards:
    """The stored shards of one name while rows are assembled."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    held: list[tuple[tuple[int, ...], int, Entry]] = field(default_factory=list)

    def row(self, component: str, name: str) -> TensorRow:
        held = sorted(self.held, key=lambda h: (h[0], h[1], h[2].path))
        pieces = tuple(
            Piece(s.digest, s.offset, s.length, at) for at, _, e in held for s in e.segments
        )
        value = held[0][2].value if held and self.kind == "value" else None
        return TensorRow(
            component,
            name,
            self.kind,
            self.dtype,
            self.shape,
            sum(e.nbytes for _, _, e in held),
            tuple(sorted({rank for _, rank, _ in held})),
            pieces,
            value,
        )


def _dcp_rows(by_name: dict[str, ComponentInfo], index_of: IndexOf) -> list[TensorRow]:
    where = f"component {DCP_METADATA!r}"
    doc = _json_value(index_of(_component(by_name, DCP_METADATA, where)), "metadata", where)
    try:
        tensors: dict[str, Any] = doc["tensors"]
        found = {
            fqn: _Shards("shard", str(md["dtype"]), _dims(md["size"], where))
            for fqn, md in tensors.items()
        }
        found.update({str(fqn): _Shards("value", "", ()) for fqn in doc["values"]})
        for fqn, offset, rank, position in doc["locations"]:
            comp = _component(by_name, f"{DCP_RANK}{int(rank)}", where)
            entry = _item_entry(index_of(comp), int(position), f"component {comp.name!r}")
            at = () if offset is None else _dims(offset, where)
            found[str(fqn)].held.append((at, int(rank), entry))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SerializationError(f"{where}: malformed DCP metadata ({exc!r})") from None
    return [shards.row("dcp", fqn) for fqn, shards in found.items()]


def _item_entry(index: Index, position: int, where: str) -> Entry:
    """The entry of item ``position`` of a DCP rank component (a list, one entry per item)."""
    nodes = index.tree.get("l") if isinstance(index.tree, dict) else None
    node = nodes[position] if isinstance(nodes, list) and 0 <= position < len(nodes) else None
    number = node.get("e") if isinstance(node, dict) else None
    if not isinstance(number, int) or not 0 <= number < len(index.entries):
        raise SerializationError(f"{where}: no stored item {position}")
    return index.entries[number]


def _megatron_rows(by_name: dict[str, ComponentInfo], index_of: IndexOf) -> list[TensorRow]:
    where = f"component {MEGATRON_META!r}"
    doc = _json_value(index_of(_component(by_name, MEGATRON_META, where)), "layout", where)
    found: dict[str, _Shards] = {}
    try:
        for key, component, path, dtype, global_shape, offset, _shape in doc["tensors"]:
            shards = found.setdefault(
                str(key), _Shards("shard", str(dtype), _dims(global_shape, where))
            )
            _add_shard(shards, _dims(offset, where), by_name, index_of, component, path)
        for key, component, path, global_shape, global_offset in doc["objects"]:
            shards = found.setdefault(str(key), _Shards("object", "", _dims(global_shape, where)))
            _add_shard(shards, _dims(global_offset, where), by_name, index_of, component, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise SerializationError(f"{where}: malformed Megatron layout ({exc!r})") from None
    return [shards.row("megatron", key) for key, shards in found.items()]


def _add_shard(
    shards: _Shards,
    at: tuple[int, ...],
    by_name: dict[str, ComponentInfo],
    index_of: IndexOf,
    component: Any,
    path: Any,
) -> None:
    """Add the entries at ``component``/``path`` (one tensor, or a ShardedObject's subtree)."""
    comp = _component(by_name, str(component), f"component {MEGATRON_META!r}")
    index = index_of(comp)
    exact = index.by_path.get(str(path))
    prefix = f"{path}/"
    entries = [exact] if exact else [e for e in index.entries if e.path.startswith(prefix)]
    if not entries:
        raise SerializationError(f"component {comp.name!r}: no entry {path!r}")
    ranks = rank_of(comp.name)
    shards.held += [(at, ranks[0] if ranks else 0, e) for e in entries]
