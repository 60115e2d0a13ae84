"""Read once, share: the blobs that several ranks of one DCP load need are read from the
object store by one of them and sent to the others over the process group.

Data-parallel replicas load the same stored boxes; without this every rank reads its own copy
of each, so the store serves every replicated byte once per replica. DCP hands the
coordinator every rank's load plan (``prepare_global_plan``): there :func:`schedule` finds
each blob wanted by two ranks or more and gives it an owner -- the wanting rank with the
fewest bytes to read so far, largest blobs first -- and every rank's plan carries the same
:class:`Schedule`. In ``read_data`` each rank walks it in order (:func:`exchange`): an owner
reads the stored object (as stored: compressed, not yet verified) and sends it to each rank
that wants it; the others receive it. Every rank then decodes and verifies what it holds
exactly as if it had read it from the store, so a damaged blob fails on every rank that
wanted it, naming it, and the load falls back as one.

The transport is point-to-point ``isend``/``irecv`` of CPU tensors, so the group needs a
backend that sends CPU tensors (gloo; ``"cpu:gloo,cuda:nccl"`` groups qualify). Each message
is a header (status, length) and then the bytes; an owner that cannot read a blob still sends
the header, with the error's text, so no receiver waits for bytes that will not come.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ckptstore.errors import IntegrityError
from ckptstore.extending import ObjectStore, blob_key

_OK, _FAILED = 0, 1


@dataclass(frozen=True, slots=True)
class Shared:
    """One blob read once: its digest, the group rank that reads it, the ranks it is sent to."""

    digest: str
    owner: int
    receivers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Schedule:
    """Every shared blob of one load, in the order every rank walks them."""

    blobs: tuple[Shared, ...] = ()

    def involving(self, rank: int) -> list[Shared]:
        """The blobs ``rank`` reads for others or receives, in order."""
        return [s for s in self.blobs if s.owner == rank or rank in s.receivers]

    def counts(self, rank: int) -> tuple[int, int]:
        """(blobs ``rank`` sends, counting each receiver; blobs it receives)."""
        mine = self.involving(rank)
        return (
            sum(len(s.receivers) for s in mine if s.owner == rank),
            sum(1 for s in mine if s.owner != rank),
        )


def schedule(wanted: Sequence[Mapping[str, int]]) -> Schedule:
    """The schedule for ranks whose wanted blobs are ``wanted[rank]`` (digest -> bytes, the
    raw bytes of the blob the rank's boxes touch). A blob one rank wants is not shared."""
    ranks: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for rank, blobs in enumerate(wanted):
        for digest, nbytes in blobs.items():
            ranks.setdefault(digest, []).append(rank)
            size[digest] = max(size.get(digest, 0), nbytes)
    shared = sorted((d for d, r in ranks.items() if len(r) > 1), key=lambda d: (-size[d], d))
    load = [0] * len(wanted)
    owners: dict[str, int] = {}
    for digest in shared:
        owner = min(ranks[digest], key=lambda r: (load[r], r))
        owners[digest] = owner
        load[owner] += size[digest]
    return Schedule(
        tuple(
            Shared(d, owners[d], tuple(r for r in ranks[d] if r != owners[d]))
            for d in sorted(shared)
        )
    )


def can_share(group: dist.ProcessGroup | None) -> bool:
    """Whether ranks of ``group`` can send each other CPU tensors (a gloo backend)."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return False
    return "gloo" in backend


def exchange(
    store: ObjectStore,
    plan: Schedule,
    group: dist.ProcessGroup | None,
    *,
    context: str,
    max_workers: int = 8,
) -> dict[str, memoryview]:
    """Walk ``plan`` as this rank of ``group``: read the blobs it owns (``max_workers`` at a
    time, ahead of sending), send each to its receivers, receive the ones it wants from their
    owners. Returns digest -> the stored object's bytes (unverified: decode them as if read
    from ``store``) for every blob this rank owns or receives. An owner that fails to read a
    blob raises that error once every receiver has been told; a receiver told of a failure
    raises ``IntegrityError`` naming the blob and the owner."""
    rank = dist.get_rank(group)
    mine = plan.involving(rank)
    if not mine:
        return {}
    held: dict[str, memoryview] = {}
    sends: list[dist.Work | None] = []
    keep: list[torch.Tensor] = []  # the tensors being sent stay alive until sent
    first_error: BaseException | None = None
    owned = [s for s in mine if s.owner == rank]
    with ThreadPoolExecutor(max(1, max_workers), thread_name_prefix="ckpt-share") as pool:
        reads: dict[str, Future[memoryview]] = {
            s.digest: pool.submit(store.get_view, blob_key(s.digest)) for s in owned
        }
        for shared in mine:
            peer = dist.get_global_rank(group, shared.owner) if group is not None else shared.owner
            if shared.owner != rank:
                # A failure is raised at the end: the walk goes on, so that no owner of a
                # later blob waits forever for this rank to take it.
                try:
                    held[shared.digest] = _receive(peer, group, shared, context)
                except IntegrityError as exc:
                    first_error = first_error or exc
                continue
            try:
                data = reads.pop(shared.digest).result()
                status, payload = _OK, data
            except Exception as exc:
                first_error = first_error or exc
                status, payload = _FAILED, memoryview(str(exc).encode("utf-8", "replace"))
            header = torch.tensor([status, payload.nbytes], dtype=torch.int64)
            body = _as_tensor(payload)
            keep += [header, body]
            for receiver in shared.receivers:
                to = dist.get_global_rank(group, receiver) if group is not None else receiver
                sends.append(dist.isend(header, dst=to, group=group))
                if body.numel():
                    sends.append(dist.isend(body, dst=to, group=group))
            if status == _OK:
                held[shared.digest] = payload
        for work in sends:
            if work is not None:
                work.wait()
    if first_error is not None:
        raise first_error
    return held


def _receive(
    peer: int, group: dist.ProcessGroup | None, shared: Shared, context: str
) -> memoryview:
    """One blob's header and bytes from its owner (global rank ``peer``)."""
    header = torch.empty(2, dtype=torch.int64)
    dist.recv(header, src=peer, group=group)
    status, nbytes = (int(v) for v in header.tolist())
    body = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        dist.recv(body, src=peer, group=group)
    data = body.numpy().data
    if status != _OK:
        why = bytes(data).decode("utf-8", "replace")
        raise IntegrityError(
            f"{context}: blob {shared.digest}, which rank {shared.owner} reads for this load, "
            f"could not be read there: {why}"
        )
    return data


def _as_tensor(data: memoryview) -> torch.Tensor:
    """``data`` as a flat uint8 tensor without a copy (a read-only view is only sent)."""
    if data.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given buffer is not writable"
        return torch.frombuffer(data, dtype=torch.uint8)


def wanted_bytes(pieces: Iterable[tuple[str, int]]) -> dict[str, int]:
    """digest -> the most bytes of it any piece reaches, from (digest, end) pairs."""
    found: dict[str, int] = {}
    for digest, end in pieces:
        found[digest] = max(found.get(digest, 0), end)
    return found
