"""How S3Store moves bytes: what it sends with each body, how a download lands in memory, and
that a body changed on its way is still caught (by the blob's BLAKE3 digest, not by S3).

Requests are observed (and, for the corruption tests, altered) through botocore's own events on
the store's client, with moto answering in-process.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from botocore.awsrequest import AWSPreparedRequest

from ckptstore import ShardWriter, open_run
from ckptstore.cas import Kind, WriterOptions, put_blob
from ckptstore.cas.blobs import get_blob
from ckptstore.cas.digest import blob_key
from ckptstore.cas.header import MAX_HEADER
from ckptstore.errors import IntegrityError
from ckptstore.objectstore import S3Store
from ckptstore.testing.factories import MULTIPART_OPTIONS, MiB, S3StoreFactory, pattern

BIG = 12 * MiB + 7  # three parts under MULTIPART_OPTIONS
#: Headers through which botocore sends a checksum of the body (MD5 or a flexible checksum).
CHECKSUM_HEADERS = (
    "content-md5",
    "x-amz-checksum-",
    "x-amz-sdk-checksum-algorithm",
    "x-amz-trailer",
)


@pytest.fixture
def factory(moto_store_factory: S3StoreFactory) -> S3StoreFactory:
    return moto_store_factory


class Recorder:
    """Records the headers and body of every upload request a store sends."""

    def __init__(self, store: S3Store) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        for operation in ("PutObject", "UploadPart"):
            store.client.meta.events.register(f"before-send.s3.{operation}", self)

    def __call__(self, request: AWSPreparedRequest, event_name: str, **kwargs: Any) -> None:
        body = request.body
        data = body.read() if hasattr(body, "read") else bytes(body or b"")
        if hasattr(body, "seek"):
            body.seek(0)
        headers = {
            k.lower(): v.decode() if isinstance(v, bytes) else str(v)
            for k, v in request.headers.items()
        }
        self.requests.append((event_name.rsplit(".", 1)[1], headers, data))


@pytest.mark.parametrize("size", [1000, BIG], ids=["single-put", "multipart"])
def test_bodies_go_unsigned_and_without_checksums(factory: S3StoreFactory, size: int) -> None:
    # The blob's BLAKE3 digest guards the bytes; botocore hashing each body again (SHA-256
    # for the signature, CRC32 or MD5 for a checksum) would cost CPU for nothing.
    store = factory(**MULTIPART_OPTIONS)
    recorder = Recorder(store)
    data = pattern(size, seed=1)
    assert store.put("cas/x", [data[:10], data[10:]]) is True
    assert recorder.requests, "no upload request seen"
    for operation, headers, _ in recorder.requests:
        assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD", operation
        assert not [h for h in headers if h.startswith(CHECKSUM_HEADERS)], (operation, headers)
    assert bytes(store.get("cas/x")) == data


def test_sign_payload_signs_every_body(factory: S3StoreFactory) -> None:
    # region_name makes the factory build the client through S3Store's own constructor.
    store = factory(sign_payload=True, region_name="us-east-1", **MULTIPART_OPTIONS)
    recorder = Recorder(store)
    data = pattern(BIG, seed=2)
    assert store.put("cas/x", data) is True
    assert [op for op, _, _ in recorder.requests] == ["UploadPart"] * 3
    for _, headers, body in recorder.requests:
        assert headers["x-amz-content-sha256"] == hashlib.sha256(body).hexdigest()


def test_default_chunks_go_up_in_one_put() -> None:
    # One request per blob of the default writer: parts would only add requests (CPU) while
    # the blob writer already keeps many uploads in flight.
    store = S3Store("bucket", endpoint_url="http://127.0.0.1:9")
    try:
        assert WriterOptions().chunk_bytes + MAX_HEADER <= store.multipart_threshold
    finally:
        store.close()


class BodySpy:
    """Stands in for a GetObject response body; records every read into a caller's buffer."""

    def __init__(self, body: Any, corrupt_at: int | None = None) -> None:
        self._body = body
        self._offset = 0
        self._corrupt_at = corrupt_at
        self.targets: list[memoryview] = []
        self.whole_reads = 0

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)
        self.targets.append(view)
        n: int = self._body.readinto(view)
        at = self._corrupt_at
        if at is not None and self._offset <= at < self._offset + n:
            view[at - self._offset] ^= 0x01
        self._offset += n
        return n

    def read(self, amt: int | None = None) -> bytes:
        self.whole_reads += 1
        data: bytes = self._body.read(amt)
        return data

    def close(self) -> None:
        self._body.close()


def spy_on_gets(store: S3Store, corrupt_at: int | None = None) -> list[BodySpy]:
    """Wraps the body of every GetObject response the store receives in a BodySpy."""
    spies: list[BodySpy] = []

    def wrap(parsed: dict[str, Any], **kwargs: Any) -> None:
        spies.append(BodySpy(parsed["Body"], corrupt_at))
        parsed["Body"] = spies[-1]

    store.client.meta.events.register("after-call.s3.GetObject", wrap)
    return spies


def test_get_view_reads_the_body_straight_into_one_buffer(factory: S3StoreFactory) -> None:
    store = factory()
    data = pattern(3 * MiB + 5, seed=3)
    store.put("cas/x", data)
    spies = spy_on_gets(store)
    view = store.get_view("cas/x")
    (spy,) = spies
    assert bytes(view) == data
    assert not view.readonly  # the blob reader may hand it on as a tensor's memory
    assert spy.whole_reads == 0
    # Every read went into the returned buffer itself (no staging copy of ours), in steps of
    # at most 1 MiB, so urllib3's per-read temporaries stay small and cache-resident.
    assert len(spy.targets) >= 4
    assert all(t.obj is view.obj for t in spy.targets)
    assert max(t.nbytes for t in spy.targets) <= 1 * MiB


@pytest.fixture
def blob(factory: S3StoreFactory) -> tuple[S3Store, str, bytes]:
    store = factory()
    raw = pattern(2 * MiB, seed=4)
    ref = put_blob(store, raw, Kind.CHUNK)
    return store, ref.digest, raw


def test_a_body_corrupted_on_its_way_down_fails_the_digest(
    blob: tuple[S3Store, str, bytes],
) -> None:
    store, digest, _ = blob
    spy_on_gets(store, corrupt_at=1 * MiB + 17)
    with pytest.raises(IntegrityError) as caught:
        get_blob(store, digest)
    assert f"{store.url}/{blob_key(digest)}" in str(caught.value)
    assert "corrupt" in str(caught.value)


def test_a_body_corrupted_on_its_way_up_is_stored_but_caught_on_read(
    factory: S3StoreFactory,
) -> None:
    # Without a signed payload the server cannot tell a body changed in transit; the blob's
    # digest, checked on every read, does.
    store = factory()
    raw = pattern(2 * MiB, seed=5)

    def flip_a_bit(request: AWSPreparedRequest, **kwargs: Any) -> None:
        body = bytearray(request.body.read())
        body[len(body) // 2] ^= 0x01
        request.body = bytes(body)

    store.client.meta.events.register("before-send.s3.PutObject", flip_a_bit)
    ref = put_blob(store, raw, Kind.CHUNK)
    store.client.meta.events.unregister("before-send.s3.PutObject", flip_a_bit)
    with pytest.raises(IntegrityError, match="corrupt"):
        get_blob(store, ref.digest)


# -- requests per blob ------------------------------------------------------------------------


class Requests:
    """Counts the requests a store sends for blob objects, by operation."""

    def __init__(self, store: S3Store) -> None:
        self.seen: list[str] = []
        store.client.meta.events.register("before-send.s3", self)

    def __call__(self, request: AWSPreparedRequest, event_name: str, **kwargs: Any) -> None:
        if "/cas/" in request.url:
            self.seen.append(event_name.rsplit(".", 1)[1])

    def count(self, operation: str) -> int:
        return self.seen.count(operation)


def weights(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(300_000, generator=gen) for i in range(3)}}


def test_a_run_sends_new_blobs_without_asking_the_store_first(
    factory: S3StoreFactory, tmp_path: Path
) -> None:
    # The run knows its live blobs from the manifest, and a PUT never overwrites on S3: a HEAD
    # before each new blob would be one more request for every blob of every save.
    store = factory()
    with open_run("r", db=tmp_path / "m.db", store=store, async_save=False) as run:
        requests = Requests(store)
        first = run.save(1, weights(1)).wait()
        sent = requests.count("PutObject")
        assert sent >= 3  # three 1.2 MB tensors, each a blob of its own, and the index
        assert first.uploaded_bytes == first.stored_bytes
        # The commit checks that every new blob exists (one HEAD each); nothing asks before.
        assert requests.count("HeadObject") == sent
        second = run.save(2, weights(1)).wait()  # the same state: every blob is live
        assert requests.count("PutObject") == sent
        assert second.uploaded_bytes == 0


def test_a_blob_already_stored_but_not_live_is_refused_and_counted_as_kept(
    factory: S3StoreFactory, tmp_path: Path
) -> None:
    # A failed save can leave blobs that no checkpoint references; the next save's PUT of the
    # same bytes is refused (If-None-Match) and the object already there is the one kept.
    store = factory()
    state = weights(2)
    with open_run("r", db=tmp_path / "m.db", store=store, async_save=False) as run:
        tensor = state["model"]["w0"]
        orphan = put_blob(store, tensor.numpy().view("uint8").reshape(-1), Kind.CHUNK)
        assert orphan.uploaded
        info = run.save(1, state).wait()
        assert info.status == "committed"
        assert 0 < info.uploaded_bytes < info.stored_bytes
        assert info.stored_bytes - info.uploaded_bytes == orphan.stored_bytes
        loaded = run.load(1).state["model"]
    assert all(torch.equal(loaded[k], state["model"][k]) for k in state["model"])


def test_a_shard_writer_without_a_manifest_still_asks_first(factory: S3StoreFactory) -> None:
    # Without the live blobs it can only learn what is stored by asking: an unchanged blob of
    # the next save is found by a HEAD, not sent again.
    store = factory()
    with ShardWriter(store) as writer:
        requests = Requests(store)
        writer.save({"policy": weights(3)}).receipts()
        sent = requests.count("PutObject")
        assert sent >= 3
        writer.save({"policy": weights(3)}).receipts()
        assert requests.count("PutObject") == sent
