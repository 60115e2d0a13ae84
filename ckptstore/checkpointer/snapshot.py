"""The only part of a save that blocks training: copying state into host buffers.

Buffers are reused when a tensor's path, dtype and shape are unchanged, so steady-state
snapshots copy into memory that is already mapped: page faults on fresh memory cost several
times the copy itself on a typical host. The leaf describing a buffer (its byte view) is kept
with it, so a steady-state snapshot does no per-tensor work beyond the copy. Tensors on a GPU
are copied into pinned host buffers. One save is in flight at a time, so a buffer (and its
leaf) is never reused while its bytes are still being stored.

Between saves the buffers stay resident by default (``keep_buffers=True``): the writer holds
one copy of its CPU state, and every later snapshot is a copy into mapped memory.
``keep_buffers=False`` hands their memory back to the kernel with ``MADV_FREE`` once a save's
bytes are stored: it no longer counts as the process's own (``LazyFree`` in
``/proc/self/smaps_rollup``) and the kernel takes it whenever it needs memory -- on a host whose
page cache fills memory, for any new file data -- and the next snapshot then faults in and
zeroes the state's size of fresh pages (2-3x the time of the copy itself; issue 26 measured an
async save on S3 blocked 2.09x memcpy that way). If the kernel has not taken them, the next
snapshot writes into the same pages without faults. Pinned buffers (GPU tensors) always stay:
they cannot be handed back lazily.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Mapping
from typing import Any

import torch

from ckptstore.serialize.save import FlatState, check_tensor, flatten_state, tensor_leaf
from ckptstore.serialize.tree import Leaf
from ckptstore.serialize.unchanged import DigestMemory

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


#: Host buffers at least this big get a private mapping of their own, which ``release``
#: hands back to the kernel; smaller ones (a small share of any real state) come from the heap.
OWN_MAPPING_BYTES = 64 << 10


class HostBuffers:
    """Host buffers kept between snapshots, one per key, reused while the tensor stored under
    the key keeps its dtype and shape (pinned when the source is on a GPU).

    A snapshot is ``begin()``, ``copy(key, tensor)`` for each tensor, ``end()``: ``end`` forgets
    the buffers of keys that were not copied this time (memory follows the state's size) and
    waits for device-to-host copies. The caller must not reuse a buffer while its bytes are
    still being stored (one save in flight), and calls ``release()`` once they are stored.

    Args:
        keep_buffers: Keep the buffers resident between snapshots (``release`` does nothing);
            by default ``release`` hands their memory back to the kernel lazily (see the
            module docstring).
    """

    def __init__(self, *, keep_buffers: bool = False) -> None:
        self.keep_buffers = keep_buffers
        self._buffers: dict[str, torch.Tensor] = {}
        #: key -> the private mapping its buffer lives in (buffers not pinned, not tiny)
        self._mappings: dict[str, mmap.mmap] = {}
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
            buffer = self._buffers[key] = self._allocate(key, source)
        assert buffer is not None
        buffer.copy_(source.resolve_conj().resolve_neg(), non_blocking=True)
        return buffer, fresh

    def _allocate(self, key: str, source: torch.Tensor) -> torch.Tensor:
        pinned = source.device.type == "cuda"
        nbytes = source.numel() * source.element_size()
        self._mappings.pop(key, None)
        if pinned or nbytes < OWN_MAPPING_BYTES:
            return torch.empty(source.shape, dtype=source.dtype, pin_memory=pinned)
        # Private and anonymous: MADV_FREE applies to nothing else.
        mapping = self._mappings[key] = mmap.mmap(
            -1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        return flat.view(source.dtype).view(source.shape)

    def end(self) -> set[str]:
        """Finish a snapshot; returns the keys whose buffers were forgotten."""
        gone = set(self._buffers) - self._used
        for key in gone:
            del self._buffers[key]
            self._mappings.pop(key, None)
        if self._from_gpu:
            torch.cuda.synchronize()  # the device-to-host copies were asynchronous
        return gone

    def release(self) -> None:
        """The snapshot's bytes are stored: hand the mapped buffers' memory back to the kernel
        (lazily; the buffers stay valid and are reused by the next snapshot), unless
        ``keep_buffers``."""
        if self.keep_buffers:
            return
        for mapping in list(self._mappings.values()):  # clear() may run on another thread
            mapping.madvise(mmap.MADV_FREE)

    def clear(self) -> None:
        """Forget every buffer."""
        self._buffers.clear()
        self._mappings.clear()


class Snapshotter:
    """Copies components into reusable host buffers and flattens them.

    ``keep_buffers``: see :class:`HostBuffers`. Call :meth:`release` once a snapshot's bytes
    are stored. Each flattened component carries its part of the snapshotter's
    :class:`~ckptstore.serialize.unchanged.DigestMemory` (and its tensors' stamps, while the
    memory wants them), so a writer that reuses unchanged tensors' digests can.
    """

    def __init__(self, *, keep_buffers: bool = True) -> None:
        self._pool = HostBuffers(keep_buffers=keep_buffers)
        #: buffer key -> the leaf that views its buffer (rebuilt when the buffer is new)
        self._leaves: dict[str, Leaf] = {}
        self._memory = DigestMemory()
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
            self._forget_buffers()
            return {
                name: flatten_state(state, memory=self._memory.component(name))
                for name, state in components.items()
            }
        self._pool.begin()
        try:
            flats = {
                name: flatten_state(
                    state,
                    tensor_view=self._copy_view(name),
                    copy_arrays=True,
                    memory=self._memory.component(name),
                )
                for name, state in components.items()
            }
        finally:
            for key in self._pool.end():
                self._leaves.pop(key, None)
        return flats

    def release(self) -> None:
        """The last snapshot's bytes are stored: its buffers' memory may go back to the kernel
        (see :meth:`HostBuffers.release`)."""
        self._pool.release()

    def clear(self) -> None:
        """Forget every buffer and what earlier saves remembered (the writer is closing)."""
        self._forget_buffers()
        self._memory.clear()

    def _forget_buffers(self) -> None:
        self._pool.clear()
        self._leaves.clear()

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
