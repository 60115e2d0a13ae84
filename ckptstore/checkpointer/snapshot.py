"""The only part of a save that blocks training: copying state into host buffers.

Buffers are kept between saves and reused when a tensor's path, dtype and shape are unchanged,
so steady-state snapshots copy into memory that is already mapped (no page faults) — the
dominant cost of a first snapshot. The leaf describing a buffer (its byte view) is kept with
it, so a steady-state snapshot does no per-tensor work beyond the copy. Tensors on a GPU are
copied into pinned host buffers. One save is in flight at a time, so a buffer (and its leaf) is
never reused while its bytes are still being stored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ckptstore.serialize.save import FlatState, check_tensor, flatten_state, tensor_leaf
from ckptstore.serialize.tree import Leaf

log = logging.getLogger("ckptstore.checkpointer")

#: A save with at least this many components, nearly all bare tensors, is most likely one
#: state dict passed unwrapped: every tensor becomes its own component (index and objects).
UNWRAPPED_COMPONENTS = 100


def looks_unwrapped(components: Mapping[str, Any]) -> bool:
    """Hundreds of components that are nearly all single tensors (``model.state_dict()``
    passed as the components mapping instead of as one component)."""
    if len(components) < UNWRAPPED_COMPONENTS:
        return False
    bare = sum(isinstance(value, torch.Tensor) for value in components.values())
    return bare >= 0.9 * len(components)


class HostBuffers:
    """Host buffers kept between snapshots, one per key, reused while the tensor stored under
    the key keeps its dtype and shape (pinned when the source is on a GPU).

    A snapshot is ``begin()``, ``copy(key, tensor)`` for each tensor, ``end()``: ``end`` forgets
    the buffers of keys that were not copied this time (memory follows the state's size) and
    waits for device-to-host copies. The caller must not reuse a buffer while its bytes are
    still being stored (one save in flight).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()
        self._from_gpu = False

    def begin(self) -> None:
        """Start a snapshot."""
        self._used = set()
        self._from_gpu = False

    def copy(self, key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Copy ``tensor`` into the buffer kept for ``key``; returns (buffer, whether it was
        newly allocated)."""
        self._used.add(key)
        source = tensor.detach()
        self._from_gpu |= source.device.type == "cuda"
        buffer = self._buffers.get(key)
        fresh = buffer is None or buffer.dtype != source.dtype or buffer.shape != source.shape
        if fresh:
            buffer = torch.empty(
                source.shape, dtype=source.dtype, pin_memory=source.device.type == "cuda"
            )
            self._buffers[key] = buffer
        assert buffer is not None
        buffer.copy_(source.resolve_conj().resolve_neg(), non_blocking=True)
        return buffer, fresh

    def end(self) -> set[str]:
        """Finish a snapshot; returns the keys whose buffers were forgotten."""
        gone = set(self._buffers) - self._used
        for key in gone:
            del self._buffers[key]
        if self._from_gpu:
            torch.cuda.synchronize()  # the device-to-host copies were asynchronous
        return gone

    def clear(self) -> None:
        """Forget every buffer."""
        self._buffers.clear()


class Snapshotter:
    """Copies components into reusable host buffers and flattens them."""

    def __init__(self) -> None:
        self._pool = HostBuffers()
        #: buffer key -> the leaf that views its buffer (rebuilt when the buffer is new)
        self._leaves: dict[str, Leaf] = {}
        self._warned_unwrapped = False

    def take(self, components: Mapping[str, Any], *, copy: bool = True) -> dict[str, FlatState]:
        """Flatten and copy every component. Unsupported values raise here, naming the path.
        Hundreds of bare-tensor components are warned about once (see :func:`looks_unwrapped`).

        ``copy=False`` (a synchronous save, whose caller waits until the bytes are stored):
        the leaves view the tensors' own memory (GPU tensors are still copied to the host) and
        no buffer is kept -- no copy, and no second copy of the state held between saves."""
        if not self._warned_unwrapped and looks_unwrapped(components):
            self._warned_unwrapped = True
            sample = ", ".join(repr(name) for name in list(components)[:3])
            log.warning(
                "this save has %d components that are single tensors (%s, ...): it looks like "
                "one state dict passed unwrapped, which stores every tensor as its own component "
                "(several times slower to save and load). Pass it as one component instead, "
                "e.g. save(step, {'model': model.state_dict()}). Warned once.",
                len(components),
                sample,
            )
        if not copy:
            self._pool.clear()
            self._leaves.clear()
            return {name: flatten_state(state) for name, state in components.items()}
        self._pool.begin()
        try:
            flats = {
                name: flatten_state(state, tensor_view=self._copy_view(name), copy_arrays=True)
                for name, state in components.items()
            }
        finally:
            for key in self._pool.end():
                self._leaves.pop(key, None)
        return flats

    def _copy_view(self, component: str) -> Any:
        def view(tensor: torch.Tensor, path: str) -> Leaf:
            check_tensor(tensor, path)
            key = f"{component}\x00{path}"
            buffer, fresh = self._pool.copy(key, tensor)
            leaf = self._leaves.get(key)
            if fresh or leaf is None:
                leaf = self._leaves[key] = tensor_leaf(buffer, path)
            return leaf

        return view
