"""Saving one component: flatten, cut into chunks and packs, store the blobs, store the index."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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
from ckptstore.serialize.unchanged import (
    ComponentMemory,
    Remembered,
    TensorStamp,
    fingerprint,
    stamp_of,
)


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
    #: The stamps of its large tensors, by entry path, taken as it was flattened (see
    #: :mod:`ckptstore.serialize.unchanged`); empty unless ``memory`` wanted them.
    stamps: dict[str, TensorStamp] = field(default_factory=dict)
    #: What earlier saves of this component remembered; None: no digest is reused.
    memory: ComponentMemory | None = None


def flatten_state(
    state: Any,
    *,
    tensor_view: Callable[[torch.Tensor, str], Leaf] = tensor_leaf,
    copy_arrays: bool = False,
    memory: ComponentMemory | None = None,
) -> FlatState:
    """Flatten ``state``; unsupported values raise ``SerializationError`` naming their path.

    With ``copy_arrays`` numpy arrays and bytearrays are copied (tensors are handled by
    ``tensor_view``), so the result does not alias the caller's mutable memory. With a
    ``memory`` that wants them, each large tensor's stamp is taken too, so that
    :func:`write_flat` can tell it unchanged since an earlier save.
    """
    stamps: dict[str, TensorStamp] = {}
    view = tensor_view
    if memory is not None and memory.wanted:

        def stamped(tensor: torch.Tensor, path: str) -> Leaf:
            leaf = tensor_view(tensor, path)  # checks the tensor first
            stamp = stamp_of(tensor)
            if stamp is not None:
                stamps[path] = stamp
            return leaf

        view = stamped
    flat = Flattener(view, copy_arrays=copy_arrays)
    try:
        tree = flat.flatten(state)
    except RecursionError:
        raise SerializationError("the state is nested too deeply to checkpoint") from None
    return FlatState(tree, flat.leaves, stamps, memory)


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


def write_flat(
    writer: BlobWriter, flat: FlatState, reused: dict[int, Remembered] | None = None
) -> ComponentResult:
    """Store a flattened state (see :func:`write_component`). ``reused``: the leaves whose
    remembered digests :func:`reusable` allowed, if it was asked for the whole save at once;
    by default this component alone is asked."""
    tree = flat.tree
    plan = _Plan()
    if reused is None:
        (reused,) = reusable(writer, [flat])
    try:
        _submit_all(writer, flat.leaves, plan, reused)
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
    _remember(flat, plan, reused)
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


def reusable(writer: BlobWriter, flats: Sequence[FlatState]) -> list[dict[int, Remembered]]:
    """For each of a save's flattened components, the leaves (by index) whose chunk digests an
    earlier save remembered and that may be reused without hashing: stamp unchanged, every
    chunk a blob the writer knows is stored, and the fingerprint unchanged -- checked for every
    candidate of the save before any is reused (see :mod:`ckptstore.serialize.unchanged`)."""
    found: list[dict[int, Remembered]] = [{} for _ in flats]
    for flat, candidates in zip(flats, found, strict=True):
        memory = flat.memory
        if memory is None:
            continue
        memory.run.wanted = writer.options.reuse_unchanged_digests
        if memory.wanted:
            candidates.update(_candidates(writer, flat, memory))
    for flat, candidates in zip(flats, found, strict=True):
        for i, kept in candidates.items():
            data = flat.leaves[i].data
            if data is None or fingerprint(data) != kept.fingerprint:
                assert flat.memory is not None
                flat.memory.distrust(flat.leaves[i].path)
                return [{} for _ in flats]
    return found


def _candidates(
    writer: BlobWriter, flat: FlatState, memory: ComponentMemory
) -> Iterator[tuple[int, Remembered]]:
    """The leaves whose stamp matches the remembered one and whose chunks are all stored."""
    for i, leaf in enumerate(flat.leaves):
        stamp = flat.stamps.get(leaf.path)
        kept = None if stamp is None else memory.recall(leaf.path, stamp)
        if (
            kept is not None
            and leaf.data is not None
            and leaf.data.nbytes == sum(chunk.logical_bytes for chunk in kept.chunks)
            and all(writer.is_known(chunk.digest) for chunk in kept.chunks)
        ):
            yield i, kept


def _remember(flat: FlatState, plan: _Plan, reused: dict[int, Remembered]) -> None:
    """Record each stamped tensor stored in chunks: its stamp, fingerprint and chunks."""
    memory = flat.memory
    if memory is None:
        return
    entries: dict[str, Remembered] = {}
    for i, leaf in enumerate(flat.leaves):
        stamp = flat.stamps.get(leaf.path) if memory.wanted else None
        if stamp is None or leaf.data is None:
            continue
        if i in reused:
            entries[leaf.path] = reused[i]
            continue
        chunks = [future.result() for future, _, _ in plan.segments[i]]
        if chunks and all(chunk.kind is Kind.CHUNK for chunk in chunks):
            entries[leaf.path] = Remembered(
                stamp,
                fingerprint(leaf.data),
                tuple(_as_stored(chunk) for chunk in chunks),
            )
    memory.entries = entries


def _as_stored(ref: BlobRef) -> BlobRef:
    """``ref`` as a later save that reuses it reports it: already stored, nothing uploaded."""
    return BlobRef(ref.digest, ref.kind, None, ref.logical_bytes, 0, uploaded=False)


def _done(ref: BlobRef) -> Future[BlobRef]:
    future: Future[BlobRef] = Future()
    future.set_result(ref)
    return future


def _submit_all(
    writer: BlobWriter, leaves: list[Leaf], plan: _Plan, reused: dict[int, Remembered]
) -> None:
    """Submit every leaf's blobs: the chunks of the largest tensors first, so that a save does
    not end with one big chunk being hashed, written and written back while the other workers
    idle; then the small leaves, packed in their order (a pack's digest must not depend on the
    other leaves' sizes, or an unchanged pack would be stored again)."""
    plan.segments = [[] for _ in leaves]
    chunked: list[tuple[int, int]] = []
    small: list[int] = []
    for i, leaf in enumerate(leaves):
        size = 0 if leaf.data is None else leaf.data.nbytes
        if not size:
            continue
        if i in reused:
            plan.segments[i] = [(_done(c), 0, c.logical_bytes) for c in reused[i].chunks]
        elif size < writer.options.pack_threshold:
            small.append(i)
        else:
            chunked.append((size, i))
    for _, i in sorted(chunked, key=lambda sized: -sized[0]):
        _submit_chunks(writer, leaves[i], plan.segments[i], plan.futures)
    _submit_packs(writer, leaves, small, plan)


def _submit_chunks(
    writer: BlobWriter,
    leaf: Leaf,
    segments: list[tuple[Future[BlobRef], int, int]],
    futures: list[Future[BlobRef]],
) -> None:
    """One blob per element-aligned chunk of ``leaf``'s bytes."""
    assert leaf.data is not None
    step = max(leaf.itemsize, writer.options.chunk_bytes // leaf.itemsize * leaf.itemsize)
    for start in range(0, leaf.data.nbytes, step):
        piece = leaf.data[start : start + step]
        future = writer.submit(
            piece,
            Kind.CHUNK,
            itemsize=leaf.itemsize,
            float_like=leaf.float_like,
            keepalive=leaf.owner,
        )
        futures.append(future)
        segments.append((future, 0, piece.nbytes))


def _submit_packs(writer: BlobWriter, leaves: list[Leaf], small: list[int], plan: _Plan) -> None:
    """The ``small`` leaves gathered into packs, in their order."""
    options = writer.options
    pack = PackBuilder(options.pack_bytes)
    members: list[int] = []

    def flush() -> None:
        if not pack.items:
            return
        raw, toc = pack.build()
        future = writer.submit(memoryview(raw), Kind.PACK, keepalive=raw)
        plan.futures.append(future)
        for member, item in zip(members, toc, strict=True):
            plan.segments[member] = [(future, item.offset, item.length)]

    for i in small:
        data = leaves[i].data
        assert data is not None
        if not pack.fits(data.nbytes):
            flush()
            pack, members = PackBuilder(options.pack_bytes), []
        pack.add(leaves[i].path, data)
        members.append(i)
    flush()
