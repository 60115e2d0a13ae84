"""The object-store contract (DESIGN.md §3) as one pytest class that every backend's tests run.

A backend's test module subclasses :class:`StoreTests` (or :class:`S3StoreTests` for an
S3-compatible server), overrides the ``factory`` fixture to return a
:class:`~ckptstore.testing.factories.StoreFactory` over a fresh, empty location, and implements
the raw accessors :meth:`~StoreTests.raw_get`, :meth:`~StoreTests.raw_put` and
:meth:`~StoreTests.raw_keys`. They look at the stored bytes directly (files on disk, objects in
the bucket through a separate client), never through the store under test, so the suite checks
what really got stored::

    class TestMemoryStore(StoreTests[MemoryStoreFactory]):
        @pytest.fixture
        def factory(self) -> Iterator[MemoryStoreFactory]:
            factory = MemoryStoreFactory(Backing())
            yield factory
            factory.close_all()

        def raw_get(self, factory: MemoryStoreFactory, key: str) -> bytes | None:
            return factory.backing.objects.get(key)

        def raw_put(self, factory: MemoryStoreFactory, key: str, data: bytes) -> None:
            factory.backing.objects[key] = data

        def raw_keys(self, factory: MemoryStoreFactory) -> set[str]:
            return set(factory.backing.objects)

Class attributes tune the suite for a backend (``race_writers``, ``multipart_options``); a
subclass adds its backend's own tests next to the inherited ones.
"""

from __future__ import annotations

import abc
import array
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Generic, TypeVar

import pytest

from ckptstore.errors import CkptStoreError, ConfigError, ObjectNotFoundError, ObjectStoreError
from ckptstore.objectstore import ObjectStore
from ckptstore.testing.factories import (
    MULTIPART_OPTIONS,
    MiB,
    S3StoreFactory,
    StoreFactory,
    pattern,
)

__all__ = ["BAD_KEYS", "S3StoreTests", "StoreTests"]

F = TypeVar("F", bound=StoreFactory[ObjectStore])

#: Keys every store must refuse with a ConfigError before touching anything.
BAD_KEYS = [
    "",
    "../x",
    "a/../../x",
    "/abs",
    "a//b",
    "a/",
    ".",
    "..",
    "a/./b",
    "a b",
    "a\\b",
    "x\x00y",
    "ü",
]


class StoreTests(abc.ABC, Generic[F]):
    """Behaviour every :class:`ObjectStore` must have. Subclass once per backend: define the
    ``factory`` fixture (a factory over a fresh, empty location; without it pytest reports
    "fixture 'factory' not found") and the three ``raw_*`` methods (abstract: a subclass that
    lacks one cannot be instantiated, so its tests fail instead of passing vacuously)."""

    #: Options for a store that uploads big objects in parts (a backend ignores what it lacks).
    multipart_options: ClassVar[dict[str, Any]] = MULTIPART_OPTIONS
    #: Threads racing to create one key.
    race_writers: ClassVar[int] = 16

    @pytest.fixture
    def store(self, factory: F) -> ObjectStore:
        """A store over the factory's location."""
        return factory()

    @abc.abstractmethod
    def raw_get(self, factory: F, key: str) -> bytes | None:
        """The stored bytes of ``key`` read without the store, or None if absent."""

    @abc.abstractmethod
    def raw_put(self, factory: F, key: str, data: bytes) -> None:
        """Store ``data`` as ``key`` without the store, as another writer would have."""

    @abc.abstractmethod
    def raw_keys(self, factory: F) -> set[str]:
        """Every stored name under the store's root (keys relative to it), temp files included."""

    # -- put / get ----------------------------------------------------------------------------

    def test_put_then_get_round_trips(self, store: ObjectStore, factory: F) -> None:
        """What put stores is what get returns, and what is really stored."""
        data = pattern(10_000)
        assert store.put("cas/ab/abcdef", data) is True
        got = store.get("cas/ab/abcdef")
        assert isinstance(got, bytearray)
        assert got == data
        assert self.raw_get(factory, "cas/ab/abcdef") == data
        assert self.raw_keys(factory) == {"cas/ab/abcdef"}

    def test_flush_keeps_objects_and_can_repeat(self, store: ObjectStore, factory: F) -> None:
        """``flush`` (durability before a commit) changes no object, with or without puts."""
        store.flush()  # nothing put yet
        data = pattern(5000, seed=2)
        assert store.put("cas/ab/flushed", data) is True
        assert store.put("cas/ab/flushed", b"other") is False
        store.flush()
        store.flush()
        assert store.get("cas/ab/flushed") == data
        assert self.raw_get(factory, "cas/ab/flushed") == data
        assert self.raw_keys(factory) == {"cas/ab/flushed"}

    def test_object_stored_by_another_writer_is_read(self, store: ObjectStore, factory: F) -> None:
        """An object written without this store is read, listed and never overwritten."""
        data = pattern(3000, seed=4)
        self.raw_put(factory, "cas/ab/raw", data)
        assert store.get("cas/ab/raw") == data
        assert store.get("cas/ab/raw", (10, 20)) == data[10:20]
        assert bytes(store.get_view("cas/ab/raw")) == data
        assert store.head("cas/ab/raw").size == len(data)
        assert [i.key for i in store.list("cas/")] == ["cas/ab/raw"]
        assert store.put("cas/ab/raw", b"other") is False
        assert self.raw_get(factory, "cas/ab/raw") == data

    def test_empty_object(self, store: ObjectStore, factory: F) -> None:
        """A zero-byte object is an object."""
        assert store.put("empty", b"") is True
        assert store.get("empty") == b""
        assert store.get("empty", (0, 10)) == b""
        assert store.head("empty").size == 0
        assert self.raw_get(factory, "empty") == b""

    @pytest.mark.parametrize(
        "make",
        [
            pytest.param(lambda d: d, id="bytes"),
            pytest.param(bytearray, id="bytearray"),
            pytest.param(memoryview, id="memoryview"),
            pytest.param(lambda d: memoryview(array.array("I", d)), id="uint32-memoryview"),
            pytest.param(lambda d: [d[:5], bytearray(d[5:100]), memoryview(d)[100:]], id="list"),
            pytest.param(lambda d: (d[:1000], b"", d[1000:]), id="tuple-with-empty-part"),
        ],
    )
    def test_put_accepts_buffers_and_sequences_of_buffers(
        self, store: ObjectStore, factory: F, make: Callable[[bytes], Any]
    ) -> None:
        """put takes any buffer, or a sequence of them written back to back."""
        data = pattern(4096, seed=3)  # a multiple of 4, for the uint32 array
        assert store.put("obj", make(data)) is True
        assert store.get("obj") == data
        assert self.raw_get(factory, "obj") == data

    def test_put_does_not_keep_a_reference_to_the_caller_buffer(self, store: ObjectStore) -> None:
        """Changing the buffer after put does not change the object."""
        data = bytearray(pattern(1000))
        expected = bytes(data)
        store.put("obj", data)
        data[:] = b"\0" * len(data)
        assert store.get("obj") == expected

    def test_put_of_existing_key_is_success_and_leaves_the_object_alone(
        self, store: ObjectStore, factory: F
    ) -> None:
        """put is an idempotent create: a second put returns False and changes nothing."""
        first, second = pattern(3000, seed=1), pattern(5000, seed=2)
        assert store.put("k", first) is True
        assert store.put("k", second) is False
        assert store.put("k", first) is False
        assert store.get("k") == first
        assert store.head("k").size == len(first)
        assert self.raw_get(factory, "k") == first
        assert self.raw_keys(factory) == {"k"}

    def test_objects_are_visible_to_another_store_on_the_same_location(
        self, store: ObjectStore, factory: F
    ) -> None:
        """A second store over the same location sees the first one's objects."""
        data = pattern(777)
        store.put("dir/obj", data)
        other = factory()
        assert other.get("dir/obj") == data
        assert other.put("dir/obj", b"other") is False

    # -- ranged get ---------------------------------------------------------------------------

    def test_ranged_get(self, store: ObjectStore) -> None:
        """get of ``[start, stop)`` returns those bytes, clipped at the object's end."""
        data = pattern(10_000)
        store.put("obj", data)
        cases = {
            (0, 10_000): data,
            (100, 200): data[100:200],
            (0, 1): data[:1],
            (9_999, 10_000): data[-1:],
            (9_990, 20_000): data[9_990:],  # clipped at the end
            (0, 1 << 40): data,
            (7, 7): b"",  # empty
            (0, 0): b"",
            (10_000, 10_005): b"",  # starts at the end
            (12_000, 13_000): b"",  # entirely past the end
        }
        for byte_range, expected in cases.items():
            got = store.get("obj", byte_range)
            assert isinstance(got, bytearray)
            assert got == expected, f"get(obj, {byte_range}) returned {len(got)} wrong bytes"

    def test_invalid_range_is_a_config_error(self, store: ObjectStore) -> None:
        """A negative or reversed range is the caller's mistake, not a store fault."""
        store.put("obj", b"0123456789")
        for byte_range in [(-1, 5), (5, 4), (-3, -1)]:
            with pytest.raises(ConfigError, match="range"):
                store.get("obj", byte_range)

    # -- head / exists / not found ------------------------------------------------------------

    def test_head_and_exists(self, store: ObjectStore) -> None:
        """head reports key, size and mtime; exists is true of objects only."""
        before = time.time()
        store.put("a/b", pattern(1234))
        info = store.head("a/b")
        assert info.key == "a/b"
        assert info.size == 1234
        # Servers report whole seconds; allow for that and for a little clock skew.
        assert before - 5 <= info.mtime <= time.time() + 5
        assert store.exists("a/b") is True
        assert store.exists("a/c") is False
        assert store.exists("a") is False  # a "directory" is not an object

    @pytest.mark.parametrize(
        "call",
        [
            pytest.param(lambda s, k: s.get(k), id="get"),
            pytest.param(lambda s, k: s.get(k, (0, 10)), id="get-range"),
            pytest.param(lambda s, k: s.get(k, (4, 4)), id="get-empty-range"),
            pytest.param(lambda s, k: s.head(k), id="head"),
        ],
    )
    def test_missing_object_raises_not_found_naming_url_and_key(
        self, store: ObjectStore, call: Callable[[ObjectStore, str], object]
    ) -> None:
        """A missing object is an ObjectNotFoundError (a FileNotFoundError) naming URL and key."""
        store.put("present", b"x")
        with pytest.raises(ObjectNotFoundError) as info:
            call(store, "cas/00/missing-key")
        exc = info.value
        assert isinstance(exc, FileNotFoundError)
        assert isinstance(exc, ObjectStoreError)
        assert isinstance(exc, CkptStoreError)
        assert store.url in str(exc)
        assert "cas/00/missing-key" in str(exc)

    # -- delete -------------------------------------------------------------------------------

    def test_delete_removes_keys_and_ignores_missing_ones(
        self, store: ObjectStore, factory: F
    ) -> None:
        """delete removes what exists and ignores what does not, repeats included."""
        for key in ("a", "b/c", "d"):
            store.put(key, key.encode())
        store.delete(k for k in ["a", "missing", "b/c", "b/missing", "b/c"])
        assert not store.exists("a")
        assert not store.exists("b/c")
        assert store.get("d") == b"d"
        assert self.raw_keys(factory) == {"d"}
        store.delete([])
        store.delete(["a"])  # deleting again is fine
        assert store.get("d") == b"d"

    def test_delete_more_keys_than_one_batch(self, store: ObjectStore, factory: F) -> None:
        """delete of more keys than a request takes splits them into batches."""
        # S3 takes at most 1000 keys per DeleteObjects; the store must split the batch. Objects
        # sit in the first, second and third batch among keys that do not exist.
        keys = [f"cas/{i:05d}" for i in range(2_345)]
        present = [keys[0], keys[999], keys[1000], keys[1999], keys[2000], keys[-1]]
        for key in present:
            store.put(key, key.encode())
        store.put("keep", b"keep")
        store.delete(keys)
        assert self.raw_keys(factory) == {"keep"}
        assert [info.key for info in store.list()] == ["keep"]

    def test_deleted_key_can_be_written_again(self, store: ObjectStore) -> None:
        """After delete, put creates the key anew."""
        store.put("k", b"old")
        store.delete(["k"])
        assert store.put("k", b"new") is True
        assert store.get("k") == b"new"

    # -- list ---------------------------------------------------------------------------------

    def test_list_by_prefix(self, store: ObjectStore) -> None:
        """list yields each object whose key starts with the prefix, once, with its size."""
        objects = {"a/b/1": 1, "a/b/2": 22, "a/c": 333, "ab": 4, "b": 5, "a/bc/x": 6}
        for key, size in objects.items():
            store.put(key, pattern(size))

        def listed(prefix: str = "") -> dict[str, int]:
            infos = list(store.list(prefix))
            assert len({i.key for i in infos}) == len(infos), "a key was listed twice"
            return {i.key: i.size for i in infos}

        assert listed() == objects
        assert listed("a/") == {k: v for k, v in objects.items() if k.startswith("a/")}
        assert listed("a") == {k: v for k, v in objects.items() if k.startswith("a")}
        assert listed("a/b/") == {"a/b/1": 1, "a/b/2": 22}
        assert listed("a/b") == {"a/b/1": 1, "a/b/2": 22, "a/bc/x": 6}
        assert listed("a/b/1") == {"a/b/1": 1}
        assert listed("nothing/") == {}
        assert listed("zzz") == {}
        now = time.time()
        assert all(now - 60 <= i.mtime <= now + 5 for i in store.list())

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

    # -- keys ---------------------------------------------------------------------------------

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_invalid_keys_are_rejected(self, store: ObjectStore, factory: F, key: str) -> None:
        """Every call refuses an unsafe key with a ConfigError naming it, storing nothing."""
        calls: dict[str, Callable[[], object]] = {
            "put": lambda: store.put(key, b"x"),
            "put-list": lambda: store.put(key, [b"x", b"y"]),
            "get": lambda: store.get(key),
            "get-empty-range": lambda: store.get(key, (0, 0)),
            "head": lambda: store.head(key),
            "exists": lambda: store.exists(key),
            "delete": lambda: store.delete([key]),
        }
        for name, call in calls.items():
            with pytest.raises(ConfigError, match="invalid object key") as info:
                call()
            assert repr(key) in str(info.value), name
        assert self.raw_keys(factory) == set()

    @pytest.mark.parametrize("key", ["a", "A-Z_0.9", "cas/ab/" + "f" * 64, "x/.y", "a..b", "-"])
    def test_valid_unusual_keys(self, store: ObjectStore, factory: F, key: str) -> None:
        """Keys that look odd but are safe are stored under exactly that name."""
        assert store.put(key, key.encode()) is True
        assert store.get(key) == key.encode()
        assert [i.key for i in store.list()] == [key]
        assert self.raw_get(factory, key) == key.encode()

    # -- big objects --------------------------------------------------------------------------

    def test_big_object_in_parts_is_intact(self, factory: F) -> None:
        """An object big enough to go up in parts comes back whole, ranges across parts too."""
        store = factory(**self.multipart_options)
        header = b"CKPT" + bytes(96)
        payload = pattern(12 * MiB + 12_345, seed=7)
        data = header + payload
        # Given as two buffers whose boundary falls inside the first part.
        assert store.put("big", [header, memoryview(payload)]) is True
        got = store.get("big")
        assert len(got) == len(data)
        assert got == data
        boundary = 5 * MiB
        assert (
            store.get("big", (boundary - 10, boundary + 10)) == data[boundary - 10 : boundary + 10]
        )
        assert store.get("big", (len(data) - 3, len(data) + 3)) == data[-3:]
        assert store.head("big").size == len(data)
        assert store.put("big", b"small") is False
        assert store.get("big", (0, 8)) == data[:8]
        assert self.raw_get(factory, "big") == data
        assert self.raw_keys(factory) == {"big"}

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

    # -- misc ---------------------------------------------------------------------------------

    def test_url_and_repr(self, store: ObjectStore) -> None:
        """A store has a URL, and its repr shows it."""
        assert store.url
        assert store.url in repr(store)

    def test_context_manager_closes(self, factory: F) -> None:
        """A store is a context manager; what it wrote outlives it."""
        with factory() as store:
            store.put("k", b"v")
        assert factory().get("k") == b"v"


class S3StoreTests(StoreTests[S3StoreFactory]):
    """The contract plus S3 specifics; the bytes are checked in the bucket with a plain client."""

    def raw_get(self, factory: S3StoreFactory, key: str) -> bytes | None:
        """The object's bytes fetched with the factory's plain client, or None if absent."""
        try:
            response = factory.raw_client.get_object(
                Bucket=factory.bucket, Key=factory.full_key(key)
            )
        except factory.raw_client.exceptions.NoSuchKey:
            return None
        return bytes(response["Body"].read())

    def raw_put(self, factory: S3StoreFactory, key: str, data: bytes) -> None:
        """Upload ``data`` under the stores' prefix with the factory's plain client."""
        factory.raw_client.put_object(Bucket=factory.bucket, Key=factory.full_key(key), Body=data)

    def raw_keys(self, factory: S3StoreFactory) -> set[str]:
        """Keys under the stores' prefix; anything else in this test's corner fails the test."""
        root = f"{factory.prefix}/"
        keys = factory.bucket_keys(prefix=factory.root)
        outside = [k for k in keys if not k.startswith(root)]
        assert not outside, f"objects written outside the store's prefix: {outside}"
        return {k[len(root) :] for k in keys}

    def test_objects_live_under_the_prefix(self, factory: S3StoreFactory) -> None:
        """A store's key ``k`` is the bucket key ``prefix/k``."""
        store = factory()
        store.put("cas/ab/cd", b"payload")
        assert factory.bucket_keys(prefix=factory.root) == [f"{factory.prefix}/cas/ab/cd"]
        assert store.url == f"s3://{factory.bucket}/{factory.prefix}"

    def test_store_without_prefix(self, factory: S3StoreFactory) -> None:
        """A store on a whole bucket uses its keys as they are."""
        bucket = factory.fresh_bucket()
        store = factory(bucket=bucket, prefix="")
        assert store.url == f"s3://{bucket}"
        store.put("top", b"1")
        store.put("dir/inner", b"22")
        assert sorted(factory.bucket_keys(bucket)) == ["dir/inner", "top"]
        raw = factory.raw_client.get_object(Bucket=bucket, Key="dir/inner")
        assert raw["Body"].read() == b"22"
        assert {i.key: i.size for i in store.list()} == {"top": 1, "dir/inner": 2}
        assert {i.key for i in store.list("d")} == {"dir/inner"}

    def test_prefix_is_not_a_string_prefix_of_a_sibling(self, factory: S3StoreFactory) -> None:
        """A store at ``run`` must not see objects of a store at ``run-2``."""
        store = factory(prefix=f"{factory.root}/run")
        sibling = factory(prefix=f"{factory.root}/run-2")
        sibling.put("k", b"sibling")
        store.put("k", b"mine")
        assert [i.key for i in store.list()] == ["k"]
        assert store.get("k") == b"mine"

    def test_big_object_went_up_in_parts(self, factory: S3StoreFactory) -> None:
        """An object at the multipart threshold goes up in parts, and no upload stays open."""
        store = factory(**self.multipart_options)
        data = pattern(12 * MiB, seed=11)
        sent: list[str] = []
        store.client.meta.events.register(
            "before-call.s3.*", lambda model, **kw: sent.append(model.name)
        )
        assert store.put("big", data) is True
        assert sent.count("UploadPart") == 3
        assert "PutObject" not in sent
        head = factory.raw_client.head_object(Bucket=factory.bucket, Key=factory.full_key("big"))
        assert head["ContentLength"] == len(data)
        assert head["ETag"].strip('"').endswith("-3")
        assert factory.pending_uploads() == []

    def test_below_threshold_is_one_put(self, factory: S3StoreFactory) -> None:
        """An object below the multipart threshold is one PutObject."""
        store = factory(**self.multipart_options)
        sent: list[str] = []
        store.client.meta.events.register(
            "before-call.s3.*", lambda model, **kw: sent.append(model.name)
        )
        assert store.put("small", pattern(5 * MiB - 1)) is True
        assert sent == ["PutObject"]

    def test_racing_multipart_uploads_leave_one_whole_object(self, factory: S3StoreFactory) -> None:
        """Racing uploads of one key end with one writer's object and no open uploads.

        S3 makes a conditional CompleteMultipartUpload atomic, so exactly one writer gets True.
        moto and SeaweedFS check If-None-Match before assembling the parts, so there several
        may; the object must still be whole and one of theirs.
        """
        writers = 3
        stores = [factory(**self.multipart_options) for _ in range(writers)]
        payloads = [pattern(11 * MiB, seed=100 + i) for i in range(writers)]
        barrier = threading.Barrier(writers)

        def put(i: int) -> bool:
            barrier.wait()
            return stores[i].put("cas/big-race", payloads[i])

        with ThreadPoolExecutor(writers) as pool:
            results = list(pool.map(put, range(writers)))
        assert True in results
        winners = [payloads[i] for i, created in enumerate(results) if created]
        assert self.raw_get(factory, "cas/big-race") in winners
        assert factory.pending_uploads() == []
        assert self.raw_keys(factory) == {"cas/big-race"}
        assert all(s.put("cas/big-race", payloads[0]) is False for s in stores)

    def test_delete_batches_hold_at_most_1000_keys(self, factory: S3StoreFactory) -> None:
        """delete sends at most 1000 keys per DeleteObjects request (S3's limit)."""
        store = factory()
        batches: list[int] = []
        store.client.meta.events.register(
            "before-parameter-build.s3.DeleteObjects",
            lambda params, **kw: batches.append(len(params["Delete"]["Objects"])),
        )
        store.put("k-0500", b"x")
        store.put("k-1500", b"x")
        store.delete(f"k-{i:04d}" for i in range(2001))
        assert batches == [1000, 1000, 1]
        assert self.raw_keys(factory) == set()
