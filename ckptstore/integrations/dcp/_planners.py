"""The no-pickle DCP planners and the snapshot stager (see :mod:`ckptstore.integrations.dcp`)."""

from __future__ import annotations

import copy
import io
import threading
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import Future as ConcurrentFuture
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import (
    ReadItem,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from ckptstore.extending import HostBuffers, check_targets
from ckptstore.integrations.dcp._plainvalues import decode_plain, encode_plain

# -- planners ---------------------------------------------------------------------------------


class NoPickleSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that non-tensor values are written as JSON text
    (see :mod:`ckptstore.integrations.plainvalues`) instead of ``torch.save`` pickles; a value
    that is not plain is refused at save time with its path."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        """A tensor as is; a plain value as a ``BytesIO`` of its JSON text."""
        if write_item.type == WriteItemType.BYTE_IO:
            if isinstance(object, io.BytesIO):
                object = object.getvalue()  # raw bytes are a plain value
            return io.BytesIO(encode_plain(object, write_item.index.fqn))
        return object


class NoPickleLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are decoded from JSON text and
    never unpickled: a pickle planted in the store is refused, not run; and that a target no
    load can fill element by element (meta, expanded, self-overlapping), or two that share
    memory, is refused by name before anything is read (torch's copy raised only once the
    other targets were filled, or silently lost elements).

    The check runs when DCP sets up the planner, on every rank, with the Stateful states
    (optimizer, schedulers) expanded: a refusal is each rank's failure of DCP's planning
    round, so every rank raises it and none waits. It comes before DCP's own set-up, which
    would replace a meta target by a new tensor the caller never sees."""

    def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        """The check of every tensor target DCP will write, then DCP's set-up."""
        flat, _ = flatten_state_dict(state_dict)
        check_targets("the DCP load's state_dict", local_targets(flat))
        super().set_up_planner(state_dict, *args, **kwargs)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode one plain value and put it where the state dict has it."""
        fqn = read_item.dest_index.fqn
        decoded = decode_plain(value.getvalue(), fqn)
        if self.flatten_state_dict:
            _set_element(self.original_state_dict, self.mappings[fqn], decoded)
        else:
            self.state_dict[fqn] = decoded


def local_targets(flat: dict[Any, Any]) -> dict[str, torch.Tensor]:
    """The tensors DCP writes for a flattened state dict, by name: a plain tensor itself, a
    DTensor's local shard, a ShardedTensor's local shards. A tensor under several names (a
    tied weight: one Parameter, as a model's state dict lists it under each name) is one
    target, named once: its entries were saved from that one tensor."""
    found: dict[str, torch.Tensor] = {}
    seen: set[tuple[Any, ...]] = set()
    for fqn, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, ShardedTensor):
            tensors = [(f"{fqn}[{n}]", s.tensor) for n, s in enumerate(value.local_shards())]
        elif isinstance(value, DTensor):  # DCP writes its local shard
            tensors = [(str(fqn), value.to_local())]
        else:
            tensors = [(str(fqn), value)]
        for name, tensor in tensors:
            if tensor.device.type != "meta":
                alias = (
                    tensor.data_ptr(),
                    tensor.device,
                    tensor.dtype,
                    tensor.shape,
                    tensor.stride(),
                )
                if alias in seen:
                    continue
                seen.add(alias)
            found[name] = tensor
    return found


def _set_element(root: Any, path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` in the caller's state dict. DCP's flattening records dict keys
    as strings, so a key that exists as an int (``{1: ...}``) is matched by its text: the value
    lands under the caller's own key, not beside it under ``"1"``."""
    # torch's own helper for the default planner's key paths; pinned with torch==2.13.
    from torch.distributed.checkpoint._traverse import set_element

    keys, node = [], root
    for key in path:
        if isinstance(node, Mapping) and key not in node:
            key = next((k for k in node if str(k) == str(key)), key)
        keys.append(key)
        if isinstance(node, Mapping):
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        else:
            node = None
    set_element(root, tuple(keys), value)


# -- staging ----------------------------------------------------------------------------------


class SnapshotStager(AsyncStager):
    """An ``AsyncStager`` for ``dcp.async_save`` that copies the state into host buffers kept
    from save to save (ckptstore's snapshot buffers), DTensors included: after the first save
    a snapshot is a memcpy into memory that is already mapped.

    The buffers are reused, so wait for one async save to finish before staging the next
    (:func:`save` with ``async_save=True`` does). Once a save is stored, :func:`save` calls
    :meth:`release`: by default the buffers stay resident, a copy of the state held between
    saves, as a run's snapshot buffers do (``keep_buffers=False`` hands their memory back to
    the kernel lazily: less held between saves, but a snapshot after the kernel took it faults
    in fresh pages, 2-3x the copy). ``close()`` drops them.
    """

    _synchronize_after_execute = False

    def __init__(self, *, keep_buffers: bool = True) -> None:
        self._buffers = HostBuffers(keep_buffers=keep_buffers)
        self._lock = threading.Lock()
        #: The upload of the last staged save, set by :func:`save`.
        self.in_flight: ConcurrentFuture[Any] | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` whose tensors live in the reused host buffers."""
        with self._lock:
            if self.in_flight is not None:
                self.in_flight.exception()  # its failure is the caller's to see, not ours
            self._buffers.begin()
            try:
                staged = self._copy(state_dict, "")
            finally:
                self._buffers.end()
            return staged  # type: ignore[no-any-return]

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copies are done."""
        return None

    def release(self) -> None:
        """The last staged save is stored: its buffers' memory may go back to the kernel (see
        :meth:`HostBuffers.release`). Called before that save's future is settled, so the next
        ``stage`` (which waits for the future) never writes into buffers being handed back."""
        self._buffers.release()

    def close(self) -> None:
        """Drop the buffers."""
        with self._lock:
            self._buffers.clear()

    def _copy(self, value: Any, path: str) -> Any:
        if isinstance(value, DTensor):
            local, _ = self._buffers.copy(path, value.to_local())
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._buffers.copy(path, value)[0]
        if isinstance(value, Mapping):
            return _same_kind(value, {k: self._copy(v, f"{path}/{k}") for k, v in value.items()})
        if isinstance(value, list | tuple):
            items = [self._copy(v, f"{path}/{i}") for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)


def _same_kind(original: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    """``items`` in a mapping of ``original``'s type where one can be made (an OrderedDict, a
    defaultdict with its factory); a plain dict otherwise."""
    if type(original) is dict:
        return items
    if isinstance(original, defaultdict):
        return type(original)(original.default_factory, items)
    try:
        return type(original)(items)  # type: ignore[call-arg]
    except TypeError:
        return items
