"""Reading a committed Megatron checkpoint: its meta, its common state and any box of a tensor.

Everything here comes from storage, so it is read through ckptstore's serializer (no pickle)
and validated before use; a stored shard is fetched at most once per :class:`Source`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ckptstore.errors import CheckpointNotFoundError, ConfigError, IntegrityError, UnreadableError
from ckptstore.extending import (
    WRONG_METADATA,
    CheckpointInfo,
    ComponentReader,
    ObjectStore,
    Piece,
    SourceTensor,
)
from ckptstore.integrations._common.megatron_layout import (
    COMMON,
    FORMAT,
    META,
    VERSION,
    Box,
    Layout,
    ObjectShard,
    TensorShard,
    fill_box,
    overlap,
    tensor_box,
)

#: metadata.json's fields (Megatron's CheckpointingConfig); nothing else is staged.
CONFIG_FIELDS = {
    "sharded_backend": str,
    "sharded_backend_version": int,
    "common_backend": str,
    "common_backend_version": int,
}


def parse_meta(meta: Any, where: str) -> tuple[dict[str, Any], Layout]:
    """metadata.json's content and the layout from a stored ``megatron/meta``; IntegrityError
    if it is not one this module wrote."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise IntegrityError(f"{where}: {META} is not a ckptstore Megatron meta component")
    if meta.get("version") != VERSION:
        # A newer writer's format is no proof of damage (DESIGN.md §12): nothing is marked.
        raise UnreadableError(
            f"{where}: Megatron meta version {meta.get('version')!r} is not supported "
            f"(this ckptstore reads {VERSION}); upgrade ckptstore"
        )
    config = meta.get("metadata")
    if not isinstance(config, dict) or any(
        not isinstance(config.get(name), kind) for name, kind in CONFIG_FIELDS.items()
    ):
        raise IntegrityError(f"{where}: {META} holds a malformed metadata.json")
    return {name: config[name] for name in CONFIG_FIELDS}, Layout.from_json(
        meta.get("layout"), where
    )


def meta_reader(store: ObjectStore, info: CheckpointInfo) -> ComponentReader:
    """A reader of ``info``'s meta component; CheckpointNotFoundError if it has none."""
    for comp in info.components:
        if comp.name == META:
            where = f"run {info.run!r}, step {info.step}, component {META!r}"
            return ComponentReader(store, comp.index_digest, context=where)
    raise CheckpointNotFoundError(
        f"run {info.run!r} step {info.step} is not a Megatron checkpoint (no {META!r} "
        "component); save it with ckptstore.integrations.megatron"
    )


class Source:
    """One committed Megatron checkpoint, open for reading."""

    def __init__(self, store: ObjectStore, info: CheckpointInfo, meta: Any = None) -> None:
        self.store = store
        self.info = info
        self.where = f"run {info.run!r}, step {info.step}"
        meta = meta_reader(store, info).load() if meta is None else meta
        self.config, self.layout = parse_meta(meta, self.where)
        # Before anything is allocated or read: the layout as a whole (sharding integrity).
        self.layout.check((c.name for c in info.components), self.where)
        self._tensors = self.layout.by_key()
        self._stored_in: dict[str, list[TensorShard]] = {}
        for shard in self.layout.tensors:
            self._stored_in.setdefault(shard.component, []).append(shard)
        self._readers: dict[str, ComponentReader] = {}
        self._fetched: dict[tuple[str, str], torch.Tensor] = {}

    def shared_meta(self) -> dict[str, Any]:
        """The meta as plain JSON values, rebuilt from what was parsed and checked: what the
        coordinator of a load hands the other ranks (``Source(store, info, meta)``), so they
        need not fetch it themselves."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "metadata": dict(self.config),
            "layout": self.layout.to_json(),
        }

    def reader(self, component: str) -> ComponentReader:
        """A reader of one of the checkpoint's components (its index fetched once, and checked
        to hold the tensor shards the layout places in it)."""
        if component not in self._readers:
            comp = next((c for c in self.info.components if c.name == component), None)
            if comp is None:
                raise IntegrityError(f"{self.where}: the layout names a missing {component!r}")
            context = f"{self.where}, component {component!r}"
            reader = ComponentReader(self.store, comp.index_digest, context=context)
            check_entries(reader, self._stored_in.get(component, []))
            self._readers[component] = reader
        return self._readers[component]

    def validate(self) -> None:
        """Every check a load makes before it reads data, made at once: the layout as a whole
        (checked on opening) and each component holding tensor shards against it (its index
        only). Reads no tensor data; raises what a load would raise."""
        for component in self._stored_in:
            self.reader(component)

    def fetch(self, shard: TensorShard) -> torch.Tensor:
        """A stored shard's tensor (fetched and verified once)."""
        self.prefetch([shard])
        return self._fetched[(shard.component, shard.path)]

    def prefetch(self, shards: Iterable[TensorShard]) -> None:
        """Fetch (and verify) the stored ``shards`` not fetched yet, one load per component:
        a pack of small tensors is read once, not once per tensor in it."""
        paths: dict[str, list[str]] = {}
        for shard in shards:
            if (shard.component, shard.path) not in self._fetched:
                paths.setdefault(shard.component, []).append(shard.path)
        # Every component's entries are checked before the first one's data is read.
        readers = {component: self.reader(component) for component in paths}
        for component, wanted in paths.items():
            for path, value in readers[component].load_paths(wanted).items():
                if not isinstance(value, torch.Tensor):
                    raise IntegrityError(f"{self.where}: {component}/{path} is no tensor")
                self._fetched[(component, path)] = value

    def needed(self, sharded: Any) -> list[TensorShard]:
        """The stored shards that a requested ShardedTensor overlaps."""
        box = tensor_box(sharded)
        return [s for s in self.shards(sharded.key) if overlap(box, (s.offset, s.shape))]

    def release(self) -> None:
        """Drop the fetched shards (after a load)."""
        self._fetched.clear()

    def shards(self, key: str) -> list[TensorShard]:
        """The stored shards of tensor ``key``; ConfigError if the checkpoint has none."""
        if key not in self._tensors:
            raise ConfigError(
                f"{self.where} has no tensor {key!r}; it has {len(self._tensors)} tensors, "
                f"e.g. {list(self._tensors)[:5]}; load with a matching sharded state dict"
            )
        return self._tensors[key]

    def tensor(self, sharded: Any) -> torch.Tensor:
        """The data of a requested Megatron ShardedTensor, resharded from the stored boxes."""
        shards = self.shards(sharded.key)
        stored = shards[0]
        wanted = tuple(sharded.global_shape)
        if stored.global_shape != wanted and not sharded.allow_shape_mismatch:
            raise ConfigError(
                f"tensor {sharded.key!r} is {list(stored.global_shape)} in {self.where} but "
                f"{list(wanted)} in the requested state dict; build the model with the saved shape"
            )
        if stored.torch_dtype != sharded.dtype:
            raise ConfigError(
                f"tensor {sharded.key!r} is {stored.dtype} in {self.where} but "
                f"{str(sharded.dtype).removeprefix('torch.')} in the requested state dict; "
                "load at the saved dtype, then convert"
            )
        box = tensor_box(sharded)
        out = torch.empty(tuple(sharded.local_shape), dtype=sharded.dtype)
        fill_box(out.view(box[1]), box, sharded.key, shards, self.fetch, self.where)
        return out

    def object(self, sharded: Any) -> Any:
        """The data of a requested Megatron ShardedObject (same key, shape and offset)."""
        place = (sharded.key, tuple(sharded.global_shape), tuple(sharded.global_offset))
        for found in self.layout.objects:
            if (found.key, found.global_shape, found.global_offset) == place:
                return self._subtree(found)
        raise ConfigError(
            f"{self.where} has no sharded object {sharded.unique_key!r}; objects cannot be "
            "resharded, load with the split they were saved at"
        )

    def _subtree(self, shard: ObjectShard) -> Any:
        """One top-level value of a rank component, rebuilt from only the entries it holds."""
        try:
            return self.reader(shard.component).load_subtree(shard.path)
        except KeyError:
            raise IntegrityError(
                f"{self.where}: {shard.component} has no object {shard.path!r}"
            ) from None

    def common(self) -> dict[str, Any]:
        """The common state dict ({} if none was saved)."""
        if not any(c.name == COMMON for c in self.info.components):
            return {}
        value = self.reader(COMMON).load()
        if not isinstance(value, dict):
            raise IntegrityError(f"{self.where}: {COMMON} is a {type(value).__name__}, not a dict")
        return value

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, whole, by key (each assembled from its shards, which are then
        dropped, so memory stays about one copy of the state)."""
        self.prefetch(s for shards in self._tensors.values() for s in shards)
        for key, shards in self._tensors.items():
            shape = shards[0].global_shape
            full = torch.empty(shape, dtype=shards[0].torch_dtype)
            box: Box = ((0,) * len(shape), shape)
            fill_box(full, box, key, shards, self.fetch, self.where)
            for shard in shards:
                self._fetched.pop((shard.component, shard.path), None)
            yield key, full


def validate_checkpoint(store: ObjectStore, info: CheckpointInfo) -> None:
    """Check a Megatron checkpoint's metadata as a load or an export does before reading any
    tensor data (:meth:`Source.validate`): an ``IntegrityError`` without a ``digest`` names
    the tensor whose layout is wrong; one with a ``digest`` names a blob found damaged or
    missing on the way."""
    Source(store, info).validate()


def check_entries(reader: ComponentReader, shards: Iterable[TensorShard]) -> None:
    """Check that a rank component holds each of ``shards`` as the layout says -- a tensor of
    its dtype and shape, so of its number of bytes -- before any of its data is read."""
    entries = {entry.path: entry for entry in reader.entries}
    for shard in shards:
        entry = entries.get(shard.path)
        stored = None if entry is None or entry.kind != "tensor" else (entry.dtype, entry.shape)
        if stored != (shard.dtype, shard.shape):
            found = "nothing" if entry is None else f"{entry.kind} {entry.dtype}{list(entry.shape)}"
            raise IntegrityError(
                f"{reader.context}: tensor {shard.key!r} at {shard.path!r} is "
                f"{shard.dtype}{list(shard.shape)} in the layout, but {found} is stored there "
                + WRONG_METADATA
            )


def state_dict_items(store: ObjectStore, info: CheckpointInfo) -> list[dict[str, Any]]:
    """The checkpoint's state dict by name (see ``formats.Items``), from ckptstore's own
    reading of the layout: Megatron-Core itself is not imported."""
    where = f"run {info.run!r}, step {info.step}"
    _, layout = parse_meta(meta_reader(store, info).load(), where)
    items: dict[str, dict[str, Any]] = {}
    for t in layout.tensors:
        item = items.setdefault(
            t.key,
            {"name": t.key, "kind": "tensor", "dtype": t.dtype, "shape": list(t.global_shape)},
        )
        item.setdefault("ranks", set()).add(_rank_of(t.component))
    for o in layout.objects:
        item = items.setdefault(
            o.key, {"name": o.key, "kind": "object", "dtype": None, "shape": None}
        )
        item.setdefault("ranks", set()).add(_rank_of(o.component))
    return [item | {"ranks": sorted(item["ranks"])} for item in items.values()]


def _rank_of(component: str) -> int:
    """``megatron/rank3`` -> 3."""
    return int(component.rsplit("rank", 1)[1])


def tensor_sources(store: ObjectStore, info: CheckpointInfo) -> list[SourceTensor]:
    """The tensors of the checkpoint, by ShardedTensor key, as the stored pieces that tile each
    (see ``formats.Tensors``), after the checks a load makes (Megatron itself is not imported)."""
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
