"""The conformance suite's tests of concurrency: threads racing to create one key, one store
shared by many threads, and a listing taken while objects are being written."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from ckptstore.objectstore import ObjectStore
from ckptstore.testing._store_base import F, StoreSuite
from ckptstore.testing.factories import pattern


class ConcurrencyTests(StoreSuite[F]):
    """A store is safe to use from many threads, and many stores on one location at once."""

    def test_list_never_shows_partial_objects(self, factory: F) -> None:
        """While objects are being written, a listing shows each either complete or not at all."""
        writer, reader = factory(), factory()
        sizes = {f"obj/{i:02d}": 64 * 1024 + i for i in range(24)}
        done = threading.Event()

        def write() -> None:
            try:
                for key, size in sizes.items():
                    writer.put(key, pattern(size))
            finally:
                done.set()

        thread = threading.Thread(target=write)
        thread.start()
        try:
            while not done.is_set():
                for info in reader.list("obj/"):
                    assert info.key in sizes, f"unexpected name {info.key!r} in a listing"
                    assert info.size == sizes[info.key], f"{info.key} listed while partial"
        finally:
            thread.join()
        assert {i.key: i.size for i in reader.list("obj/")} == sizes
        assert self.raw_keys(factory) == set(sizes)

    # -- concurrency --------------------------------------------------------------------------

    def test_concurrent_puts_of_one_key_create_it_exactly_once(
        self, store: ObjectStore, factory: F
    ) -> None:
        """Of many threads racing to put one key, one wins and its bytes are what is stored."""
        writers = self.race_writers
        payloads = [bytes([i]) * 2048 + pattern(30_000, seed=i) for i in range(writers)]
        barrier = threading.Barrier(writers)

        def put(i: int) -> bool:
            barrier.wait()
            return store.put("cas/race", payloads[i])

        with ThreadPoolExecutor(writers) as pool:
            results = list(pool.map(put, range(writers)))
        assert results.count(True) == 1, results
        winner = payloads[results.index(True)]
        assert store.get("cas/race") == winner
        assert self.raw_get(factory, "cas/race") == winner
        assert self.raw_keys(factory) == {"cas/race"}

    def test_many_threads_many_keys(self, store: ObjectStore, factory: F) -> None:
        """One store is safe to use from many threads at once."""
        keys = [f"cas/{i % 7}/{i}" for i in range(60)]

        def put(key: str) -> bool:
            return store.put(key, key.encode() * 100)

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(put, keys))
            # Every key again, concurrently: all already exist.
            assert not any(pool.map(put, keys))
        assert {i.key for i in store.list("cas/")} == set(keys)
        for key in keys[::11]:
            assert self.raw_get(factory, key) == key.encode() * 100
