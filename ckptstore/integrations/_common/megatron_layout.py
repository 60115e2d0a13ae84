"""Where a Megatron checkpoint's shards lie in the store, and the box arithmetic of resharding.

Each rank stores the main replicas of its shards as one component, ``megatron/rank<r>``: tensor
shard *i* at entry ``t<i>`` (reshaped to the global tensor's number of axes, so prepended axes
need no special case), the data of ShardedObject *j* under ``o<j>``. The coordinator commits a
``megatron/meta`` component whose ``layout`` (JSON text) lists every stored shard: key, global
shape, offset and shape of its box, dtype, and the component and entry that hold it. Loading a
tensor at any split copies in the parts of the stored boxes that overlap the requested one.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.errors import ConfigError, IntegrityError
from ckptstore.extending import (
    WRONG_METADATA,
    check_shape,
    check_tiling,
    torch_dtype,
    torch_dtype_name,
)
from ckptstore.integrations._common.documents import collector_paused, naturals
from ckptstore.integrations._common.names import MEGATRON_META

#: The component of rank ``r`` is ``SHARD_PREFIX + str(r)``.
SHARD_PREFIX = "megatron/rank"
#: metadata.json, the layout and the world size, committed by the coordinator.
META = MEGATRON_META
#: Megatron's common (non-sharded) state dict, stored without pickle.
COMMON = "megatron/common"
FORMAT = "ckptstore-megatron"
VERSION = 1

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class TensorShard:
    """One stored box of a global tensor."""

    key: str
    component: str
    path: str
    dtype: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The shard's dtype as a torch dtype."""
        return torch_dtype(self.dtype, f"tensor {self.key!r}")


@dataclass(frozen=True, slots=True)
class ObjectShard:
    """One stored ShardedObject (objects cannot be resharded: they match exactly)."""

    key: str
    component: str
    path: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Layout:
    """Every stored shard of a checkpoint (or of one rank, before the commit merges them)."""

    tensors: tuple[TensorShard, ...] = ()
    objects: tuple[ObjectShard, ...] = ()

    def to_json(self) -> str:
        """The layout as compact JSON text."""
        doc = {
            "tensors": [
                [t.key, t.component, t.path, t.dtype, t.global_shape, t.offset, t.shape]
                for t in self.tensors
            ],
            "objects": [
                [o.key, o.component, o.path, o.global_shape, o.global_offset] for o in self.objects
            ],
        }
        return json.dumps(doc, separators=(",", ":"))

    @staticmethod
    def from_json(text: object, where: str) -> Layout:
        """Parse and validate layout JSON read from storage; IntegrityError if malformed."""
        try:
            with collector_paused():  # 10^6 shards in a large job, no cycle among them
                doc = json.loads(text) if isinstance(text, str) else None
                shapes: set[tuple[tuple[int, ...], str]] = set()
                rows = doc["tensors"]  # type: ignore[index]
                tensors = tuple(_tensor_shard(row, where, shapes) for row in rows)
                objects = tuple(_object_shard(row) for row in doc["objects"])  # type: ignore[index]
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise IntegrityError(f"{where}: malformed Megatron layout ({exc})") from None
        except RecursionError:
            raise IntegrityError(
                f"{where}: the Megatron layout is nested deeper than any writer nests it "
                + WRONG_METADATA
            ) from None
        return Layout(tensors, objects)

    def merged(self, other: Layout) -> Layout:
        """This layout and ``other``'s shards together."""
        return Layout(self.tensors + other.tensors, self.objects + other.objects)

    def by_key(self) -> dict[str, list[TensorShard]]:
        """Tensor shards grouped by key, keys in first-stored order."""
        found: dict[str, list[TensorShard]] = {}
        for shard in self.tensors:
            found.setdefault(shard.key, []).append(shard)
        return found

    def check(self, components: Iterable[str], where: str) -> None:
        """Sharding integrity, before anything is read: each tensor's shards agree on its
        shape and dtype and tile it exactly; each object is stored once, inside its grid;
        every shard lies in one of ``components``. ``IntegrityError`` names the key."""
        with collector_paused():  # a list per key and a tuple per shard, no cycle among them
            self._check(components, where)

    def _check(self, components: Iterable[str], where: str) -> None:
        names = set(components)
        for key, shards in self.by_key().items():
            what = f"{where}: tensor {key!r}"
            first = shards[0]
            for shard in shards:
                if (shard.global_shape, shard.dtype) != (first.global_shape, first.dtype):
                    raise IntegrityError(
                        f"{what} is {first.dtype}{list(first.global_shape)} in one shard and "
                        f"{shard.dtype}{list(shard.global_shape)} in another {WRONG_METADATA}"
                    )
            check_tiling(first.global_shape, [(s.offset, s.shape) for s in shards], what)
        places: set[tuple[str, tuple[int, ...]]] = set()
        for obj in self.objects:
            place = (obj.key, obj.global_offset)
            inside = len(obj.global_offset) == len(obj.global_shape) and all(
                o < n for o, n in zip(obj.global_offset, obj.global_shape, strict=True)
            )
            if place in places or not inside:
                problem = "is stored twice" if inside else "lies outside its grid"
                raise IntegrityError(
                    f"{where}: sharded object {obj.key!r} at {list(obj.global_offset)} of "
                    f"{list(obj.global_shape)} {problem} {WRONG_METADATA}"
                )
            places.add(place)
        stored = [(t.key, t.component) for t in self.tensors]
        for key, component in stored + [(o.key, o.component) for o in self.objects]:
            if component not in names:
                raise IntegrityError(
                    f"{where}: {key!r} is stored in {component!r}, which the checkpoint does "
                    f"not have {WRONG_METADATA}"
                )


def _dims(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise ValueError(f"{value!r} is not a list of non-negative integers")
    return tuple(value)


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _tensor_shard(row: Any, where: str, shapes: set[tuple[tuple[int, ...], str]]) -> TensorShard:
    """One ``[key, component, path, dtype, global shape, offset, shape]`` row. A well-formed
    row whose global shape and dtype an earlier row already proved possible is checked in a few
    C-level steps; any other goes through :func:`_checked_shard`, which names a fault."""
    if type(row) is list and len(row) == 7:
        key, component, path, dtype, global_shape, offset, shape = row
        if (
            type(key) is str
            and type(component) is str
            and type(path) is str
            and type(dtype) is str
            and type(global_shape) is list
            and type(offset) is list
            and type(shape) is list
            and len(global_shape) == len(offset) == len(shape)
            and naturals(global_shape + offset + shape)
            and not any(map(operator.gt, map(operator.add, offset, shape), global_shape))
            and (tuple(global_shape), dtype) in shapes
        ):
            return TensorShard(
                key, component, path, dtype, tuple(global_shape), tuple(offset), tuple(shape)
            )
    shard = _checked_shard(row, where)
    shapes.add((shard.global_shape, shard.dtype))
    return shard


def _checked_shard(row: Any, where: str) -> TensorShard:
    key, component, path, dtype = (_text(v) for v in row[:4])
    shard = TensorShard(key, component, path, dtype, *(_dims(v) for v in row[4:7]))
    if len(row) != 7 or not (len(shard.global_shape) == len(shard.offset) == len(shard.shape)):
        raise ValueError(f"tensor {key!r}: shard rank does not match its global shape")
    if any(
        o + s > g for o, s, g in zip(shard.offset, shard.shape, shard.global_shape, strict=True)
    ):
        raise ValueError(f"tensor {key!r}: a shard lies outside its global shape")
    itemsize = torch_dtype(dtype, f"tensor {key!r}").itemsize
    check_shape(shard.global_shape, itemsize, f"{where}: tensor {key!r}")
    return shard


def _object_shard(row: Any) -> ObjectShard:
    if len(row) != 5:
        raise ValueError("an object shard has 5 fields")
    key, component, path = (_text(v) for v in row[:3])
    return ObjectShard(key, component, path, _dims(row[3]), _dims(row[4]))


def tensor_box(sharded: Any) -> Box:
    """The (offset, shape) box a Megatron ShardedTensor covers in global coordinates."""
    if sharded.flattened_range is not None:
        raise ConfigError(
            f"ShardedTensor {sharded.key!r} has a flattened_range, which Megatron-Core 0.16 "
            "no longer supports; build it with ShardedTensor.from_rank_offsets"
        )
    shape = (1,) * sharded.prepend_axis_num + tuple(sharded.local_shape)
    return tuple(sharded.global_offset), shape


def tensor_shard(sharded: Any, component: str, path: str) -> TensorShard:
    """The layout record of a ShardedTensor stored at ``component``/``path``."""
    offset, shape = tensor_box(sharded)
    return TensorShard(
        sharded.key,
        component,
        path,
        torch_dtype_name(sharded.dtype, sharded.key),
        tuple(sharded.global_shape),
        offset,
        shape,
    )


def overlap(a: Box, b: Box) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where boxes ``a`` and ``b`` intersect, as slices into each; None if they do not."""
    in_a, in_b = [], []
    for a_off, a_len, b_off, b_len in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(a_off, b_off), min(a_off + a_len, b_off + b_len)
        if lo >= hi:
            return None
        in_a.append(slice(lo - a_off, hi - a_off))
        in_b.append(slice(lo - b_off, hi - b_off))
    return tuple(in_a), tuple(in_b)


def fill_box(
    out: torch.Tensor, box: Box, key: str, shards: list[TensorShard], fetch: Any, where: str
) -> None:
    """Copy into ``out`` (shaped as ``box``) every overlapping part of the stored ``shards``;
    ``fetch(shard)`` returns a stored shard's tensor. Raises if part of ``box`` is not stored."""
    covered = 0
    for shard in shards:
        hit = overlap(box, (shard.offset, shard.shape))
        if hit is None:
            continue
        source = fetch(shard)
        if tuple(source.shape) != shard.shape or source.dtype != shard.torch_dtype:
            raise IntegrityError(
                f"{where}: tensor {key!r} at {shard.component}/{shard.path} is "
                f"{source.dtype}{list(source.shape)}, the layout says "
                f"{shard.dtype}{list(shard.shape)}"
            )
        out[hit[0]] = source[hit[1]]
        covered += math.prod(s.stop - s.start for s in hit[0])
    if covered != math.prod(box[1]):
        raise IntegrityError(
            f"{where}: the stored shards of {key!r} cover {covered} of the {math.prod(box[1])} "
            f"elements at offset {list(box[0])} shape {list(box[1])} (overlapping or missing "
            "shards); this checkpoint cannot be loaded at this split"
        )


def meta_state(layout: Layout, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """The ``megatron/meta`` component: metadata.json's content, the layout, the world size."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "metadata": config,
        "world_size": world_size,
        "layout": layout.to_json(),
    }
