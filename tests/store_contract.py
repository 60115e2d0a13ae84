"""The object-store contract (DESIGN.md §3) as one test class, run against every backend.

A backend's test module subclasses :class:`StoreContract` (or :class:`S3StoreContract`),
overrides the ``factory`` fixture, and implements :meth:`StoreContract.raw_read` and
:meth:`StoreContract.raw_keys`, which look at the stored bytes directly (files on disk, objects
in the bucket through a separate boto3 client) rather than through the store under test.
"""

from __future__ import annotations

import array
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import boto3
import pytest
from s3servers import plain_client, random_bucket_name

from ckptstore.errors import CkptStoreError, ConfigError, ObjectNotFoundError, ObjectStoreError
from ckptstore.objectstore import LocalStore, ObjectStore, RetryPolicy, S3Store

MiB = 1 << 20
#: Retries in tests: a few attempts with millisecond backoff, so faults cost no waiting.
FAST_RETRY = RetryPolicy(max_attempts=4, base_delay=0.001, max_delay=0.01)
#: The smallest multipart settings S3 allows, so a ~12 MiB object goes up in three parts.
MULTIPART_OPTIONS: dict[str, Any] = {"multipart_threshold": 5 * MiB, "part_size": 5 * MiB}

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


def pattern(size: int, seed: int = 0) -> bytes:
    """Deterministic, incompressible-looking bytes, so misplaced ranges cannot match by luck."""
    return random.Random(seed).randbytes(size)


class StoreFactory:
    """Opens stores over one fresh, empty location; closes every store it opened at teardown."""

    backend: str = ""

    def __init__(self) -> None:
        self._opened: list[ObjectStore] = []

    def __call__(self, **options: Any) -> ObjectStore:
        store = self._open(**options)
        self._opened.append(store)
        return store

    def _open(self, **options: Any) -> ObjectStore:
        raise NotImplementedError

    def close_all(self) -> None:
        while self._opened:
            self._opened.pop().close()


class LocalStoreFactory(StoreFactory):
    backend = "local"

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def _open(self, **options: Any) -> LocalStore:
        options.pop("multipart_threshold", None)
        options.pop("part_size", None)
        return LocalStore(self.root, **options)


#: S3Store options that shape its boto3 client; given any of them, a factory builds the store
#: exactly as a user would instead of taking the fast path below.
_CLIENT_OPTIONS = frozenset(
    {
        "client",
        "endpoint_url",
        "profile_name",
        "region_name",
        "addressing_style",
        "connect_timeout",
        "read_timeout",
        "max_concurrency",
    }
)


class S3Endpoint:
    """One S3 endpoint (None: AWS, i.e. moto in-process) for a whole test session.

    Building a boto3 client in a fresh session parses botocore's S3 model (~0.1 s). Stores are
    therefore given clients from one shared session, configured with the very ``Config`` that
    S3Store's own constructor produced for ``template`` (built once, the way users build it).
    """

    def __init__(self, endpoint_url: str | None) -> None:
        self.endpoint_url = endpoint_url
        self.session = boto3.session.Session()
        self.raw_client = plain_client(endpoint_url)
        template = S3Store("template-bucket", endpoint_url=endpoint_url)
        self.config = template.client.meta.config
        template.close()

    def client(self) -> Any:
        return self.session.client("s3", endpoint_url=self.endpoint_url, config=self.config)


class S3StoreFactory(StoreFactory):
    """Stores over ``s3://bucket/prefix`` on ``endpoint``.

    ``raw_client`` is a plain boto3 client, independent of the stores, for checking what is
    really in the bucket.
    """

    def __init__(self, backend: str, endpoint: S3Endpoint, *, bucket: str) -> None:
        super().__init__()
        self.backend = backend
        self.endpoint = endpoint
        self.endpoint_url = endpoint.endpoint_url
        self.raw_client = endpoint.raw_client
        self.bucket = bucket
        #: This test's own corner of the bucket (buckets may be shared between tests).
        self.root = f"t-{uuid.uuid4().hex[:16]}"
        #: The stores' prefix unless a test asks for another.
        self.prefix = f"{self.root}/ckpt/run-1"
        self.created_buckets: list[str] = []

    def _open(self, **options: Any) -> S3Store:
        bucket = options.pop("bucket", self.bucket)
        options.setdefault("prefix", self.prefix)
        options.setdefault("retry", FAST_RETRY)
        if not _CLIENT_OPTIONS & options.keys():
            options["client"] = self.endpoint.client()
        elif self.endpoint_url is not None:
            options.setdefault("endpoint_url", self.endpoint_url)
        return S3Store(bucket, **options)

    def fresh_bucket(self) -> str:
        """Create an empty bucket of this test's own (for stores without a prefix)."""
        bucket = random_bucket_name()
        self.raw_client.create_bucket(Bucket=bucket)
        self.created_buckets.append(bucket)
        return bucket

    def full_key(self, key: str, prefix: str | None = None) -> str:
        prefix = self.prefix if prefix is None else prefix
        return f"{prefix}/{key}" if prefix else key

    def bucket_keys(self, bucket: str | None = None, prefix: str = "") -> list[str]:
        """Every key in the bucket that starts with ``prefix``, store prefixes included."""
        keys: list[str] = []
        pages = self.raw_client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket or self.bucket, Prefix=prefix
        )
        for page in pages:
            keys.extend(item["Key"] for item in page.get("Contents", []))
        return keys

    def pending_uploads(self) -> list[str]:
        response = self.raw_client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix)
        return [u["Key"] for u in response.get("Uploads", [])]


class StoreContract:
    """Behaviour every :class:`ObjectStore` must have. Subclass per backend."""

    #: Options for a store that uploads big objects in parts (ignored by LocalStore).
    multipart_options: ClassVar[dict[str, Any]] = MULTIPART_OPTIONS
    #: Threads racing to create one key.
    race_writers: ClassVar[int] = 16

    @pytest.fixture
    def factory(self) -> StoreFactory:
        raise NotImplementedError("override the factory fixture in the backend's test class")

    @pytest.fixture
    def store(self, factory: StoreFactory) -> ObjectStore:
        return factory()

    def raw_read(self, factory: StoreFactory, key: str) -> bytes | None:
        """The stored bytes of ``key`` read without the store, or None if absent."""
        raise NotImplementedError

    def raw_keys(self, factory: StoreFactory) -> set[str]:
        """Every stored name under the store's root (keys relative to it), temp files included."""
        raise NotImplementedError

    # -- put / get ----------------------------------------------------------------------------

    def test_put_then_get_round_trips(self, store: ObjectStore, factory: StoreFactory) -> None:
        data = pattern(10_000)
        assert store.put("cas/ab/abcdef", data) is True
        got = store.get("cas/ab/abcdef")
        assert isinstance(got, bytearray)
        assert got == data
        assert self.raw_read(factory, "cas/ab/abcdef") == data
        assert self.raw_keys(factory) == {"cas/ab/abcdef"}

    def test_empty_object(self, store: ObjectStore, factory: StoreFactory) -> None:
        assert store.put("empty", b"") is True
        assert store.get("empty") == b""
        assert store.get("empty", (0, 10)) == b""
        assert store.head("empty").size == 0
        assert self.raw_read(factory, "empty") == b""

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
        self, store: ObjectStore, factory: StoreFactory, make: Callable[[bytes], Any]
    ) -> None:
        data = pattern(4096, seed=3)  # a multiple of 4, for the uint32 array
        assert store.put("obj", make(data)) is True
        assert store.get("obj") == data
        assert self.raw_read(factory, "obj") == data

    def test_put_does_not_keep_a_reference_to_the_caller_buffer(self, store: ObjectStore) -> None:
        data = bytearray(pattern(1000))
        expected = bytes(data)
        store.put("obj", data)
        data[:] = b"\0" * len(data)
        assert store.get("obj") == expected

    def test_put_of_existing_key_is_success_and_leaves_the_object_alone(
        self, store: ObjectStore, factory: StoreFactory
    ) -> None:
        first, second = pattern(3000, seed=1), pattern(5000, seed=2)
        assert store.put("k", first) is True
        assert store.put("k", second) is False
        assert store.put("k", first) is False
        assert store.get("k") == first
        assert store.head("k").size == len(first)
        assert self.raw_read(factory, "k") == first
        assert self.raw_keys(factory) == {"k"}

    def test_objects_are_visible_to_another_store_on_the_same_location(
        self, store: ObjectStore, factory: StoreFactory
    ) -> None:
        data = pattern(777)
        store.put("dir/obj", data)
        other = factory()
        assert other.get("dir/obj") == data
        assert other.put("dir/obj", b"other") is False

    # -- ranged get ---------------------------------------------------------------------------

    def test_ranged_get(self, store: ObjectStore) -> None:
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
        store.put("obj", b"0123456789")
        for byte_range in [(-1, 5), (5, 4), (-3, -1)]:
            with pytest.raises(ConfigError, match="range"):
                store.get("obj", byte_range)

    # -- head / exists / not found ------------------------------------------------------------

    def test_head_and_exists(self, store: ObjectStore) -> None:
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
        self, store: ObjectStore, factory: StoreFactory
    ) -> None:
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

    def test_delete_more_keys_than_one_batch(
        self, store: ObjectStore, factory: StoreFactory
    ) -> None:
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
        store.put("k", b"old")
        store.delete(["k"])
        assert store.put("k", b"new") is True
        assert store.get("k") == b"new"

    # -- list ---------------------------------------------------------------------------------

    def test_list_by_prefix(self, store: ObjectStore) -> None:
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

    def test_list_never_shows_partial_objects(self, factory: StoreFactory) -> None:
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
        seen: dict[str, int] = {}
        try:
            while not done.is_set():
                for info in reader.list("obj/"):
                    seen[info.key] = info.size
                    assert info.key in sizes, f"unexpected name {info.key!r} in a listing"
                    assert info.size == sizes[info.key], f"{info.key} listed while partial"
        finally:
            thread.join()
        assert {i.key: i.size for i in reader.list("obj/")} == sizes
        assert self.raw_keys(factory) == set(sizes)

    # -- keys ---------------------------------------------------------------------------------

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_invalid_keys_are_rejected(
        self, store: ObjectStore, factory: StoreFactory, key: str
    ) -> None:
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
    def test_valid_unusual_keys(self, store: ObjectStore, factory: StoreFactory, key: str) -> None:
        assert store.put(key, key.encode()) is True
        assert store.get(key) == key.encode()
        assert [i.key for i in store.list()] == [key]
        assert self.raw_read(factory, key) == key.encode()

    # -- big objects --------------------------------------------------------------------------

    def test_big_object_in_parts_is_intact(self, factory: StoreFactory) -> None:
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
        assert self.raw_read(factory, "big") == data
        assert self.raw_keys(factory) == {"big"}

    # -- concurrency --------------------------------------------------------------------------

    def test_concurrent_puts_of_one_key_create_it_exactly_once(
        self, store: ObjectStore, factory: StoreFactory
    ) -> None:
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
        assert self.raw_read(factory, "cas/race") == winner
        assert self.raw_keys(factory) == {"cas/race"}

    def test_many_threads_many_keys(self, store: ObjectStore, factory: StoreFactory) -> None:
        keys = [f"cas/{i % 7}/{i}" for i in range(60)]

        def put(key: str) -> bool:
            return store.put(key, key.encode() * 100)

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(put, keys))
            # Every key again, concurrently: all already exist.
            assert not any(pool.map(put, keys))
        assert {i.key for i in store.list("cas/")} == set(keys)
        for key in keys[::11]:
            assert self.raw_read(factory, key) == key.encode() * 100

    # -- misc ---------------------------------------------------------------------------------

    def test_url_and_repr(self, store: ObjectStore) -> None:
        assert store.url
        assert store.url in repr(store)

    def test_context_manager_closes(self, factory: StoreFactory) -> None:
        with factory() as store:
            store.put("k", b"v")
        assert factory().get("k") == b"v"


class S3StoreContract(StoreContract):
    """The contract plus S3 specifics; the bytes are checked in the bucket with a plain client."""

    @pytest.fixture
    def factory(self) -> S3StoreFactory:
        raise NotImplementedError("override the factory fixture in the backend's test class")

    def raw_read(self, factory: StoreFactory, key: str) -> bytes | None:
        assert isinstance(factory, S3StoreFactory)
        try:
            response = factory.raw_client.get_object(
                Bucket=factory.bucket, Key=factory.full_key(key)
            )
        except factory.raw_client.exceptions.NoSuchKey:
            return None
        return bytes(response["Body"].read())

    def raw_keys(self, factory: StoreFactory) -> set[str]:
        assert isinstance(factory, S3StoreFactory)
        root = f"{factory.prefix}/"
        keys = factory.bucket_keys(prefix=factory.root)
        outside = [k for k in keys if not k.startswith(root)]
        assert not outside, f"objects written outside the store's prefix: {outside}"
        return {k[len(root) :] for k in keys}

    def test_objects_live_under_the_prefix(self, factory: S3StoreFactory) -> None:
        store = factory()
        store.put("cas/ab/cd", b"payload")
        assert factory.bucket_keys(prefix=factory.root) == [f"{factory.prefix}/cas/ab/cd"]
        assert store.url == f"s3://{factory.bucket}/{factory.prefix}"

    def test_store_without_prefix(self, factory: S3StoreFactory) -> None:
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
        store = factory(**self.multipart_options)
        data = pattern(12 * MiB, seed=11)
        sent: list[str] = []
        store.client.meta.events.register(  # type: ignore[attr-defined]
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
        store = factory(**self.multipart_options)
        sent: list[str] = []
        store.client.meta.events.register(  # type: ignore[attr-defined]
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
        assert self.raw_read(factory, "cas/big-race") in winners
        assert factory.pending_uploads() == []
        assert self.raw_keys(factory) == {"cas/big-race"}
        assert all(s.put("cas/big-race", payloads[0]) is False for s in stores)

    def test_delete_batches_hold_at_most_1000_keys(self, factory: S3StoreFactory) -> None:
        store = factory()
        batches: list[int] = []
        store.client.meta.events.register(  # type: ignore[attr-defined]
            "before-parameter-build.s3.DeleteObjects",
            lambda params, **kw: batches.append(len(params["Delete"]["Objects"])),
        )
        store.put("k-0500", b"x")
        store.put("k-1500", b"x")
        store.delete(f"k-{i:04d}" for i in range(2001))
        assert batches == [1000, 1000, 1]
        assert self.raw_keys(factory) == set()
