"""A local store measures its disk's durable write rate from its own flushes, and
``compression="auto"`` weighs the gain of compressing against that rate, not a fixed guess."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptstore.cas.codec import RAW
from ckptstore.cas.header import Kind
from ckptstore.cas.writer import BlobWriter, WriterOptions
from ckptstore.objectstore import LocalStore, _diskrate
from ckptstore.serialize import write_component

MiB = 1 << 20


def batch(nbytes: int, started: float) -> _diskrate.Batch:
    b = _diskrate.Batch()
    b.wrote(nbytes, started)
    return b


def test_a_flush_that_waited_on_the_disk_measures_it() -> None:
    # 400 MiB written from t=0, the fsyncs ran from t=0.5 to t=1.0: the disk set the pace.
    rate = _diskrate.record(7, batch(400 * MiB, 0.0), sync_began=0.5, ended=1.0)
    assert rate == pytest.approx(400 * MiB)
    assert _diskrate.rate(7) == pytest.approx(400 * MiB)
    assert _diskrate.rate(8) == _diskrate.DEFAULT_RATE  # another file system: not measured
    # A second measurement is averaged in: disks vary from one batch to the next.
    _diskrate.record(7, batch(200 * MiB, 10.0), sync_began=10.5, ended=11.0)
    assert _diskrate.rate(7) == pytest.approx(300 * MiB)


def test_a_flush_that_found_the_disk_caught_up_only_raises_the_estimate() -> None:
    _diskrate.record(7, batch(400 * MiB, 0.0), sync_began=0.5, ended=1.0)
    # A writer slowed by its own CPU (compressing): 100 MiB/s, fsync nearly instant. The disk
    # is at least that fast; it is not slower than measured before.
    _diskrate.record(7, batch(100 * MiB, 0.0), sync_began=0.99, ended=1.0)
    assert _diskrate.rate(7) == pytest.approx(400 * MiB)
    # One that kept 3 GB/s going without waiting: the disk can do that much.
    _diskrate.record(7, batch(3000 * MiB, 0.0), sync_began=0.99, ended=1.0)
    assert _diskrate.rate(7) == pytest.approx(3000 * MiB)


def test_writes_that_blocked_on_the_disk_count_as_its_busy_time() -> None:
    # The kernel throttles a writer once it holds enough unwritten data: the writes (one at a
    # time) took 0.7 s of the second, the fsync little. The disk set the pace all the same.
    b = _diskrate.Batch()
    b.wrote(200 * MiB, 0.0, seconds=0.4)
    b.wrote(200 * MiB, 0.4, seconds=0.3)
    assert _diskrate.record(7, b, sync_began=0.95, ended=1.0) == pytest.approx(400 * MiB)


def test_small_batches_measure_nothing() -> None:
    # Latency, not throughput: a few MiB fsynced say nothing about the disk's rate.
    rate = _diskrate.record(7, batch(_diskrate.MIN_BYTES - 1, 0.0), sync_began=0.1, ended=1.0)
    assert rate == _diskrate.DEFAULT_RATE
    assert _diskrate.rate(7) == _diskrate.DEFAULT_RATE
    assert _diskrate.record(7, _diskrate.Batch(), sync_began=0.0) == _diskrate.DEFAULT_RATE


def test_a_local_store_measures_its_disk_and_later_stores_start_from_it(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "a")
    assert store.write_bandwidth_hint == _diskrate.DEFAULT_RATE
    payload = bytes(range(256)) * (4 * 1024)  # 1 MiB
    for i in range(_diskrate.MIN_BYTES // MiB + 8):
        store.put(f"k/{i}", payload)
    store.flush()
    measured = store.write_bandwidth_hint
    device = (tmp_path / "a").stat().st_dev
    # Whichever way this disk went, the flush recorded it for the file system...
    assert _diskrate.rate(device) == measured
    # ...and a store opened later on the same disk starts from it.
    assert LocalStore(tmp_path / "b").write_bandwidth_hint == measured
    # A flush with nothing new measures nothing more.
    store.flush()
    assert _diskrate.rate(device) == measured


def test_a_store_without_fsync_measures_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "a", fsync=False)
    payload = bytes(MiB)
    for i in range(_diskrate.MIN_BYTES // MiB + 8):
        store.put(f"k/{i}", payload)
    store.flush()
    assert _diskrate.rate((tmp_path / "a").stat().st_dev) == _diskrate.DEFAULT_RATE


def bf16_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": (torch.randn(1024, 1024, generator=g) * 0.02).bfloat16() for i in range(8)}


def test_auto_compression_follows_the_measured_disk(tmp_path: Path) -> None:
    """bf16 weights shrink by about a third: not worth the CPU on the default fast disk, worth
    it on a disk measured at 300 MB/s (writing a third fewer bytes saves more than it costs).
    One writer (a run keeps its writer for every save) follows the disk from one save to the
    next."""
    store = LocalStore(tmp_path / "store")
    chunks = lambda result: [b for b in result.blobs if b.kind is Kind.CHUNK]  # noqa: E731
    with BlobWriter(store, WriterOptions(compression="auto")) as writer:
        first = chunks(write_component(writer, bf16_weights(0)))
        store.flush()
        assert first
        assert {b.codec for b in first} == {RAW.name}
        # The disk, as a flush measured it: 300 MB/s, the fsyncs waited on.
        device = (tmp_path / "store").stat().st_dev
        _diskrate.record(device, batch(300 * MiB, 0.0), sync_began=0.5, ended=1.0)
        store.put("x", bytes(1))
        store.flush()  # the store reads the rate at its flushes
        assert store.write_bandwidth_hint == pytest.approx(300 * MiB)
        second = chunks(write_component(writer, bf16_weights(1)))
    assert second
    assert all(b.codec not in (None, RAW.name) for b in second)
    assert sum(b.stored_bytes for b in second) < 0.8 * sum(b.logical_bytes for b in second)
