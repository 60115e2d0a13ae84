"""Knowing that a tensor is unchanged since the last save without hashing it again (opt-in:
``WriterOptions(reuse_unchanged_digests=True)``).

PyTorch counts the writes to a tensor's memory: every in-place op through the tensor or any
view of it (``add_``, ``copy_``, ``index_put_``, the ``foreach`` steps of ``torch.optim``,
``load_state_dict``) bumps its version counter, ``tensor._version``. A tensor whose storage
(the same storage object, still alive), place in it, shape, strides, dtype and version are what
they were when a save hashed it holds the same bytes, *provided every write went through such
an op*; its chunks' digests then are still its digests, and the save takes them instead of
hashing the bytes again (an incremental save of a state that is mostly frozen hashes only what
changed). A digest is reused only while the manifest says its blob is live; anything else is
hashed and stored as usual, so a checkpoint never references a blob that is not stored, and
every stored blob still holds the bytes its digest names.

**The limits: writes the counter misses.** Then the saved tensor is the previous save's bytes:

- writes through ``tensor.data`` (``p.data.add_(...)``: ``.data`` has a counter of its own);
- PyTorch's fused optimizers: ``torch.optim.AdamW(fused=True)``, ``Adam(fused=True)`` and
  ``SGD(fused=True)`` update parameters and moments without bumping their counters (seen with
  torch 2.13 on CPU);
- numpy arrays sharing the tensor's memory (``tensor.numpy()``, ``torch.from_numpy``), writes to
  an ``UntypedStorage``, C/CUDA extensions writing through ``data_ptr()``, another process
  writing shared memory.

A guard catches the common case of such a writer: each remembered tensor keeps a fingerprint,
the BLAKE3 of :data:`WINDOWS` windows of :data:`WINDOW` bytes spread over it, and a save checks
the fingerprint of *every* tensor it would reuse before it reuses any. If one differs, something
writes the state behind the counters' back: that save hashes every byte, a warning names the
tensor, and the run stops reusing digests. A fused optimizer step changes every element, so it
is caught at the first save after it. A missed write that changes no window (a few rows of an
embedding written through ``.data``) is not caught. Leave the option off when the state
may be written that way.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.cas.blobs import BlobRef
from ckptstore.cas.digest import StreamingDigest

log = logging.getLogger("ckptstore.serialize")

#: The fingerprint: this many windows of this many bytes, spread evenly over the tensor.
WINDOWS = 16
WINDOW = 4096
#: Tensors smaller than this are not stamped: they go into packs, which are hashed anyway.
STAMP_MIN_BYTES = 64 << 10


class TensorStamp:
    """What identifies a tensor's bytes as unchanged, read without touching them: its storage
    (held weakly: a freed storage never matches), its place, layout and version counter."""

    __slots__ = ("_key", "_storage")

    def __init__(self, storage: Any, key: tuple[Any, ...]) -> None:
        self._storage = weakref.ref(storage)
        self._key = key

    def matches(self, other: TensorStamp) -> bool:
        """The same live storage object, place, layout and version."""
        storage = self._storage()
        return storage is not None and storage is other._storage() and self._key == other._key


def stamp_of(tensor: torch.Tensor) -> TensorStamp | None:
    """``tensor``'s stamp; None if it is small or keeps no version counter (inference
    tensors)."""
    if tensor.numel() * tensor.element_size() < STAMP_MIN_BYTES:
        return None
    try:
        version = tensor._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None
    storage = tensor.untyped_storage()
    key = (
        version,
        storage.data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.device,
        tensor.is_conj(),
        tensor.is_neg(),
    )
    return TensorStamp(storage, key)


def fingerprint(data: memoryview) -> str:
    """The BLAKE3 of :data:`WINDOWS` windows of ``data`` (all of it when small)."""
    hasher = StreamingDigest()
    n = data.nbytes
    if n <= WINDOWS * WINDOW:
        hasher.update(data)
        return hasher.result()
    step = (n - WINDOW) // (WINDOWS - 1)
    for i in range(WINDOWS):
        hasher.update(data[i * step : i * step + WINDOW])
    return hasher.result()


@dataclass(frozen=True, slots=True)
class Remembered:
    """A tensor as a save stored it: its stamp then, its fingerprint, its chunks' blobs."""

    stamp: TensorStamp
    fingerprint: str
    chunks: tuple[BlobRef, ...]


class ComponentMemory:
    """What the previous saves of one component remembered, by entry path (one save in flight:
    used by that save's thread only)."""

    def __init__(self, run: DigestMemory, name: str) -> None:
        self.run = run
        self.name = name
        self.entries: dict[str, Remembered] = {}

    @property
    def wanted(self) -> bool:
        """Whether a snapshot should stamp this component's tensors."""
        return self.run.wanted and self.run.trusted

    def recall(self, path: str, stamp: TensorStamp) -> Remembered | None:
        """The remembered tensor at ``path`` if ``stamp`` matches its stamp then."""
        kept = self.entries.get(path)
        return kept if kept is not None and stamp.matches(kept.stamp) else None

    def distrust(self, path: str) -> None:
        """A tensor at ``path`` changed although its stamp did not: stop reusing digests."""
        self.run.trusted = False
        log.warning(
            "component %r, tensor %r changed although its version counter did not: something "
            "writes this state without PyTorch counting it (tensor.data, a fused optimizer, "
            "numpy, an extension). This save hashes every byte, and this run no longer reuses "
            "digests; turn WriterOptions.reuse_unchanged_digests off for this state",
            self.name,
            path,
        )


class DigestMemory:
    """Per run (or shard writer): each component's :class:`ComponentMemory`."""

    def __init__(self) -> None:
        #: Whether the writer reuses digests; until a save says otherwise, stamps are taken
        #: (a few microseconds per large tensor) so that the first save can be remembered.
        self.wanted = True
        #: False once a tensor changed behind its counter (see :meth:`ComponentMemory.distrust`).
        self.trusted = True
        self._components: dict[str, ComponentMemory] = {}

    def component(self, name: str) -> ComponentMemory:
        """The memory of component ``name``."""
        memory = self._components.get(name)
        if memory is None:
            memory = self._components[name] = ComponentMemory(self, name)
        return memory

    def clear(self) -> None:
        """Forget everything (the writer is closing)."""
        self._components.clear()
