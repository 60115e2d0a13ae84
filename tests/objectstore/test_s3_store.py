"""S3Store: the shared conformance suite on moto in-process and, as integration tests, on real
S3 endpoints (SeaweedFS's `weed mini` and moto's server), each checked in the bucket through a
plain boto3 client; plus reads in pieces (``RandomAccess``) on moto and SeaweedFS."""

from __future__ import annotations

import pytest

from ckptstore.cas import Kind, blob_key, put_blob
from ckptstore.cas.blobs import READ_PIECE, read_into
from ckptstore.errors import IntegrityError, ObjectNotFoundError, ObjectStoreError
from ckptstore.objectstore import ObjectStore, S3Store
from ckptstore.objectstore._s3_reader import FIRST_BYTES
from ckptstore.objectstore.base import RandomAccess
from ckptstore.testing.factories import S3StoreFactory, pattern
from ckptstore.testing.store import S3StoreTests


def count_gets(store: S3Store) -> list[str]:
    """The Range header of every GetObject ``store`` sends from now on."""
    ranges: list[str] = []
    store.client.meta.events.register(
        "before-parameter-build.s3.GetObject",
        lambda params, **kw: ranges.append(params.get("Range", "")),
    )
    return ranges


class RandomAccessTests:
    """``S3Store.open_reader``: any piece of an object, straight into the caller's buffer, with
    one small GET and one streamed GET for pieces read in order."""

    def test_s3_store_reads_in_pieces(self, factory: S3StoreFactory) -> None:
        assert isinstance(factory(), RandomAccess)

    def test_pieces_in_order_cost_two_gets(self, factory: S3StoreFactory) -> None:
        store = factory()
        data = pattern(3 * READ_PIECE + 4321, seed=3)
        factory.raw_client.put_object(
            Bucket=factory.bucket, Key=factory.full_key("cas/obj"), Body=data
        )
        ranges = count_gets(store)
        with store.open_reader("cas/obj") as reader:
            assert reader.size == len(data)
            header = memoryview(bytearray(576))
            reader.read_into(0, header)
            pieces = []
            # Like the blob reader: back to the header's end, then on in order to the end.
            for offset in range(100, len(data), READ_PIECE):
                piece = memoryview(bytearray(min(READ_PIECE, len(data) - offset)))
                reader.read_into(offset, piece)
                pieces.append(bytes(piece))
        assert bytes(header) == data[:576]
        assert b"".join(pieces) == data[100:]
        assert ranges == [f"bytes=0-{FIRST_BYTES - 1}", f"bytes={FIRST_BYTES}-{len(data) - 1}"]

    def test_reads_back_and_ahead_start_new_gets(self, factory: S3StoreFactory) -> None:
        store = factory()
        data = pattern(2 * FIRST_BYTES + 999, seed=5)
        store.put("obj", data)
        with store.open_reader("obj") as reader:
            for offset, n in [(FIRST_BYTES + 10, 50), (len(data) - 7, 7), (FIRST_BYTES - 5, 20)]:
                buf = memoryview(bytearray(n))
                reader.read_into(offset, buf)
                assert bytes(buf) == data[offset : offset + n]

    def test_small_and_empty_objects(self, factory: S3StoreFactory) -> None:
        store = factory()
        store.put("small", b"0123456789")
        store.put("empty", b"")
        with store.open_reader("small") as reader:
            buf = memoryview(bytearray(4))
            reader.read_into(6, buf)
            assert (reader.size, bytes(buf)) == (10, b"6789")
            with pytest.raises(ObjectStoreError, match=r"bytes \[8, 12\) lie outside"):
                reader.read_into(8, memoryview(bytearray(4)))
        with store.open_reader("empty") as reader:
            assert reader.size == 0
            reader.read_into(0, memoryview(bytearray(0)))

    def test_a_missing_object_is_not_found(self, factory: S3StoreFactory) -> None:
        store = factory()
        with pytest.raises(ObjectNotFoundError, match=f"{store.url}/absent"):
            store.open_reader("absent").__enter__()

    def test_blob_reader_verifies_a_raw_blob_read_in_pieces(self, factory: S3StoreFactory) -> None:
        """The blob reader takes the piecewise path on S3: every byte hashed, so one flipped
        byte in the bucket is found, naming the blob."""
        store = factory()
        data = pattern(2 * READ_PIECE + 77, seed=9)
        ref = put_blob(store, data, Kind.CHUNK, threshold=float("inf"))
        dest = bytearray(len(data))
        assert read_into(store, ref.digest, [(0, len(data))], lambda i: memoryview(dest))
        assert dest == data
        full = factory.full_key(blob_key(ref.digest))
        damaged = bytearray(
            factory.raw_client.get_object(Bucket=factory.bucket, Key=full)["Body"].read()
        )
        damaged[-READ_PIECE] ^= 1
        factory.raw_client.put_object(Bucket=factory.bucket, Key=full, Body=bytes(damaged))
        with pytest.raises(IntegrityError, match=f"{store.url}/cas/.*(corrupt)"):
            read_into(store, ref.digest, [(0, len(data))], lambda i: memoryview(dest))


class MotoRace(S3StoreTests):
    """moto checks If-None-Match and then stores the object without a lock between the two, so
    two racing conditional PUTs of one key can both succeed there (seen once in a CI run, on the
    in-process moto): the race is checked against SeaweedFS (TestSeaweedStore), a real server."""

    @pytest.mark.skip(reason="moto's conditional PUT is not atomic (see MotoRace)")
    def test_concurrent_puts_of_one_key_create_it_exactly_once(
        self, store: ObjectStore, factory: S3StoreFactory
    ) -> None:
        super().test_concurrent_puts_of_one_key_create_it_exactly_once(store, factory)


class TestMotoStore(RandomAccessTests, MotoRace):
    @pytest.fixture
    def factory(self, moto_store_factory: S3StoreFactory) -> S3StoreFactory:
        return moto_store_factory

    @pytest.mark.slow
    def test_delete_of_more_than_1000_existing_objects(self, factory: S3StoreFactory) -> None:
        store = factory()
        keys = [f"cas/{i:04d}" for i in range(1001)]
        for key in keys:
            self.raw_put(factory, key, b"x")
        assert len(self.raw_keys(factory)) == 1001
        requests: list[int] = []
        store.client.meta.events.register(
            "before-parameter-build.s3.DeleteObjects",
            lambda params, **kw: requests.append(len(params["Delete"]["Objects"])),
        )
        store.delete(keys)
        assert requests == [1000, 1]
        assert self.raw_keys(factory) == set()


@pytest.mark.integration
class TestSeaweedStore(RandomAccessTests, S3StoreTests):
    # SeaweedFS serialises conditional writes of one key with ~1 s waits; 8 racers suffice.
    race_writers = 8

    @pytest.fixture
    def factory(self, seaweed_store_factory: S3StoreFactory) -> S3StoreFactory:
        return seaweed_store_factory


@pytest.mark.integration
class TestMotoServerStore(MotoRace):
    @pytest.fixture
    def factory(self, moto_server_store_factory: S3StoreFactory) -> S3StoreFactory:
        return moto_server_store_factory
