"""Host-to-device copies of a load: a bounded pool of reused pinned staging buffers, a side
stream per thread, and the events that say when a staging buffer may be filled again.

A load into device (CUDA) tensors reads and verifies every blob in host memory (the hash runs
on the CPU, on the load's threads). Copied to the device only once everything is read, the
load takes read + hash *plus* the host-to-device copy. Here each thread copies what it has
verified while it goes on with the next blob, so the load takes the slowest of the three.

Every copy into device memory made here follows the same rules:

- it runs on a side stream of the copying thread (one per thread and device), issued with
  ``non_blocking=True`` from pinned memory: the DMA engine moves it while the thread reads;
- the side stream first waits on the stream that was current on the caller's thread for that
  device when the load began (the caller may have queued kernels that still use the memory);
- a staging buffer goes back to the pool as soon as its copies are issued, and is filled again
  (by any thread) only after the events recorded behind those copies have completed;
- :meth:`Staging.synchronize` waits for every side stream before the load returns or raises:
  the caller may then use the tensors on any stream, and no copy reads a buffer that is freed;
  and before a scratch copy is copied to its target (other threads' streams wrote it).

Memory: two pinned buffers per thread of the load (one fills while the other drains), each the
size of the largest piece the load sends (a blob's share bound for the device) and at most
``Policy.cap`` (64 MiB, the default chunk size), and at most ``Policy.pinned_bytes`` (1 GiB)
in all -- a thread that finds none free waits for one. A piece larger than a buffer goes
through a pageable buffer of its own, copied synchronously. The buffers come from torch's
caching host allocator: freed when the load ends, they are kept by torch and handed to the
next load without pinning memory again (``torch._C._host_emptyCache()`` gives them back).

Device scratch (:meth:`Staging.scratch`) is what an atomic load copies into while it reads, so
that no caller tensor is written before the whole load has verified: device memory for the
bytes of its device targets, taken only where the device has that much free besides a margin.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

#: Staging buffers per thread: one is filled while the copies from the other run.
PER_THREAD = 2
#: What an atomic load leaves free on a device besides its scratch copies (the larger of this
#: and a tenth of the device): room for the caller's next steps and for fragmentation.
SCRATCH_MARGIN = 1 << 30

K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class Policy:
    """Which targets a load fills through staging buffers, and with how much memory."""

    #: Device types whose target tensors are filled through the staging buffers.
    device_types: frozenset[str] = frozenset({"cuda"})
    #: The most bytes one staging buffer holds; a larger piece goes through a pageable buffer.
    cap: int = 64 << 20
    #: The most bytes all staging buffers of a load hold (at least two buffers are made).
    pinned_bytes: int = 1 << 30
    #: Device bytes an atomic load may take for scratch copies; None: what the device has free
    #: less a margin (only a CUDA device can say; others get none).
    scratch_bytes: int | None = None


#: The policy of every load. Tests replace it to run the staging on CPU tensors (a CPU target
#: is otherwise written directly), since the pipeline's bookkeeping is the same on any device.
POLICY = Policy()


@dataclass(slots=True)
class Slot:
    """A staging buffer handed to one thread: fill :attr:`view`, then :meth:`Staging.send`
    (or :meth:`Staging.release` it unsent)."""

    #: The buffer (uint8, one dimension); :attr:`view` is the same memory.
    tensor: torch.Tensor
    view: memoryview
    #: Its place in the pool; None: a pageable buffer of its own (or one given back).
    index: int | None = None


class Staging:
    """The host-to-device copies of one load (see the module docstring): make it and call
    :meth:`prepare` on the caller's thread, copy from any thread, :meth:`synchronize` at the
    end."""

    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or POLICY
        #: Bytes of each staging buffer, and how many the pool may hold (see :meth:`prepare`).
        self.size, self.limit = 1, PER_THREAD
        #: The stream current on the caller's thread for each CUDA device, when it prepared.
        self._callers: dict[torch.device, Any] = {}
        #: Each thread's side stream per device.
        self._streams: dict[tuple[int, torch.device], Any] = {}
        self._buffers: dict[int, torch.Tensor] = {}
        #: Per buffer: the events recorded behind its last copies (it is free once they complete).
        self._events: dict[int, list[Any]] = {}
        self._free: deque[int] = deque()
        self._numbers = itertools.count()
        self._cond = threading.Condition()
        #: Staging buffers made, and pieces too large for one (sent from a pageable buffer).
        self.buffers_made = self.oversized = 0

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether a target is filled through the staging buffers (a device tensor)."""
        return tensor.device.type in self.policy.device_types and tensor.numel() > 0

    def prepare(self, devices: Iterable[torch.device], largest: int, threads: int) -> None:
        """On the caller's thread, before any copy: note its current stream on each device the
        targets live on, and size the pool for ``threads`` copying pieces of at most
        ``largest`` bytes (within the policy's caps)."""
        self.size = max(1, min(largest, self.policy.cap))
        fit = self.policy.pinned_bytes // self.size
        self.limit = max(PER_THREAD, min(PER_THREAD * threads, fit))
        for device in devices:
            if device.type == "cuda" and device not in self._callers:
                self._callers[device] = torch.cuda.current_stream(device)

    def scratch(self, wanted: Mapping[K, tuple[torch.device, int]]) -> dict[K, torch.Tensor]:
        """Device scratch (uint8) for each of ``wanted`` (key -> device, bytes), on each device
        with room for all of its share (see :class:`Policy`); none on the others. On the
        caller's thread: the scratch belongs to its stream, and every use of it elsewhere has
        ended when :meth:`synchronize` returns."""
        totals: dict[torch.device, int] = {}
        for device, nbytes in wanted.values():
            totals[device] = totals.get(device, 0) + nbytes
        made: dict[K, torch.Tensor] = {}
        for device, total in totals.items():
            if total > self._room(device):
                continue
            mine = [(key, nbytes) for key, (d, nbytes) in wanted.items() if d == device]
            try:
                made |= {k: torch.empty(n, dtype=torch.uint8, device=device) for k, n in mine}
            except torch.OutOfMemoryError:
                continue  # freed memory was not free after all: this device's targets go by host
        return made

    def _room(self, device: torch.device) -> int:
        if self.policy.scratch_bytes is not None:
            return self.policy.scratch_bytes
        if device.type != "cuda":
            return 0
        free, total = torch.cuda.mem_get_info(device)
        return free - max(SCRATCH_MARGIN, total // 10)

    @property
    def pinned(self) -> bool:
        """Whether the staging buffers are pinned (some target is on a CUDA device)."""
        return bool(self._callers)

    def buffer(self, nbytes: int) -> Slot:
        """A buffer of at least ``nbytes`` for the calling thread to fill: a staging buffer of
        the pool whose copies have completed, else a new one while the pool may grow, else
        the one given back longest ago once its copies complete (waiting for one to come back
        when all are out); above :attr:`size`, a pageable one of its own."""
        if nbytes > self.size:
            with self._cond:
                self.oversized += 1
            tensor = torch.empty(nbytes, dtype=torch.uint8)
            return Slot(tensor, _writable(tensor))
        with self._cond:
            while not self._free and self.buffers_made >= self.limit:
                self._cond.wait()
            done = [i for i in self._free if all(e.query() for e in self._events[i])]
            if done or self.buffers_made >= self.limit:
                index = done[0] if done else self._free[0]
                self._free.remove(index)
            else:
                index = next(self._numbers)
                self.buffers_made += 1
                self._events[index] = []
        if index not in self._buffers:
            self._buffers[index] = self._new_buffer(index)
        for event in self._events[index]:
            event.synchronize()
        self._events[index] = []
        return Slot(self._buffers[index], _writable(self._buffers[index]), index)

    def _new_buffer(self, index: int) -> torch.Tensor:
        """Staging buffer ``index`` (pinned outside the lock: other threads need not wait)."""
        try:
            return torch.empty(self.size, dtype=torch.uint8, pin_memory=self.pinned)
        except BaseException:
            with self._cond:  # the pool did not grow by this one: a waiting thread may go on
                self.buffers_made -= 1
                del self._events[index]
                self._cond.notify()
            raise

    def release(self, slot: Slot) -> None:
        """Give ``slot`` back to the pool (its copies recorded, or none made); once only."""
        if slot.index is not None:
            with self._cond:
                self._free.append(slot.index)
                self._cond.notify()
            slot.index = None

    def send(self, slot: Slot, parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (target, source) of ``parts`` -- a source being a view of ``slot`` -- on
        this thread's side stream, and give ``slot`` back: it is filled again only once these
        copies are done (from a pageable slot, they are done when this returns)."""
        pinned = slot.index is not None
        try:
            for device in dict.fromkeys(target.device for target, _ in parts):
                with self._side(device) as stream:
                    for target, source in parts:
                        if target.device == device:
                            target.copy_(source, non_blocking=pinned)
                    if stream is not None and slot.index is not None:
                        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                        event.record(stream)  # waited on without spinning a core (blocking)
                        self._events[slot.index].append(event)
        finally:
            self.release(slot)

    def put(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy host tensor ``source`` into ``target`` (same shape and dtype, any layout)
        through a staging buffer: gathered into it on this thread, then sent; above
        :attr:`size` (see :meth:`pieces`), straight from ``source``, synchronously."""
        nbytes = source.numel() * source.element_size()
        if nbytes > self.size:
            with self._cond:
                self.oversized += 1
            self.copy(target, source)
            return
        slot = self.buffer(nbytes)
        try:
            staged = slot.tensor[:nbytes].view(source.dtype).view(source.shape)
            staged.copy_(source)
        except BaseException:
            self.release(slot)
            raise
        self.send(slot, [(target, staged)])

    def pieces(
        self, target: torch.Tensor, source: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(target, source)`` cut into pieces of one staging buffer each (see
        :func:`pieces`), for :meth:`put`."""
        return pieces(target, source, self.size)

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source)`` on this thread's side stream, after the caller's stream:
        from device memory (a scratch copy), or from host memory synchronously."""
        with self._side(target.device):
            target.copy_(source)

    def synchronize(self) -> None:
        """Wait for every copy issued through this staging so far (each side stream
        synchronized): before a copy that reads what other threads' copies wrote (a scratch
        copy to its target), and before the load returns."""
        with self._cond:
            streams = list(self._streams.values())
        for stream in streams:
            stream.synchronize()

    @contextmanager
    def _side(self, device: torch.device) -> Iterator[Any]:
        """This thread's side stream on ``device`` made current, after the caller's stream
        (None and nothing to wait for on a device without streams)."""
        if device.type != "cuda":
            yield None
            return
        key = (threading.get_ident(), device)
        stream = self._streams.get(key)
        if stream is None:
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            with self._cond:
                self._streams[key] = stream
        stream.wait_stream(self._callers[device])
        with torch.cuda.stream(stream):
            yield stream


class Outgoing:
    """One blob's bytes bound for device memory: each of ``parts`` (key -> the device bytes,
    uint8, it goes to) gets a slice of one staging buffer, taken when one is first asked for
    (:meth:`view`) and filled by the caller; :meth:`send` copies them once the blob verified.
    Use it as a context manager: a buffer taken and not sent goes back to the pool."""

    def __init__(self, staging: Staging, parts: Mapping[int, torch.Tensor]) -> None:
        self.staging = staging
        #: Key -> (where its bytes sit in the staging buffer, the device bytes they go to).
        self.at: dict[int, tuple[int, torch.Tensor]] = {}
        self.size = 0
        for key, device in parts.items():
            self.at[key] = (self.size, device)
            self.size += device.numel()
        self.slot: Slot | None = None

    def __enter__(self) -> Outgoing:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.slot is not None:
            self.staging.release(self.slot)

    def view(self, key: int) -> memoryview:
        """The staging slice part ``key``'s bytes go to."""
        if self.slot is None:
            self.slot = self.staging.buffer(self.size)
        at, device = self.at[key]
        return self.slot.view[at : at + device.numel()]

    def send(self) -> None:
        """Copy every part filled to its device bytes (none was: nothing to send)."""
        if self.slot is not None:
            held = self.slot.tensor
            copies = [(device, held[at : at + device.numel()]) for at, device in self.at.values()]
            self.staging.send(self.slot, copies)


def pieces(
    target: torch.Tensor, source: torch.Tensor, limit: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(target, source)`` cut into matching boxes of at most ``limit`` bytes where the shape
    allows (along the first dimension, then within a row): pieces that several threads can
    stage at once, each through one staging buffer."""
    nbytes = source.numel() * source.element_size()
    if nbytes <= limit or source.dim() == 0:
        return [(target, source)]
    row = nbytes // source.shape[0]
    if row > limit:
        return [p for i in range(source.shape[0]) for p in pieces(target[i], source[i], limit)]
    step = limit // row
    return [(target[a : a + step], source[a : a + step]) for a in range(0, source.shape[0], step)]


def run_all(pool: Executor, jobs: Iterable[Callable[[], None]]) -> None:
    """Run ``jobs`` on ``pool`` and wait for them; after the first error (raised) the jobs
    not started yet do not run."""
    futures = [pool.submit(job) for job in jobs]
    try:
        for future in futures:
            future.result()
    except BaseException:
        for future in futures:
            future.cancel()
        raise


def _writable(tensor: torch.Tensor) -> memoryview:
    """A uint8 tensor's memory as writable bytes."""
    return tensor.numpy().data
