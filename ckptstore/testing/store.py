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

The suite is split by job: :mod:`._store_base` (what a backend provides),
:mod:`._store_objects`, :mod:`._store_namespace` and :mod:`._store_concurrency` (the tests,
as mixins); :class:`StoreTests` combines them and this module is where to import it from.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from ckptstore.objectstore import ObjectStore
from ckptstore.testing._store_base import F
from ckptstore.testing._store_concurrency import ConcurrencyTests
from ckptstore.testing._store_namespace import BAD_KEYS, NamespaceTests
from ckptstore.testing._store_objects import ObjectTests
from ckptstore.testing.factories import MiB, S3StoreFactory, pattern

__all__ = ["BAD_KEYS", "S3StoreTests", "StoreTests"]


class StoreTests(ObjectTests[F], NamespaceTests[F], ConcurrencyTests[F]):
    """Behaviour every :class:`ObjectStore` must have. Subclass once per backend: define the
    ``factory`` fixture (a factory over a fresh, empty location; without it pytest reports
    "fixture 'factory' not found") and the three ``raw_*`` methods (abstract: a subclass that
    lacks one cannot be instantiated, so its tests fail instead of passing vacuously)."""

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
