"""GCSStore: the shared conformance suite on a real GCS emulator (gcp-storage-emulator, a
subprocess, with GCS's preconditions added: see tests/gcsserver.py), each object checked in the
bucket through a plain google-cloud-storage client; plus GCS's own: the prefix, resumable
uploads in chunks from the caller's buffers, reads in pieces, and racing writers."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from gcs_fixtures import GCSStoreFactory

from ckptstore.cas import Kind, blob_key, put_blob
from ckptstore.cas.blobs import READ_PIECE, read_into
from ckptstore.errors import IntegrityError, ObjectNotFoundError, ObjectStoreError
from ckptstore.objectstore import open_store
from ckptstore.objectstore._gcs import GCSStore
from ckptstore.objectstore._gcs_reader import FIRST_BYTES
from ckptstore.objectstore._gcs_upload import ResumableUpload
from ckptstore.objectstore.base import RandomAccess
from ckptstore.testing.factories import MiB, pattern
from ckptstore.testing.store import StoreTests


def record_requests(store: GCSStore) -> list[tuple[str, str, dict[str, str]]]:
    """(method, url, headers) of every request ``store`` sends from now on."""
    sent: list[tuple[str, str, dict[str, str]]] = []
    session = store._session
    original = session.request

    def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        params = kwargs.get("params") or {}
        query = "&".join(f"{k}={v}" for k, v in params.items())
        sent.append((method, f"{url}?{query}" if query else url, dict(kwargs.get("headers") or {})))
        return original(method, url, *args, **kwargs)

    session.request = request
    return sent


class TestGCSStore(StoreTests[GCSStoreFactory]):
    @pytest.fixture
    def factory(self, gcs_store_factory: GCSStoreFactory) -> GCSStoreFactory:
        return gcs_store_factory

    def raw_get(self, factory: GCSStoreFactory, key: str) -> bytes | None:
        return factory.raw_get(factory.full_key(key))

    def raw_put(self, factory: GCSStoreFactory, key: str, data: bytes) -> None:
        factory.raw_put(factory.full_key(key), data)

    def raw_keys(self, factory: GCSStoreFactory) -> set[str]:
        root = f"{factory.prefix}/"
        names = factory.bucket_keys(prefix=factory.root)
        outside = [n for n in names if not n.startswith(root)]
        assert not outside, f"objects written outside the store's prefix: {outside}"
        return {n[len(root) :] for n in names}

    # -- GCS specifics ------------------------------------------------------------------------

    def test_objects_live_under_the_prefix(self, factory: GCSStoreFactory) -> None:
        store = factory()
        store.put("cas/ab/cd", b"payload")
        assert factory.bucket_keys(prefix=factory.root) == [f"{factory.prefix}/cas/ab/cd"]
        assert store.url == f"gs://{factory.bucket}/{factory.prefix}"

    def test_store_without_prefix(self, factory: GCSStoreFactory) -> None:
        bucket = factory.fresh_bucket()
        store = factory(bucket=bucket, prefix="")
        assert store.url == f"gs://{bucket}"
        store.put("top", b"1")
        store.put("dir/inner", b"22")
        assert sorted(factory.bucket_keys(bucket)) == ["dir/inner", "top"]
        assert factory.raw_get("dir/inner", bucket) == b"22"
        assert {i.key: i.size for i in store.list()} == {"top": 1, "dir/inner": 2}

    def test_prefix_is_not_a_string_prefix_of_a_sibling(self, factory: GCSStoreFactory) -> None:
        store = factory(prefix=f"{factory.root}/run")
        sibling = factory(prefix=f"{factory.root}/run-2")
        sibling.put("k", b"sibling")
        store.put("k", b"mine")
        assert [i.key for i in store.list()] == ["k"]
        assert store.get("k") == b"mine"

    def test_every_upload_is_conditional(self, factory: GCSStoreFactory) -> None:
        """Small and resumable uploads alike carry ifGenerationMatch=0: GCS itself refuses to
        overwrite, so no check-then-write window exists."""
        store = factory(resumable_threshold=MiB, chunk_size=MiB // 2)
        store.put("warm", b"x")  # the one conditional-write probe happens here
        sent = record_requests(store)
        assert store.put("small", b"abc") is True
        assert store.put("big", pattern(MiB + 5, seed=1)) is True
        uploads = [url for method, url, _ in sent if method == "POST" and "/upload/" in url]
        assert len(uploads) == 2, sent
        assert all("ifGenerationMatch=0" in url for url in uploads), uploads
        assert store._conditional is True

    def test_big_object_goes_up_in_chunks_from_the_caller_buffers(
        self, factory: GCSStoreFactory
    ) -> None:
        """An object at the resumable threshold goes up in chunk-sized requests whose bodies are
        read from the caller's buffers (the memory in flight is bounded by the socket, not the
        object): 12 MiB in 4 MiB chunks is one session and three PUTs."""
        store = factory(resumable_threshold=4 * MiB, chunk_size=4 * MiB)
        header, payload = b"HDR" * 10, memoryview(pattern(12 * MiB - 30, seed=3))
        sent = record_requests(store)
        assert store.put("big", [header, payload]) is True
        puts = [h for method, _, h in sent if method == "PUT"]
        assert [h["Content-Range"] for h in puts] == [
            f"bytes 0-{4 * MiB - 1}/{12 * MiB}",
            f"bytes {4 * MiB}-{8 * MiB - 1}/{12 * MiB}",
            f"bytes {8 * MiB}-{12 * MiB - 1}/{12 * MiB}",
        ]
        assert self.raw_get(factory, "big") == header + bytes(payload)

    def test_a_failed_chunk_resumes_where_gcs_stopped(self, factory: GCSStoreFactory) -> None:
        """A chunk whose request fails is not sent from the start: the upload asks GCS what it
        has (a status query) and goes on from there."""
        store = factory(resumable_threshold=MiB, chunk_size=MiB)
        data = pattern(3 * MiB + 7, seed=5)
        failures = {"left": 1}
        original = ResumableUpload._send_chunk

        def flaky(self: ResumableUpload) -> None:
            original(self)
            if self.offset == 2 * MiB and failures["left"]:
                failures["left"] -= 1  # delivered, but the answer "was lost"
                raise ConnectionResetError("connection reset by peer")

        sent = record_requests(store)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ResumableUpload, "_send_chunk", flaky)
            assert store.put("resumed", data) is True
        ranges = [h["Content-Range"] for method, _, h in sent if method == "PUT"]
        assert ranges == [
            f"bytes 0-{MiB - 1}/{len(data)}",
            f"bytes {MiB}-{2 * MiB - 1}/{len(data)}",
            f"bytes */{len(data)}",  # the status query: GCS has 2 MiB
            f"bytes {2 * MiB}-{3 * MiB - 1}/{len(data)}",
            f"bytes {3 * MiB}-{len(data) - 1}/{len(data)}",
        ]
        assert self.raw_get(factory, "resumed") == data

    def test_racing_resumable_uploads_leave_one_whole_object(
        self, factory: GCSStoreFactory
    ) -> None:
        """Writers racing to create one big object: exactly one wins (GCS checks the
        precondition when the upload completes), the object is that writer's, whole."""
        writers = 3
        stores = [factory(resumable_threshold=MiB, chunk_size=MiB) for _ in range(writers)]
        for store in stores:
            store.put(f"warm-{id(store)}", b"")  # probe conditional writes before the race
            store.exists = lambda key: False  # type: ignore[method-assign]  # skip the HEAD
        payloads = [pattern(3 * MiB, seed=100 + i) for i in range(writers)]
        barrier = threading.Barrier(writers)

        def put(i: int) -> bool:
            barrier.wait()
            return stores[i].put("cas/big-race", payloads[i])

        with ThreadPoolExecutor(writers) as pool:
            results = list(pool.map(put, range(writers)))
        assert results.count(True) == 1, results
        assert self.raw_get(factory, "cas/big-race") == payloads[results.index(True)]

    def test_delete_batches_hold_at_most_100_calls(self, factory: GCSStoreFactory) -> None:
        store = factory()
        store.put("k-0050", b"x")
        store.put("k-0150", b"x")
        sent = record_requests(store)
        store.delete(f"k-{i:04d}" for i in range(201))
        assert [url.endswith("/batch/storage/v1") for _, url, _ in sent] == [True] * 3
        assert self.raw_keys(factory) == set()

    # -- reads in pieces ----------------------------------------------------------------------

    def test_gcs_store_reads_in_pieces(self, factory: GCSStoreFactory) -> None:
        assert isinstance(factory(), RandomAccess)

    def test_pieces_in_order_cost_two_gets(self, factory: GCSStoreFactory) -> None:
        store = factory()
        data = pattern(3 * READ_PIECE + 4321, seed=3)
        self.raw_put(factory, "cas/obj", data)
        sent = record_requests(store)
        with store.open_reader("cas/obj") as reader:
            assert reader.size == len(data)
            header = memoryview(bytearray(576))
            reader.read_into(0, header)
            pieces = []
            for offset in range(100, len(data), READ_PIECE):
                piece = memoryview(bytearray(min(READ_PIECE, len(data) - offset)))
                reader.read_into(offset, piece)
                pieces.append(bytes(piece))
        assert bytes(header) == data[:576]
        assert b"".join(pieces) == data[100:]
        assert [h.get("Range") for m, _, h in sent if m == "GET"] == [
            f"bytes=0-{FIRST_BYTES - 1}",
            f"bytes={FIRST_BYTES}-{len(data) - 1}",
        ]

    def test_reads_back_and_ahead_and_small_objects(self, factory: GCSStoreFactory) -> None:
        store = factory()
        data = pattern(2 * FIRST_BYTES + 999, seed=5)
        store.put("obj", data)
        store.put("small", b"0123456789")
        store.put("empty", b"")
        with store.open_reader("obj") as reader:
            for offset, n in [(FIRST_BYTES + 10, 50), (len(data) - 7, 7), (FIRST_BYTES - 5, 20)]:
                buf = memoryview(bytearray(n))
                reader.read_into(offset, buf)
                assert bytes(buf) == data[offset : offset + n]
        with store.open_reader("small") as reader:
            buf = memoryview(bytearray(4))
            reader.read_into(6, buf)
            assert (reader.size, bytes(buf)) == (10, b"6789")
            with pytest.raises(ObjectStoreError, match=r"bytes \[8, 12\) lie outside"):
                reader.read_into(8, memoryview(bytearray(4)))
        with store.open_reader("empty") as reader:
            assert reader.size == 0
        with pytest.raises(ObjectNotFoundError, match=f"{store.url}/absent"):
            store.open_reader("absent").__enter__()

    def test_blob_reader_verifies_a_raw_blob_read_in_pieces(self, factory: GCSStoreFactory) -> None:
        store = factory()
        data = pattern(2 * READ_PIECE + 77, seed=9)
        ref = put_blob(store, data, Kind.CHUNK, threshold=float("inf"))
        dest = bytearray(len(data))
        assert read_into(store, ref.digest, [(0, len(data))], lambda i: memoryview(dest))
        assert dest == data
        name = factory.full_key(blob_key(ref.digest))
        damaged = bytearray(factory.raw_get(name) or b"")
        damaged[-READ_PIECE] ^= 1
        factory.raw.bucket(factory.bucket).blob(name).delete()
        factory.raw_put(name, bytes(damaged))
        with pytest.raises(IntegrityError, match=f"{store.url}/cas/.*(corrupt)"):
            read_into(store, ref.digest, [(0, len(data))], lambda i: memoryview(dest))


def test_open_store_takes_gs_urls_with_the_emulator_from_the_environment(
    gcs_store_url: str,
) -> None:
    """``open_store("gs://...")`` finds the emulator through STORAGE_EMULATOR_HOST, unsigned."""
    with open_store(gcs_store_url) as store:
        assert isinstance(store, GCSStore)
        assert store.url == gcs_store_url
        store.check_usable()
        assert store.put("k", b"v") is True
        assert store.get("k") == b"v"
