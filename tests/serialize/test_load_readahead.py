"""Read-ahead during a load (``ckptstore.serialize.readahead``, issue 26): the store is asked
for the blobs the workers take next, in their order, never more than a window ahead of the
blobs they have taken; the load's values and its verification are unchanged by it."""

from __future__ import annotations

import os
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
from component_helpers import RecordingStore, save

from ckptstore.cas import blob_key
from ckptstore.errors import IntegrityError
from ckptstore.objectstore import LocalStore
from ckptstore.objectstore.base import ObjectReader
from ckptstore.serialize import ComponentReader
from ckptstore.serialize.compare import first_difference
from ckptstore.serialize.readahead import Prefetching, ReadAhead

MiB = 1 << 20


class FakeStore:
    """A :class:`Prefetching` store that records what it is asked to read ahead."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.asked: list[str] = []
        self._lock = threading.Lock()

    def prefetch(self, key: str) -> int:
        with self._lock:
            self.asked.append(key)
        return self.size


def settled(store: FakeStore, count: int) -> list[str]:
    """``store.asked`` once it holds ``count`` keys and has stopped growing for a while."""
    deadline = time.monotonic() + 10
    while len(store.asked) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.1)  # a read-ahead past its window would ask again by now
    return list(store.asked)


def test_keys_are_read_ahead_in_order_within_the_window() -> None:
    store = FakeStore(size=10)
    keys = [f"k{i}" for i in range(8)]
    # 25 bytes: asking for a fourth 10-byte key would put 40 ahead of the workers
    with ReadAhead(store, keys, window=25) as ahead:
        assert settled(store, 3) == keys[:3]
        ahead.taken("k0")  # 20 bytes ahead: one more key fits
        assert settled(store, 4) == keys[:4]
        for key in keys[1:4]:
            ahead.taken(key)
        assert settled(store, 7) == keys[:7]


def test_keys_the_workers_took_first_are_asked_for_but_not_counted_ahead() -> None:
    store = FakeStore(size=10)
    keys = [f"k{i}" for i in range(6)]
    ahead = ReadAhead(store, keys, window=15)
    ahead.taken("k0")  # workers got there before the read-ahead started: the rest of those
    ahead.taken("k1")  # blobs still streams ahead of them, but is not ahead of the workers
    with ahead:
        assert settled(store, 4) == keys[:4]


def test_close_stops_a_read_ahead_waiting_on_its_window() -> None:
    store = FakeStore(size=100)
    with ReadAhead(store, [f"k{i}" for i in range(100)], window=1) as ahead:
        assert settled(store, 1) == ["k0"]
        started = time.monotonic()
    assert time.monotonic() - started < 5
    assert not ahead._thread.is_alive()
    assert store.asked == ["k0"]


def test_a_local_store_reads_a_file_ahead_into_the_page_cache(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    assert isinstance(store, Prefetching)
    data = os.urandom(4 * MiB)
    store.put("cas/ab/obj", data)
    path = tmp_path / "cas" / "ab" / "obj"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: really dropped
        assert store.prefetch("cas/ab/obj") == len(data)
        # RWF_NOWAIT refuses to wait for the disk: it succeeds once the pages are cached.
        view = memoryview(bytearray(len(data)))
        deadline = time.monotonic() + 10
        while True:
            try:
                got = os.preadv(fd, [view], 0, os.RWF_NOWAIT)
            except BlockingIOError:
                got = 0
            if got == len(data) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert got == len(data)
        assert bytes(view) == data
    finally:
        os.close(fd)
    assert store.prefetch("cas/ab/missing") == 0  # advice only: a missing object is no error


class PrefetchSpy(RecordingStore):
    """A real local store that records the keys it is asked to read ahead, and whose reads
    in pieces start slowly (a cold disk), so the read-ahead gets ahead of the workers."""

    def open_reader(self, key: str) -> AbstractContextManager[ObjectReader]:
        time.sleep(0.02)
        return super().open_reader(key)


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(5 * MiB // 4, generator=g),  # five 1 MiB chunks
        "layers": [torch.randn(256, 257, generator=g) for _ in range(6)],
        "small": {f"b{i}": torch.randn(16, generator=g) for i in range(4)},  # one pack
    }


def test_a_load_reads_every_data_blob_ahead_and_fills_the_tensors(tmp_path: Path) -> None:
    store = PrefetchSpy(tmp_path / "store")
    original = state()
    result = save(store, original, chunk_bytes=MiB)
    reader = ComponentReader(store, result.index_digest)
    into = {
        "big": torch.empty(5 * MiB // 4),
        "layers": [torch.empty(256, 257) for _ in range(6)],
        "small": {f"b{i}": torch.empty(16) for i in range(4)},
    }
    loaded = reader.load(into=into, max_workers=2)  # fewer workers than blobs
    assert first_difference(original, loaded) is None
    assert loaded["big"] is into["big"]
    # Every blob was asked for ahead of its read, once.
    assert sorted(store.prefetched) == sorted(blob_key(d) for d in reader.digests)


def test_a_damaged_blob_read_ahead_is_still_found(tmp_path: Path) -> None:
    store = PrefetchSpy(tmp_path / "store")
    result = save(store, state(), chunk_bytes=MiB)
    reader = ComponentReader(store, result.index_digest)
    digest = reader.entry("layers/3").segments[0].digest
    path = store.root / blob_key(digest)
    damaged = bytearray(path.read_bytes())
    damaged[-100] ^= 0x01  # one bit of the payload
    path.write_bytes(bytes(damaged))
    with pytest.raises(IntegrityError, match="corrupt") as caught:
        reader.load(into={"layers": [torch.empty(256, 257) for _ in range(6)]}, max_workers=2)
    assert caught.value.digest == digest
    assert blob_key(digest) in store.prefetched
