"""How fast a local file system makes written bytes durable, as this process's flushes found.

A local store's ``write_bandwidth_hint`` decides whether compressing a blob saves wall time
(:func:`ckptstore.cas.codec.min_gain`): a fixed guess is right for one disk and wrong for the
next. Measured here: the same 1 GiB of bf16 weights, written and fsynced, took 0.6 s on one
VM's disk (1.8 GB/s) and 2.4 s on another's (0.4 GB/s), where writing a third fewer bytes
(the float codec's 1.5x) is worth far more than the CPU it costs.

So every flush of a :class:`~ckptstore.objectstore.LocalStore` that made enough new bytes
durable is a measurement, kept per file system (its device number) for the whole process, so
the stores a job opens later on the same disk start from it:

- the disk was busy most of the time since the batch's first write began (``BEHIND``): the
  store writes one file at a time, and the seconds its writes took (a write blocks once the
  kernel holds as much unwritten data as it allows) plus the flush's fsyncs are the disk's
  busy time. The disk, not the writer, set the pace, and its rate is the batch's bytes over
  that time (the writer starts each file's writeback as it finishes it);
- it was not: the disk kept up and its rate is at least that much, so the estimate only
  rises (a writer slowed by its own CPU -- e.g. by compressing -- never makes the disk look
  slower than it is).

Nothing is written to measure: the samples are the saves themselves. The first large save of a
process goes by the default (:data:`DEFAULT_RATE`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

#: The rate assumed before a flush has measured one (a fast local SSD).
DEFAULT_RATE = 1.5e9
#: A flush measures only when it made at least this many new bytes durable: smaller batches
#: are dominated by fsync latency, not throughput.
MIN_BYTES = 64 << 20
#: The share of a batch's time the disk was busy (writes, then fsyncs) above which the disk was
#: the bottleneck.
BEHIND = 0.5
#: The weight of a new measurement against the estimate so far (disks vary from run to run).
WEIGHT = 0.5

_rates: dict[int, float] = {}
_lock = threading.Lock()


def rate(device: int, default: float = DEFAULT_RATE) -> float:
    """The durable write rate of file system ``device`` in bytes/s, as measured so far
    (``default`` if it has not been)."""
    with _lock:
        return _rates.get(device, default)


def forget() -> None:
    """Drop every measurement (tests that check the default's decisions start from it)."""
    with _lock:
        _rates.clear()


@dataclass
class Batch:
    """The bytes written since a store's last flush, and when the first of those writes began."""

    nbytes: int = 0
    started: float | None = None
    #: Seconds the writes took (one at a time: the disk's busy time before the flush).
    writing: float = 0.0

    def wrote(self, nbytes: int, began: float, seconds: float = 0.0) -> None:
        """One object of ``nbytes`` written in ``seconds``, begun at ``began``
        (``time.monotonic``); the caller holds the store's lock."""
        self.nbytes += nbytes
        self.writing += seconds
        if self.started is None or began < self.started:
            self.started = began


def record(
    device: int,
    batch: Batch,
    sync_began: float,
    ended: float | None = None,
    default: float = DEFAULT_RATE,
) -> float:
    """Fold a flush of ``batch`` (its fsyncs ran from ``sync_began`` until ``ended``, default
    now) into the estimate for ``device``; returns the estimate (``default`` if there is
    none yet)."""
    ended = time.monotonic() if ended is None else ended
    with _lock:
        known = _rates.get(device)
        if batch.started is None or batch.nbytes < MIN_BYTES:
            return default if known is None else known
        elapsed = max(ended - batch.started, 1e-6)
        seen = batch.nbytes / elapsed
        if batch.writing + (ended - sync_began) >= BEHIND * elapsed:
            estimate = seen if known is None else WEIGHT * seen + (1 - WEIGHT) * known
        else:
            estimate = max(default if known is None else known, seen)
        _rates[device] = estimate
        return estimate
