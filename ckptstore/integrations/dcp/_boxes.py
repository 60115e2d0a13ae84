"""The boxes a DCP load reads: each checked against the stored entry that holds it, and written
into the planner's tensors -- device tensors through pinned staging buffers.

:class:`BoxWrites` holds the writes of one rank's ``read_data``. Atomic (the reader's default),
nothing is written before every blob of the plan has verified: a box bound for device memory is
copied to device scratch as it verifies, where the device has room for all of them (the scratch
then copied to the targets at the end), else its bytes wait in host memory and go through the
staging buffers at the end, on every thread of the load at once. Not atomic, each device box is
sent as it verifies, by the thread that verified it, while it goes on with the next. Plain
values and boxes bound for host memory are written as they always were: on the caller's thread
at the end (atomic), or at once. ``planner.commit_tensor`` sees a device box only once the
copies into it have completed.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ckptstore.errors import IntegrityError
from ckptstore.extending import Entry, Staging, torch_dtype


class BoxWrites:
    """The writes of one rank's load into the planner's state (see the module docstring):
    :meth:`target` for each box on the caller's thread, :meth:`prepare`, then :meth:`value` /
    :meth:`box` from any thread as items verify, and :meth:`finish` once all have."""

    def __init__(self, planner: LoadPlanner, *, atomic: bool) -> None:
        self.planner, self.atomic = planner, atomic
        self.staging = Staging()
        self._targets: list[tuple[ReadItem, torch.Tensor]] = []
        self._scratch: dict[int, torch.Tensor] = {}
        #: Writes on the caller's thread at the end (atomic): plain values, host boxes.
        self._writes: list[Callable[[], None]] = []
        #: Copies into device targets that wait for every blob (atomic), run on every thread.
        self._uploads: list[Callable[[], None]] = []
        #: Device boxes to hand to the planner once the copies into them have completed.
        self._commits: list[tuple[ReadItem, torch.Tensor]] = []

    def target(self, item: ReadItem) -> int:
        """Resolve ``item``'s target with the planner (on the caller's thread: its device's
        current stream is the one the copies wait on); its number for :meth:`box`."""
        self._targets.append((item, self.planner.resolve_tensor(item).detach()))
        return len(self._targets) - 1

    def shape(self, number: int) -> tuple[int, ...]:
        """The shape of box ``number``'s target."""
        return tuple(self._targets[number][1].shape)

    def prepare(self, threads: int) -> None:
        """Size the staging for ``threads`` sending the largest device box; atomic, take device
        scratch for the device boxes where the device has room for all of them."""
        staged = {k: t for k, (_, t) in enumerate(self._targets) if self.staging.takes(t)}
        if not staged:
            return
        sizes = {k: t.numel() * t.element_size() for k, t in staged.items()}
        devices = dict.fromkeys(t.device for t in staged.values())
        self.staging.prepare(devices, max(sizes.values()), threads)
        if self.atomic:
            wanted = {k: (t.device, sizes[k]) for k, t in staged.items()}
            made = self.staging.scratch(wanted)
            self._scratch = {
                k: s.view(staged[k].dtype).view(staged[k].shape) for k, s in made.items()
            }

    def value(self, item: ReadItem, text: bytes) -> None:
        """Hand a plain value's JSON text to the planner (at the end, when atomic)."""
        self._write(functools.partial(self.planner.load_bytes, item, io.BytesIO(text)))

    def box(self, number: int, source: torch.Tensor | None) -> None:
        """Box ``number``'s verified bytes (``source``, host memory; None for an empty box):
        copied into its target now or once every box has verified (see the module
        docstring)."""
        item, target = self._targets[number]
        if source is None or not self.staging.takes(target):
            self._write(functools.partial(_write_box, self.planner, item, target, source))
            return
        self._commits.append((item, target))
        scratch = self._scratch.get(number)
        if scratch is not None:
            for piece in self.staging.pieces(scratch, source):
                self.staging.put(*piece)
            self._uploads.append(functools.partial(self.staging.copy, target, scratch))
        elif self.atomic:
            # The bytes stay in host memory (``source`` holds them) until every blob verified.
            pieces = self.staging.pieces(target, source)
            self._uploads += [functools.partial(self.staging.put, *p) for p in pieces]
        else:
            for piece in self.staging.pieces(target, source):
                self.staging.put(*piece)

    def upload(self, pool: Executor) -> None:
        """Every box has verified: run the copies that waited for it, on ``pool``'s threads
        (the first error raised; the copies not started then do not run), once the copies
        into scratch (on every thread's stream) have completed."""
        self.staging.synchronize()
        run_all(pool, self._uploads)

    def close(self) -> None:
        """Wait for every copy into device memory (also when the load failed)."""
        self.staging.synchronize()
        self._scratch.clear()
        self._uploads.clear()  # (they hold the scratch too)

    def finish(self) -> None:
        """After :meth:`close`: the writes that waited, and the device boxes to the planner."""
        for write in self._writes:
            write()
        for item, target in self._commits:
            self.planner.commit_tensor(item, target)

    def _write(self, write: Callable[[], None]) -> None:
        if self.atomic:
            self._writes.append(write)
        else:
            write()


def run_all(pool: Executor, jobs: Iterable[Callable[[], None]]) -> None:
    """Run ``jobs`` on ``pool`` and wait for them: the first error (in order) is raised, and
    the jobs not started by then do not run (``Executor.map`` cancels them)."""
    for _ in pool.map(_call, jobs):
        pass


def _call(job: Callable[[], None]) -> None:
    job()


def _write_box(
    planner: LoadPlanner, item: ReadItem, target: torch.Tensor, source: torch.Tensor | None
) -> None:
    """Copy one verified box into its target and hand it to the planner."""
    if source is not None:
        target.copy_(source)
    planner.commit_tensor(item, target)


def stored_text(entry: Entry, item: ReadItem, where: str) -> bytes:
    """A plain value's JSON text, as the planner's ``load_bytes`` takes it."""
    if item.type != LoadItemType.BYTE_IO or not isinstance(entry.value, str):
        raise IntegrityError(
            f"{where}: {item.storage_index.fqn!r} was saved as a plain value and is read as a "
            "tensor (or the other way round)"
        )
    return entry.value.encode("utf-8")


def check_box(entry: Entry, item: ReadItem, where: str) -> tuple[int, int]:
    """The byte span of the stored tensor that holds the box ``item`` reads, checked."""
    if item.type != LoadItemType.TENSOR or entry.kind != "tensor":
        raise IntegrityError(
            f"{where}: {item.storage_index.fqn!r} is read as a tensor but was not stored as one"
        )
    offsets, lengths, shape = tuple(item.storage_offsets), tuple(item.lengths), entry.shape
    if len(offsets) != len(shape) or len(lengths) != len(shape):
        raise IntegrityError(
            f"{where}: a {len(offsets)}-d box cannot be read from a {shape} tensor"
        )
    if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape, strict=True)):
        raise IntegrityError(f"{where}: the box {offsets}+{lengths} lies outside {shape}")
    if any(n == 0 for n in lengths):
        return 0, 0
    itemsize = torch_dtype(entry.dtype, where).itemsize
    strides = contiguous_strides(shape)
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True))
    return first * itemsize, (last + 1) * itemsize


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def box_source(
    span: Any, dtype: torch.dtype, lengths: tuple[int, ...], shape: tuple[int, ...]
) -> torch.Tensor:
    """The box of ``lengths`` that starts at byte 0 of ``span`` (bytes of a tensor of
    ``shape`` and ``dtype``), as a strided view of them."""
    flat = torch.frombuffer(span, dtype=torch.uint8)
    return torch.as_strided(flat.view(dtype), lengths, contiguous_strides(shape))
