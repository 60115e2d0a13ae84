"""Fetching the blobs that hold a component's entries and turning them into values.

Only the blobs the requested entries reference are fetched; each is verified against its
digest on the way in, on a thread pool. From a store that reads in pieces (a local directory),
a raw blob is read straight into the buffers of the entries it holds and hashed piece by piece
as it arrives: one pass, no intermediate copy; meanwhile the store reads the next blobs ahead
of the workers (:mod:`ckptstore.serialize.readahead`), so the disk never waits on a hash.
Otherwise blobs are fetched whole and copied into their destinations as they arrive, so at
most ``max_workers`` decoded blobs are held besides the results; a tensor that is exactly one
raw blob then becomes a view of the fetched buffer (no copy).

Targets in device memory (``into`` CUDA tensors) are filled through the load's staging
(:mod:`ckptstore.serialize.staging`): each thread reads a blob's share for the device into a
pinned buffer, verifies it, and copies it to the device on a side stream while it goes on
with the next blob. Not atomic, a dense target takes the bytes itself; atomic (or a target
that is not dense), they go to device scratch, copied into the targets once every blob has
verified -- or, where the device lacks room for the scratch, they are held in host memory and
sent through the staging buffers at the end, by every thread of the load at once.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from ckptstore.cas.blobs import get_blob, read_into
from ckptstore.cas.digest import blob_key
from ckptstore.cas.header import Kind
from ckptstore.errors import ConfigError, IntegrityError, UnreadableError
from ckptstore.objectstore.base import ObjectStore, uninitialized
from ckptstore.serialize.disjoint import cannot_hold, check_disjoint
from ckptstore.serialize.dtypes import numpy_dtype, torch_dtype
from ckptstore.serialize.index import ComponentIndex, Entry
from ckptstore.serialize.readahead import Prefetching, ReadAhead
from ckptstore.serialize.staging import Outgoing, Staging, run_all


def max_blob_len(targets: Iterable[tuple[str, int, int]]) -> int:
    """The most raw bytes a data blob can hold, given the (path, offset, length) of every
    index entry that points into it: its items, plus a pack's table of contents (JSON of the
    items' names and offsets) and trailer."""
    end, toc = 0, 64 << 10
    for path, offset, length in targets:
        end = max(end, offset + length)
        toc += 6 * len(path.encode()) + 96
    return end + toc


def with_context(context: str, detail: str) -> str:
    """``detail`` after the caller's ``context`` (run, step, component), if there is one."""
    return f"{context}, {detail}" if context else detail


@dataclass(slots=True)
class _Target:
    """Where one segment's bytes go: ``buffer[dest:dest+length]`` from ``offset`` in the blob."""

    entry: int
    offset: int
    length: int
    dest: int


class _Assembler:
    """Collects entry buffers while blobs arrive. An entry with a target tensor (``into``) is
    read into a buffer of the load's own and copied into the tensor once every blob of the
    load has verified (``atomic``: all or nothing); or, not ``atomic``, straight into the
    tensor as its blob arrives when the tensor's memory allows (a contiguous CPU tensor:
    ``in_place``), the others copied into at the end. Device targets go through the load's
    staging (``staged``, set by :meth:`prepare`)."""

    def __init__(
        self, entries: list[Entry], targets: dict[int, torch.Tensor], *, atomic: bool = True
    ) -> None:
        self.entries = entries
        self.buffers: list[Any] = [None] * len(entries)
        self.targets = targets
        self.atomic = atomic
        #: The entries whose target tensor's own memory the blobs are read into.
        self.in_place: set[int] = set()
        #: Entries filled through the staging -> the device bytes their blobs are copied into
        #: as they verify (the target's own, or its scratch copy); None: held in host memory.
        self.staged: dict[int, torch.Tensor | None] = {}
        #: The staged entries whose device bytes are scratch, copied to the target at the end.
        self.scratched: set[int] = set()
        self._lock = threading.Lock()

    def prepare(self, staging: Staging) -> dict[int, tuple[torch.device, int]]:
        """Decide where each target's bytes go (on the caller's thread, before any read);
        the entries that would rather go through device scratch: entry -> (device, bytes)."""
        wanted = {}
        for n, target in self.targets.items():
            if staging.takes(target):
                direct = not self.atomic and _dense(target)
                self.staged[n] = _flat_bytes(target) if direct else None
                if not direct:
                    wanted[n] = (target.device, self.entries[n].nbytes)
            elif not self.atomic and _direct(target):
                self.in_place.add(n)
                self.buffers[n] = _bytes_of(target)
        return wanted

    def take_scratch(self, n: int, scratch: torch.Tensor) -> None:
        """Entry ``n``'s blobs go to ``scratch`` (device memory), copied to it at the end."""
        self.staged[n] = scratch
        self.scratched.add(n)

    def staged_bytes(self, targets: list[_Target]) -> int:
        """Bytes of a blob bound for device memory (its staged targets')."""
        return sum(t.length for t in targets if t.entry in self.staged)

    def outgoing(self, staging: Staging, targets: list[_Target]) -> Outgoing:
        """A blob's bytes bound for device memory: target number -> its device bytes."""
        parts = {}
        for i, t in enumerate(targets):
            device = self.staged.get(t.entry)
            if device is not None and t.length:
                parts[i] = device[t.dest : t.dest + t.length]
        return Outgoing(staging, parts)

    def destination(self, t: _Target, where: str) -> memoryview:
        """The slice of its entry's buffer that ``t``'s bytes go to (allocated on first use)."""
        with self._lock:
            if self.buffers[t.entry] is None:
                self.buffers[t.entry] = _allocate(self.entries[t.entry].nbytes, where)
        return self.buffers[t.entry][t.dest : t.dest + t.length]  # type: ignore[no-any-return]

    def place(self, raw: memoryview, targets: list[_Target], out: Outgoing, where: str) -> None:
        """Copy (or hand over) one verified blob's bytes to every entry segment it holds, or
        to ``out`` for the device.

        Called from several threads at once; segments of one entry never overlap, so only
        the allocation of an entry's buffer needs the lock.
        """
        for t in targets:
            if t.offset + t.length > raw.nbytes:
                path = self.entries[t.entry].path
                raise IntegrityError(f"{where}: entry {path!r} points past the end of the blob")
        handed_over = False
        for i, t in enumerate(targets):
            entry = self.entries[t.entry]
            source = raw[t.offset : t.offset + t.length]
            if i in out.at:
                out.view(i)[:] = source
                continue
            whole = t.offset == 0 and t.length == raw.nbytes == entry.nbytes
            mine = t.entry not in self.in_place  # a caller's memory is filled, never replaced
            if whole and mine and not raw.readonly and not handed_over:
                # The blob's buffer becomes the tensor's memory: no copy. Only once, so two
                # equal tensors never share memory.
                self.buffers[t.entry] = raw
                handed_over = True
                continue
            self.destination(t, where)[:] = source

    def uploads(self, staging: Staging, where: str) -> list[Callable[[], None]]:
        """The copies into staged targets that wait for the whole load: each scratch copy to
        its target, and the host-held entries in pieces through the staging buffers."""
        jobs: list[Callable[[], None]] = []
        for n, held in self.staged.items():
            target = self.targets[n].detach()
            if n in self.scratched:
                assert held is not None
                jobs.append(partial(staging.copy, target, _typed(held, target)))
            elif held is None:
                source = _materialize(self.entries[n], self.buffers[n], where)
                jobs += [partial(staging.put, *p) for p in staging.pieces(target, source)]
        return jobs

    def release(self) -> None:
        """Drop the scratch copies (the load's copies have all completed)."""
        for n in self.scratched:
            self.staged[n] = None


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory holds its elements in order, byte for byte."""
    return (
        tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.numel() > 0
    )


def _direct(tensor: torch.Tensor) -> bool:
    """Whether a load can write ``tensor``'s memory byte for byte: a dense CPU tensor."""
    return tensor.device.type == "cpu" and _dense(tensor)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as a uint8 tensor of one dimension (a view)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def _typed(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Bytes ``flat`` (uint8) seen as a dense tensor of ``like``'s dtype and shape."""
    return flat.view(like.dtype).view(like.shape)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """``tensor``'s memory as writable bytes (no copy; autograd is not involved)."""
    return _flat_bytes(tensor).numpy().data


def _targets(
    chosen: list[Entry], into: Mapping[str, torch.Tensor] | None, where: str
) -> dict[int, torch.Tensor]:
    """The position (in ``chosen``) of each tensor entry ``into`` has a tensor for, checked:
    a dtype or shape that differs from the stored one is refused before anything is read."""
    if not into:
        return {}
    found: dict[int, torch.Tensor] = {}
    for n, entry in enumerate(chosen):
        target = into.get(entry.path)
        if target is None or entry.kind != "tensor":
            continue
        dtype = torch_dtype(entry.dtype, where)
        if target.dtype != dtype or tuple(target.shape) != tuple(entry.shape):
            raise ConfigError(
                f"{where}: cannot load entry {entry.path!r} into the given tensor: stored "
                f"{entry.dtype} {list(entry.shape)}, given "
                f"{str(target.dtype).removeprefix('torch.')} {list(target.shape)}; pass a "
                "tensor of the stored dtype and shape (or leave it out of into= to get a new one)"
            )
        unfit = cannot_hold(target)
        if unfit:
            raise ConfigError(
                f"{where}: cannot load entry {entry.path!r} into the given tensor: {unfit}; "
                "pass a tensor that owns its elements (e.g. .clone()), or leave it out of into="
            )
        found[n] = target
    return found


def _allocate(nbytes: int, where: str) -> memoryview:
    """An uninitialized buffer (every byte is written before use; zero-filling would only
    cost a second pass over the memory). The index asking for it has verified, so failing to
    get it is this process's limit, not damage."""
    try:
        return uninitialized(nbytes)
    except (MemoryError, ValueError) as exc:
        why = str(exc) or "out of memory"
        raise UnreadableError(
            f"{where}: cannot allocate {nbytes} bytes for an entry here ({why}); free memory, "
            "or load fewer entries at once"
        ) from None


def _materialize(entry: Entry, buffer: memoryview | None, where: str) -> Any:
    if not entry.is_array:
        if entry.kind == "dtype":
            return torch_dtype(entry.value, where)
        if entry.kind == "float":
            return struct.unpack("<d", bytes.fromhex(entry.value))[0]
        return entry.value
    data = buffer if buffer is not None else _allocate(entry.nbytes, where)
    if entry.kind == "bytes":
        return bytes(data)
    if entry.kind == "bytearray":
        return bytearray(data)
    if entry.kind == "tensor":
        dtype = torch_dtype(entry.dtype, where)
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        flat = torch.frombuffer(data, dtype=torch.uint8)
        return flat.view(dtype).reshape(entry.shape)
    array = np.frombuffer(data, dtype=numpy_dtype(entry.dtype, where)).reshape(entry.shape)
    return array[()] if entry.kind == "npscalar" else array


def _blob_bounds(index: ComponentIndex, digests: Iterable[str]) -> dict[str, int]:
    """The most raw bytes each of ``digests`` can hold, from every entry of the index that
    points into it: a pack holds all of its items, not only the ones a partial load asks for
    (a bound from those alone would call a healthy pack damaged)."""
    wanted = set(digests)
    targets: dict[str, list[tuple[str, int, int]]] = {d: [] for d in wanted}
    for entry in index.entries:
        for seg in entry.segments:
            if seg.digest in wanted:
                targets[seg.digest].append((entry.path, seg.offset, seg.length))
    return {digest: max_blob_len(found) for digest, found in targets.items()}


class EntryLoad:
    """The planned load of some entries of one component: which blobs hold them, where each
    blob's bytes go (``into``'s tensors or new buffers), and their values once every blob is
    in. Plan several (one per component) and :func:`fetch_all` runs them as one load.

    ``into`` maps entry paths to existing tensors of the stored dtype and shape (see
    :func:`load_entries`); one that does not match is a ``ConfigError`` here, before anything
    is read. ``atomic`` (the default): they are written only once every blob of the load has
    verified; else as each blob arrives (see :func:`load_entries`)."""

    def __init__(
        self,
        store: ObjectStore,
        index: ComponentIndex,
        entries: Iterable[int],
        *,
        context: str = "",
        into: Mapping[str, torch.Tensor] | None = None,
        atomic: bool = True,
    ) -> None:
        self.store, self.context = store, context
        self.wanted = sorted(set(entries))
        self.chosen = [index.entries[i] for i in self.wanted]
        self.where = f"component {context}" if context else "component"
        targets = _targets(self.chosen, into, self.where)
        self.assembler = _Assembler(self.chosen, targets, atomic=atomic)
        self.by_blob: dict[str, list[_Target]] = {}
        for n, entry in enumerate(self.chosen):
            dest = 0
            for seg in entry.segments:
                self.by_blob.setdefault(seg.digest, []).append(
                    _Target(n, seg.offset, seg.length, dest)
                )
                dest += seg.length
        self.bounds = _blob_bounds(index, self.by_blob)

    def fetch(self, digest: str, staging: Staging) -> None:
        """Read and verify one blob of the plan into its entries' buffers, or into staging
        buffers and on to the device (any thread)."""
        targets = self.by_blob[digest]
        paths = ", ".join(sorted({self.chosen[t.entry].path for t in targets})[:3])
        blob_context = with_context(self.context, f"entry {paths}")
        bound = self.bounds[digest]
        with self.assembler.outgoing(staging, targets) as out:

            def destination(i: int) -> memoryview:
                if i in out.at:
                    return out.view(i)
                return self.assembler.destination(targets[i], blob_context)

            header = read_into(
                self.store,
                digest,
                [(t.offset, t.length) for t in targets],
                destination,
                context=blob_context,
                max_raw_len=bound,
            )
            if header is None:
                header, raw = get_blob(self.store, digest, context=blob_context, max_raw_len=bound)
                self.assembler.place(raw, targets, out, blob_context)
            if header.kind is Kind.INDEX:
                raise IntegrityError(f"blob {digest} ({blob_context}) is an index, not data")
            out.send()

    def results(self) -> dict[int, Any]:
        """Position (in the index) -> value, once :func:`fetch_all` has fetched every blob."""
        return {
            i: _result(self.assembler, n, entry, self.where)
            for n, (i, entry) in enumerate(zip(self.wanted, self.chosen, strict=True))
        }


def fetch_all(
    store: ObjectStore,
    loads: Sequence[EntryLoad],
    *,
    max_workers: int = 0,
    staging: Staging | None = None,
) -> None:
    """Fetch every blob of ``loads`` on one pool of ``max_workers`` threads (default: the
    store's read concurrency), the store reading ahead of the workers over all of them in
    order: the components of a checkpoint load as one stream, with no pause between one
    component's last blobs and the next one's first (a pool per component left a thread idle
    while its last blob finished and the disk idle until the next read-ahead began). The
    first error, in the order of the blobs, is raised once every started fetch has ended;
    the blobs not started by then are not read.

    Device targets go through ``staging`` (default: a new :class:`Staging`): see the module
    docstring. Every copy it made has completed when this returns or raises."""
    # Targets of different entries (of any component) that share memory: refused before
    # anything is read, as each target's own checks are when its load is planned.
    check_disjoint(
        (load.where, load.chosen[n].path, target)
        for load in loads
        for n, target in load.assembler.targets.items()
    )
    jobs = [(load, digest, blob_key(digest)) for load in loads for digest in load.by_blob]
    workers = max_workers or store.read_concurrency
    staging = staging or Staging()
    _plan_staging(loads, staging, workers)
    # The store reads the next blobs while the workers verify theirs (see readahead); a blob
    # two components share is read ahead once.
    ahead = (
        ReadAhead(store, list(dict.fromkeys(key for _, _, key in jobs)))
        if isinstance(store, Prefetching) and jobs
        else None
    )

    def take(load: EntryLoad, digest: str, key: str) -> None:
        if ahead is not None:
            ahead.taken(key)
        load.fetch(digest, staging)

    try:
        with (
            ahead or contextlib.nullcontext(),
            ThreadPoolExecutor(workers, thread_name_prefix="ckpt-load") as pool,
        ):
            run_all(pool, [partial(take, *job) for job in jobs])
            # Every blob has verified: the copies that waited for that, on every thread, once
            # the copies into scratch (on every thread's stream) have completed.
            staging.synchronize()
            run_all(pool, [j for ld in loads for j in ld.assembler.uploads(staging, ld.where)])
    finally:
        staging.synchronize()
        for load in loads:
            load.assembler.release()


def _plan_staging(loads: Sequence[EntryLoad], staging: Staging, threads: int) -> None:
    """Where the device targets of ``loads`` take their bytes (on the caller's thread): the
    staging sized for the largest piece it sends, and device scratch for the targets that
    cannot be written as blobs arrive, where the device has room for all of them."""
    wanted = {
        (i, n): want
        for i, load in enumerate(loads)
        for n, want in load.assembler.prepare(staging).items()
    }
    staged = [(load, n) for load in loads for n in load.assembler.staged]
    if not staged:
        return
    shares = [load.assembler.staged_bytes(ts) for load in loads for ts in load.by_blob.values()]
    largest = max(shares + [load.chosen[n].nbytes for load, n in staged])
    devices = dict.fromkeys(load.assembler.targets[n].device for load, n in staged)
    staging.prepare(devices, largest, threads)
    for (i, n), scratch in staging.scratch(wanted).items():
        loads[i].assembler.take_scratch(n, scratch)


def load_entries(
    store: ObjectStore,
    index: ComponentIndex,
    entries: Iterable[int],
    *,
    context: str = "",
    max_workers: int = 0,
    into: Mapping[str, torch.Tensor] | None = None,
    atomic: bool = True,
) -> dict[int, Any]:
    """Load the given entries (by position in ``index.entries``); returns position -> value.

    ``into`` maps entry paths to existing tensors of the stored dtype and shape: those entries
    are loaded into them and their values are those same tensors. ``atomic`` (the default):
    each is copied into once every blob has verified, so if this raises none was touched (the
    load holds the bytes meanwhile: memory for the entries, as without ``into`` -- for device
    tensors, device scratch of their size where the device has that much free besides a
    margin, else host memory). Not ``atomic``: a dense CPU or device tensor is written as its
    blobs arrive (no memory besides it and the staging buffers), any other copied into at
    the end; if this raises, such tensors may hold unverified bytes. Device tensors also take
    two pinned staging buffers per thread of at most 64 MiB each (see ``staging``)."""
    load = EntryLoad(store, index, entries, context=context, into=into, atomic=atomic)
    fetch_all(store, [load], max_workers=max_workers)
    return load.results()


def _result(assembler: _Assembler, n: int, entry: Entry, where: str) -> Any:
    """Entry ``n``'s value: its target tensor (filled) if it has one, else a new value."""
    target = assembler.targets.get(n)
    if target is None:
        return _materialize(entry, assembler.buffers[n], where)
    if n not in assembler.in_place and n not in assembler.staged:
        with torch.no_grad():
            target.copy_(_materialize(entry, assembler.buffers[n], where))
    return target
