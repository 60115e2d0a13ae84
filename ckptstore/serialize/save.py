"""Saving one component: flatten, cut into chunks and packs, store the blobs, store the index."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptstore.cas.blobs import BlobRef, keep_ref
from ckptstore.cas.header import Kind
from ckptstore.cas.pack import PackBuilder
from ckptstore.cas.writer import BlobWriter
from ckptstore.errors import SerializationError
from ckptstore.serialize.dtypes import byte_view, dense, is_float_like, torch_dtype_name
from ckptstore.serialize.index import ComponentIndex, Entry, Segment
from ckptstore.serialize.tree import Flattener, Leaf


@dataclass(frozen=True, slots=True)
class ComponentResult:
    """What storing a component produced; small and picklable (a worker's receipt)."""

    index_digest: str
    entries: int
    logical_bytes: int
    #: Every distinct blob the component references, the index blob included.
    blobs: tuple[BlobRef, ...]

    @property
    def stored_bytes(self) -> int:
        """Bytes the component's distinct blobs occupy in the store, headers included."""
        return sum(b.stored_bytes for b in self.blobs)

    @property
    def uploaded_bytes(self) -> int:
        """Bytes this save uploaded (blobs that were not yet stored)."""
        return sum(b.stored_bytes for b in self.blobs if b.uploaded)


def check_tensor(tensor: torch.Tensor, path: str) -> str:
    """The dtype name of ``tensor`` if it can be checkpointed, else ``SerializationError``."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
        raise SerializationError(
            f"{path}: tensors of type {type(tensor).__qualname__} are not plain tensors; "
            "convert them first (DTensor: use the torch.distributed.checkpoint integration)"
        )
    if tensor.layout != torch.strided or tensor.is_nested:
        raise SerializationError(f"{path}: {tensor.layout} tensors are not supported; densify")
    if tensor.device.type == "meta":
        raise SerializationError(f"{path}: a meta tensor has no data to checkpoint")
    return torch_dtype_name(tensor.dtype, path)


def tensor_leaf(tensor: torch.Tensor, path: str) -> Leaf:
    """A leaf with a zero-copy byte view of ``tensor`` (after a copy only if it must move).

    GPU tensors are copied to host memory, non-contiguous views are made contiguous; shape and
    dtype are kept exactly.
    """
    name = check_tensor(tensor, path)
    host = tensor.detach()
    if host.device.type != "cpu":
        host = host.cpu()
    host = dense(host.resolve_conj().resolve_neg())
    data = memoryview(byte_view(host).numpy().data) if host.numel() else None
    return Leaf(
        path,
        "tensor",
        name,
        tuple(host.shape),
        data or memoryview(b""),
        itemsize=host.element_size(),
        float_like=is_float_like(host.dtype),
        owner=host,
    )


@dataclass(slots=True)
class _Plan:
    """Futures of the blobs each array entry's segments will point at."""

    segments: list[list[tuple[Future[BlobRef], int, int]]] = field(default_factory=list)
    futures: list[Future[BlobRef]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FlatState:
    """A state flattened into its structure tree and leaves (views of the data to store)."""

    tree: Any
    leaves: list[Leaf]


def flatten_state(
    state: Any,
    *,
    tensor_view: Callable[[torch.Tensor, str], Leaf] = tensor_leaf,
    copy_arrays: bool = False,
) -> FlatState:
    """Flatten ``state``; unsupported values raise ``SerializationError`` naming their path.

    With ``copy_arrays`` numpy arrays and bytearrays are copied (tensors are handled by
    ``tensor_view``), so the result does not alias the caller's mutable memory.
    """
    flat = Flattener(tensor_view, copy_arrays=copy_arrays)
    try:
        tree = flat.flatten(state)
    except RecursionError:
        raise SerializationError("the state is nested too deeply to checkpoint") from None
    return FlatState(tree, flat.leaves)


def write_component(
    writer: BlobWriter,
    state: Any,
    *,
    tensor_view: Callable[[torch.Tensor, str], Leaf] = tensor_leaf,
) -> ComponentResult:
    """Store ``state`` through ``writer``; returns once every blob and the index are stored.

    The caller must not mutate ``state``'s tensors until this returns (the checkpointer takes
    a snapshot first).
    """
    return write_flat(writer, flatten_state(state, tensor_view=tensor_view))


def write_flat(writer: BlobWriter, flat: FlatState) -> ComponentResult:
    """Store a flattened state (see :func:`write_component`)."""
    tree = flat.tree
    plan = _Plan()
    try:
        _submit_all(writer, flat.leaves, plan)
    finally:
        # Tasks hold views of the caller's memory: never return while one is running.
        wait(plan.futures)
    refs: dict[str, BlobRef] = {}
    entries = []
    for leaf, segs in zip(flat.leaves, plan.segments, strict=True):
        resolved = []
        for future, offset, length in segs:
            ref = future.result()
            keep_ref(refs, ref)
            resolved.append(Segment(ref.digest, offset, length))
        entries.append(_entry(leaf, tuple(resolved)))
    index = ComponentIndex(tree=tree, entries=tuple(entries))
    encoded = memoryview(index.encode())
    index_ref = writer.submit(encoded, Kind.INDEX, keepalive=encoded).result()
    refs.setdefault(index_ref.digest, index_ref)
    return ComponentResult(
        index_digest=index_ref.digest,
        entries=len(entries),
        logical_bytes=index.logical_bytes,
        blobs=tuple(refs.values()),
    )


def _entry(leaf: Leaf, segments: tuple[Segment, ...]) -> Entry:
    if leaf.data is None:
        return Entry(leaf.path, leaf.kind, value=leaf.value)
    return Entry(leaf.path, leaf.kind, leaf.dtype, leaf.shape, leaf.data.nbytes, segments)


def _submit_all(writer: BlobWriter, leaves: list[Leaf], plan: _Plan) -> None:
    options = writer.options
    pack = PackBuilder(options.pack_bytes)
    pack_members: list[int] = []

    def flush() -> None:
        nonlocal pack, pack_members
        if not pack.items:
            return
        raw, toc = pack.build()
        future = writer.submit(memoryview(raw), Kind.PACK, keepalive=raw)
        plan.futures.append(future)
        for member, item in zip(pack_members, toc, strict=True):
            plan.segments[member] = [(future, item.offset, item.length)]
        pack, pack_members = PackBuilder(options.pack_bytes), []

    for i, leaf in enumerate(leaves):
        plan.segments.append([])
        data = leaf.data
        if data is None or data.nbytes == 0:
            continue
        if data.nbytes < options.pack_threshold:
            if not pack.fits(data.nbytes):
                flush()
            pack.add(leaf.path, data)
            pack_members.append(i)
            continue
        step = max(leaf.itemsize, options.chunk_bytes // leaf.itemsize * leaf.itemsize)
        for start in range(0, data.nbytes, step):
            piece = data[start : start + step]
            future = writer.submit(
                piece,
                Kind.CHUNK,
                itemsize=leaf.itemsize,
                float_like=leaf.float_like,
                keepalive=leaf.owner,
            )
            plan.futures.append(future)
            plan.segments[i].append((future, 0, piece.nbytes))
    flush()
