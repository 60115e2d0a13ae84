"""The blob layer (DESIGN.md §4): digests, headers, codecs, packs, the bounded writer, dedup and
verify-on-read, against a real LocalStore on a tmp dir (and S3 on moto for dedup)."""

from __future__ import annotations

import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import blake3
import boto3
import numpy as np
import pytest
import torch
from component_helpers import random_bytes, save
from moto import mock_aws

from ckptstore.cas import (
    BlobWriter,
    Codec,
    Compression,
    Kind,
    MissingBlobError,
    WriterOptions,
    blob_key,
    digest_bytes,
    digest_from_key,
    get_blob,
    put_blob,
)
from ckptstore.cas.blobs import BlobRef, decode_object
from ckptstore.cas.codec import (
    BGZSTD,
    COMPRESS_BYTES_PER_S,
    FPHUFF,
    MIN_GAIN,
    RAW,
    ZSTD,
    min_gain,
)
from ckptstore.cas.header import ALIGN, MAGIC, Header, decode_header
from ckptstore.cas.pack import read_toc
from ckptstore.errors import ConfigError, IntegrityError, ObjectStoreError, UnreadableError
from ckptstore.objectstore import LocalStore, ObjectStore, S3Store
from ckptstore.objectstore.base import PutData
from ckptstore.serialize import (
    ComponentResult,
    Segment,
    load_component,
    read_index,
    write_component,
)
from ckptstore.serialize.compare import first_difference

MiB = 1 << 20
#: The documented fixed header layout (header.py), written out here independently.
FIXED = struct.Struct("<4sBBBBQQ32sII")


def sealed(fixed: bytes, params: bytes) -> bytes:
    """The fixed header fields (CRC field zero) and params, with the documented CRC-32 set."""
    crc = zlib.crc32(params, zlib.crc32(fixed))
    return fixed[:-4] + struct.pack("<I", crc) + params


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store", fsync=False)


def random_u8(n: int, seed: int = 0) -> torch.Tensor:
    return torch.frombuffer(bytearray(random_bytes(n, seed)), dtype=torch.uint8)


def bf16_weights(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)


def zipf_tokens(n: int, seed: int = 0) -> torch.Tensor:
    ids = np.clip(np.random.default_rng(seed).zipf(1.3, n), 0, 32000).astype(np.int64)
    return torch.from_numpy(ids)


def log_text(n: int) -> torch.Tensor:
    """``n`` bytes of a training log: one-byte elements that plain zstd compresses best."""
    lines = b"".join(b"step=%d loss=0.%04d lr=3e-4\n" % (i, (i * 37) % 10_000) for i in range(n))
    return torch.frombuffer(bytearray(lines[:n]), dtype=torch.uint8)


def object_path(store: LocalStore, digest: str) -> Path:
    return store.root / blob_key(digest)


def stored_objects(store: LocalStore) -> dict[str, int]:
    return {info.key: info.size for info in store.list("cas/")}


def header_of(store: LocalStore, digest: str) -> Header:
    return decode_header(memoryview(object_path(store, digest).read_bytes()), blob_key(digest))


def blobs_by(result: ComponentResult, kind: Kind) -> list[BlobRef]:
    return [b for b in result.blobs if b.kind is kind]


def chunk_digests(store: ObjectStore, result: ComponentResult, path: str) -> list[str]:
    entry = read_index(store, result.index_digest).entry(path)
    return [s.digest for s in entry.segments]


def crafted_object(
    raw: bytes,
    *,
    magic: bytes = MAGIC,
    version: int = 2,
    kind: int = 0,
    codec: int = 0,
    itemsize: int = 1,
    raw_len: int | None = None,
    stored_len: int | None = None,
    digest: str | None = None,
    params: bytes = b"",
    params_len: int | None = None,
) -> bytes:
    """A stored object written by hand from the documented layout (not by the library)."""
    fixed = FIXED.pack(
        magic,
        version,
        kind,
        codec,
        itemsize,
        len(raw) if raw_len is None else raw_len,
        len(raw) if stored_len is None else stored_len,
        bytes.fromhex((digest or digest_bytes(raw))[3:]),
        len(params) if params_len is None else params_len,
        0,
    )
    body = sealed(fixed, params)
    return body + bytes(-len(body) % ALIGN) + raw


# -- digests and keys -------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4097, 33 * MiB])
def test_digest_is_tagged_blake3_of_the_raw_bytes(size: int) -> None:
    data = random_bytes(size, seed=size)
    expected = "b3:" + blake3.blake3(data).hexdigest()
    assert digest_bytes(data) == expected
    assert digest_bytes(bytearray(data)) == expected
    assert digest_bytes(memoryview(data)) == expected


def test_one_bit_changes_the_digest() -> None:
    data = bytearray(random_bytes(1000))
    before = digest_bytes(data)
    data[500] ^= 0x01
    assert digest_bytes(data) != before


def test_blob_key_layout_and_inverse() -> None:
    digest = digest_bytes(b"hello")
    hexd = digest[3:]
    assert blob_key(digest) == f"cas/{hexd[:2]}/{hexd}"
    assert digest_from_key(blob_key(digest)) == digest


@pytest.mark.parametrize(
    "key",
    [
        "index/ab/" + "a" * 64,
        "cas/ab/" + "c" * 64,  # prefix does not match the digest's first two hex digits
        "cas/AA/" + "A" * 64,
        "cas/aa/" + "a" * 63,
        "cas/aa/aa/" + "a" * 64,
        "cas/" + "a" * 64,
    ],
)
def test_digest_from_key_rejects_non_blob_keys(key: str) -> None:
    assert digest_from_key(key) is None


@pytest.mark.parametrize(
    "digest", ["sha256:" + "a" * 64, "b3:" + "A" * 64, "b3:" + "a" * 63, "a" * 64, ""]
)
def test_malformed_digest_is_refused(digest: str) -> None:
    with pytest.raises(IntegrityError, match="malformed blob digest"):
        blob_key(digest)


# -- header and stored objects ----------------------------------------------------------------


def test_stored_object_layout_matches_the_documented_header(store: LocalStore) -> None:
    raw = random_bytes(5000)
    ref = put_blob(store, raw, Kind.CHUNK)
    on_disk = object_path(store, ref.digest).read_bytes()
    assert on_disk.startswith(b"CKPB")
    fields = FIXED.unpack_from(on_disk)
    assert fields[:-1] == (
        MAGIC,
        2,
        Kind.CHUNK,
        RAW.id,
        1,
        5000,
        5000,
        bytes.fromhex(ref.digest[3:]),
        0,
    )
    assert fields[-1] == zlib.crc32(on_disk[: FIXED.size - 4] + bytes(4))
    # Padded to 64 bytes so a raw payload is aligned for any dtype.
    assert on_disk[FIXED.size : ALIGN] == bytes(ALIGN - FIXED.size)
    assert on_disk[ALIGN:] == raw
    assert ref.uploaded
    assert ref.stored_bytes == len(on_disk) == ALIGN + 5000
    assert ref.logical_bytes == 5000


@pytest.mark.parametrize(
    ("raw", "itemsize", "float_like", "codec"),
    [
        (random_bytes(300_000), 1, False, RAW),
        (b"step=1 loss=0.25\n" * 20_000, 1, False, ZSTD),
        # token ids: their byte planes compress better than their bytes in a row
        (zipf_tokens(40_000).numpy().tobytes(), 8, False, BGZSTD),
        (bf16_weights(150_000).view(torch.uint8).numpy().tobytes(), 2, True, FPHUFF),
        (b"", 1, False, RAW),
    ],
    ids=["raw", "zstd", "bgzstd", "fphuff", "empty"],
)
def test_every_codec_round_trips_through_decode_object(
    store: LocalStore, raw: bytes, itemsize: int, float_like: bool, codec: Codec
) -> None:
    ref = put_blob(store, raw, Kind.CHUNK, itemsize=itemsize, float_like=float_like)
    assert ref.codec == codec.name
    stored = store.get(blob_key(ref.digest))
    header, decoded = decode_object(memoryview(stored), ref.digest, "test")
    assert bytes(decoded) == raw
    assert header.codec is codec
    assert header.raw_len == len(raw)
    assert header.size % ALIGN == 0
    assert header.size + header.stored_len == len(stored)
    if codec is FPHUFF:
        assert header.itemsize == itemsize
        assert len(header.params) == 2
    if codec is not RAW:
        assert header.stored_len < len(raw) * (1 - MIN_GAIN)
    _, fetched = get_blob(store, ref.digest)
    assert bytes(fetched) == raw


def test_put_blob_of_an_existing_blob_uploads_nothing(store: LocalStore) -> None:
    raw = random_bytes(10_000)
    first = put_blob(store, raw, Kind.CHUNK)
    before = object_path(store, first.digest).stat()
    again = put_blob(store, raw, Kind.CHUNK)
    assert first.uploaded
    assert not again.uploaded
    assert again.digest == first.digest
    assert again.stored_bytes == first.stored_bytes
    assert object_path(store, first.digest).stat().st_mtime_ns == before.st_mtime_ns


BAD_HEADERS: dict[str, dict[str, Any]] = {
    "bad magic": {"magic": b"PKZIP"[:4]},
    "itemsize zero": {"itemsize": 0},
    "params too long": {"params_len": 1 << 20},
    "raw length absurd": {"raw_len": 1 << 60},
    "stored length too long": {"stored_len": 1 << 40},
    "stored length too short": {"stored_len": 10},
    "raw length differs": {"raw_len": 4095},
    "digest of another blob": {"digest": digest_bytes(b"something else")},
    "byte-grouping table missing": {"codec": 2, "itemsize": 2},
}


@pytest.mark.parametrize("fields", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_get_blob_rejects_a_bad_header(store: LocalStore, fields: dict[str, Any]) -> None:
    raw = random_bytes(4096)
    digest = digest_bytes(raw)
    key = blob_key(digest)
    store.put(key, crafted_object(raw, **fields))
    with pytest.raises(IntegrityError) as info:
        get_blob(store, digest)
    assert key in str(info.value)


#: Sealed headers (their CRC holds) naming what this ckptstore does not know: not damage.
UNREADABLE_HEADERS: dict[str, dict[str, Any]] = {
    "future version": {"version": 3},
    "version zero": {"version": 0},
    "unknown kind": {"kind": 7},
    "unknown codec": {"codec": 9},
}


@pytest.mark.parametrize("fields", UNREADABLE_HEADERS.values(), ids=UNREADABLE_HEADERS.keys())
def test_get_blob_cannot_read_a_header_it_does_not_know(
    store: LocalStore, fields: dict[str, Any]
) -> None:
    raw = random_bytes(4096)
    digest = digest_bytes(raw)
    key = blob_key(digest)
    store.put(key, crafted_object(raw, **fields))
    with pytest.raises(UnreadableError) as info:
        get_blob(store, digest)
    assert key in str(info.value)
    assert not isinstance(info.value, IntegrityError)


def test_get_blob_accepts_the_hand_written_header(store: LocalStore) -> None:
    """The control for the bad-header cases: the same object with nothing changed reads back."""
    raw = random_bytes(4096)
    digest = digest_bytes(raw)
    store.put(blob_key(digest), crafted_object(raw))
    header, data = get_blob(store, digest)
    assert bytes(data) == raw
    assert header.kind is Kind.CHUNK


@pytest.mark.parametrize("size", [0, 10, FIXED.size - 1])
def test_get_blob_rejects_an_object_too_short_for_a_header(store: LocalStore, size: int) -> None:
    digest = digest_bytes(b"x")
    store.put(blob_key(digest), b"C" * size)
    with pytest.raises(IntegrityError, match=blob_key(digest)):
        get_blob(store, digest)


def test_missing_blob_is_an_integrity_and_file_not_found_error(store: LocalStore) -> None:
    digest = digest_bytes(b"never stored")
    with pytest.raises(MissingBlobError) as info:
        get_blob(store, digest)
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, IntegrityError)
    assert blob_key(digest) in str(info.value)
    assert store.url in str(info.value)


# -- codec policy -----------------------------------------------------------------------------


def mixed_state(n: int = 600_000) -> dict[str, Any]:
    return {
        "weights": bf16_weights(n),
        "tokens": zipf_tokens(n // 4),
        "text": log_text(n),
        "noise": random_u8(2 * n),
        "zeros": torch.zeros(n // 2, dtype=torch.float32),
        "small": {f"b{i}": torch.full((16,), float(i)) for i in range(8)},
    }


def codecs_by_path(store: LocalStore, result: ComponentResult) -> dict[str, set[Codec]]:
    """Codec of each entry's blobs, read from the stored headers (not from the receipt)."""
    index = read_index(store, result.index_digest)
    return {e.path: {header_of(store, s.digest).codec for s in e.segments} for e in index.entries}


def test_compression_never_stores_every_blob_raw(store: LocalStore) -> None:
    state = mixed_state()
    result = save(store, state, compression="never", chunk_bytes=MiB)
    assert {b.codec for b in result.blobs} == {RAW.name}
    for digest in {b.digest for b in result.blobs}:
        header = header_of(store, digest)
        assert header.codec is RAW
        assert header.stored_len == header.raw_len
    assert first_difference(state, load_component(store, result.index_digest)) is None


def test_compression_always_picks_the_codec_by_content(store: LocalStore) -> None:
    state = mixed_state()
    result = save(store, state, compression="always", chunk_bytes=MiB)
    codecs = codecs_by_path(store, result)
    assert codecs["weights"] == {FPHUFF}
    assert codecs["tokens"] == {BGZSTD}  # int64 ids: their high bytes are nearly constant
    assert codecs["text"] == {ZSTD}
    assert codecs["noise"] == {RAW}
    assert codecs["zeros"] <= {ZSTD, FPHUFF}
    for digest in chunk_digests(store, result, "weights"):
        header = header_of(store, digest)
        assert header.itemsize == 2
        # bf16: the exponent plane (half the bytes) shrinks to about a third.
        assert header.stored_len < 0.7 * header.raw_len
    for digest in chunk_digests(store, result, "tokens"):
        header = header_of(store, digest)
        assert header.stored_len < header.raw_len // 2
    assert first_difference(state, load_component(store, result.index_digest)) is None


def test_compression_auto_on_local_disk_keeps_fp32_raw_but_compresses_zeros(
    store: LocalStore,
) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"fp32": torch.randn(400_000, generator=g), "zeros": torch.zeros(400_000)}
    assert store.write_bandwidth_hint == 1.5e9
    result = save(store, state, compression="auto", chunk_bytes=MiB)
    codecs = codecs_by_path(store, result)
    assert codecs["fp32"] == {RAW}
    assert RAW not in codecs["zeros"]
    zeros_stored = sum(
        header_of(store, d).stored_len for d in chunk_digests(store, result, "zeros")
    )
    assert zeros_stored < 400_000 * 4 // 100
    assert first_difference(state, load_component(store, result.index_digest)) is None


def test_min_gain_follows_the_policy_and_the_store_bandwidth() -> None:
    assert min_gain(Compression.NEVER, 1e9) == float("inf")
    assert min_gain(Compression.ALWAYS, 1e12) == MIN_GAIN
    assert min_gain(Compression.AUTO, 1.5e9) == pytest.approx(0.5)
    assert min_gain(Compression.AUTO, 5e8) == pytest.approx(5e8 / COMPRESS_BYTES_PER_S)
    assert min_gain(Compression.AUTO, 1e6) == MIN_GAIN


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"compression": "zip"}, "compression"),
        ({"chunk_bytes": MiB - 1}, "chunk_bytes"),
        ({"pack_threshold": 2 * MiB, "pack_bytes": MiB}, "pack_threshold"),
        ({"max_workers": -1}, "max_workers"),
        ({"max_inflight_bytes": 1000}, "max_inflight_bytes"),
    ],
)
def test_writer_options_are_validated(options: dict[str, Any], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        WriterOptions(**options)


# -- verify on read: corruption of each kind of blob ------------------------------------------


def corruptible_state() -> dict[str, Any]:
    """Small, so that one load is a few milliseconds; every kind of blob appears."""
    return {
        "noise": random_u8(40_000),
        "tokens": zipf_tokens(8_000),
        "text": log_text(40_000),
        "weights": bf16_weights(30_000),
        "small": [torch.arange(i, i + 7) for i in range(6)],
    }


def pick_blob(store: LocalStore, result: ComponentResult, which: str) -> str:
    if which == "index":
        return result.index_digest
    if which == "pack":
        (pack,) = blobs_by(result, Kind.PACK)
        return pack.digest
    path = {
        "raw chunk": "noise",
        "zstd chunk": "text",
        "bgzstd chunk": "tokens",
        "fphuff chunk": "weights",
    }[which]
    (digest,) = chunk_digests(store, result, path)
    expected = {"noise": RAW, "text": ZSTD, "tokens": BGZSTD, "weights": FPHUFF}[path]
    assert header_of(store, digest).codec is expected
    return digest


BLOB_KINDS = ["raw chunk", "zstd chunk", "bgzstd chunk", "fphuff chunk", "pack", "index"]


@pytest.fixture
def saved(store: LocalStore) -> tuple[LocalStore, dict[str, Any], ComponentResult]:
    state = corruptible_state()
    result = save(store, state, compression="always", pack_threshold=4096)
    return store, state, result


@pytest.mark.parametrize("which", BLOB_KINDS)
def test_flipped_payload_byte_is_detected(
    saved: tuple[LocalStore, dict[str, Any], ComponentResult], which: str
) -> None:
    store, state, result = saved
    digest = pick_blob(store, result, which)
    path = object_path(store, digest)
    original = path.read_bytes()
    start = header_of(store, digest).size
    positions = sorted({start, len(original) - 1, *range(start, len(original), 997)})
    for pos in positions:
        damaged = bytearray(original)
        damaged[pos] ^= 0x5A
        path.write_bytes(damaged)
        with pytest.raises(IntegrityError) as info:
            load_component(store, result.index_digest)
        assert blob_key(digest) in str(info.value), f"byte {pos}"
    path.write_bytes(original)
    assert first_difference(state, load_component(store, result.index_digest)) is None


@pytest.mark.parametrize("which", BLOB_KINDS)
def test_flipped_header_byte_fails_or_changes_nothing(
    saved: tuple[LocalStore, dict[str, Any], ComponentResult], which: str
) -> None:
    """Header padding and fields a codec ignores may flip harmlessly; nothing else may."""
    store, state, result = saved
    digest = pick_blob(store, result, which)
    path = object_path(store, digest)
    original = path.read_bytes()
    size = header_of(store, digest).size
    errors: dict[int, str] = {}
    for pos in range(size):
        damaged = bytearray(original)
        damaged[pos] ^= 0xFF
        path.write_bytes(damaged)
        try:
            loaded = load_component(store, result.index_digest)
        except IntegrityError as exc:
            errors[pos] = str(exc)
        else:
            assert first_difference(state, loaded) is None, f"byte {pos} silently changed data"
    unnamed = {pos: msg for pos, msg in errors.items() if blob_key(digest) not in msg}
    assert not unnamed, "errors that do not name the key"
    # Every byte of magic, version, kind, codec, lengths, digest and codec table is checked
    # (only the element size of a blob that is not byte-grouped goes unused).
    assert len(errors) >= FIXED.size - 1


@pytest.mark.parametrize("which", BLOB_KINDS)
def test_truncated_object_is_detected(
    saved: tuple[LocalStore, dict[str, Any], ComponentResult], which: str
) -> None:
    store, _, result = saved
    digest = pick_blob(store, result, which)
    path = object_path(store, digest)
    original = path.read_bytes()
    for cut in (len(original) - 1, len(original) // 2, ALIGN, 16, 0):
        path.write_bytes(original[:cut])
        with pytest.raises(IntegrityError) as info:
            load_component(store, result.index_digest)
        assert blob_key(digest) in str(info.value), f"cut to {cut} bytes"


@pytest.mark.parametrize("which", BLOB_KINDS)
def test_deleted_object_is_a_missing_blob(
    saved: tuple[LocalStore, dict[str, Any], ComponentResult], which: str
) -> None:
    store, _, result = saved
    digest = pick_blob(store, result, which)
    store.delete([blob_key(digest)])
    with pytest.raises(MissingBlobError) as info:
        load_component(store, result.index_digest)
    assert isinstance(info.value, FileNotFoundError)
    assert blob_key(digest) in str(info.value)


def test_object_swapped_for_another_valid_blob_is_detected(
    saved: tuple[LocalStore, dict[str, Any], ComponentResult],
) -> None:
    """A well-formed object under the wrong key (a botched copy) must not be trusted."""
    store, _, result = saved
    victim = pick_blob(store, result, "raw chunk")
    other = pick_blob(store, result, "zstd chunk")
    object_path(store, victim).write_bytes(object_path(store, other).read_bytes())
    with pytest.raises(IntegrityError, match=blob_key(victim)):
        load_component(store, result.index_digest)


# -- dedup ------------------------------------------------------------------------------------


def dedup_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * MiB // 4 + 1000, generator=g),  # ~3 MiB: four 1 MiB chunks
        "other": torch.randn(MiB // 2, generator=g),  # 2 MiB: two chunks
        "small": {f"b{i}": torch.randn(32, generator=g) for i in range(10)},  # one pack
        "step": 7,
    }


def test_same_state_saved_twice_uploads_nothing_the_second_time(store: LocalStore) -> None:
    state = dedup_state()
    first = save(store, state, chunk_bytes=MiB)
    objects = stored_objects(store)
    assert first.uploaded_bytes == sum(objects.values()) > 3 * MiB
    # A fresh writer has no memory of the first save: the store itself decides (HEAD).
    second = save(store, state, chunk_bytes=MiB)
    assert second.uploaded_bytes == 0
    assert not any(b.uploaded for b in second.blobs)
    assert stored_objects(store) == objects
    assert second.index_digest == first.index_digest
    assert {b.digest for b in second.blobs} == {b.digest for b in first.blobs}
    assert second.stored_bytes == first.stored_bytes
    # The same writer used twice: its own cache answers.
    with BlobWriter(store, WriterOptions(chunk_bytes=MiB)) as writer:
        third = write_component(writer, state)
        fourth = write_component(writer, state)
    assert third.uploaded_bytes == fourth.uploaded_bytes == 0
    assert stored_objects(store) == objects


def test_states_differing_in_one_tensor_differ_only_in_its_changed_chunk(
    store: LocalStore,
) -> None:
    a = dedup_state()
    b = dedup_state()
    b["big"] = a["big"].clone()
    b["big"][MiB // 4 + 5] += 1.0  # inside the second 1 MiB chunk only
    ra = save(store, a, chunk_bytes=MiB)
    before = stored_objects(store)
    rb = save(store, b, chunk_bytes=MiB)
    big_a, big_b = chunk_digests(store, ra, "big"), chunk_digests(store, rb, "big")
    assert len(big_a) == len(big_b) == 4
    assert [x == y for x, y in zip(big_a, big_b, strict=True)] == [True, False, True, True]
    da, db = {x.digest for x in ra.blobs}, {x.digest for x in rb.blobs}
    assert da - db == {big_a[1], ra.index_digest}
    assert db - da == {big_b[1], rb.index_digest}
    (pack_a,), (pack_b,) = blobs_by(ra, Kind.PACK), blobs_by(rb, Kind.PACK)
    assert pack_a.digest == pack_b.digest
    uploaded = {x.digest for x in rb.blobs if x.uploaded}
    assert uploaded == {big_b[1], rb.index_digest}
    assert set(stored_objects(store)) - set(before) == {blob_key(d) for d in uploaded}
    assert rb.uploaded_bytes == sum(stored_objects(store)[blob_key(d)] for d in uploaded)


def test_distinct_weights_never_share_a_digest(store: LocalStore) -> None:
    base = random_u8(64 * 1024)
    tensors = {}
    for i in range(48):
        t = base.clone()
        t[i * 1000] ^= 1 << (i % 8)  # one bit differs between any two of them
        tensors[f"w{i}"] = t
    tensors["base"] = base
    result = save(store, tensors, pack_threshold=0)
    index = read_index(store, result.index_digest)
    digests = [s.digest for e in index.entries for s in e.segments]
    assert len(digests) == len(set(digests)) == 49
    assert result.index_digest not in digests
    # The same holds for small tensors gathered into packs: one flipped bit, another pack.
    small = {f"s{i}": torch.arange(20) for i in range(5)}
    flipped = {k: v.clone() for k, v in small.items()}
    flipped["s3"][7] ^= 1
    (p1,) = blobs_by(save(store, small), Kind.PACK)
    (p2,) = blobs_by(save(store, flipped), Kind.PACK)
    assert p1.digest != p2.digest


def test_identical_tensors_in_one_state_are_stored_once(store: LocalStore) -> None:
    t = random_u8(3 * MiB)
    state = {"a": t, "b": t.clone(), "c": t}
    result = save(store, state, chunk_bytes=MiB, pack_threshold=0)
    a, b, c = (chunk_digests(store, result, p) for p in "abc")
    assert a == b == c
    assert len(set(a)) == 3
    assert len(stored_objects(store)) == 3 + 1  # three chunks and the index
    assert first_difference(state, load_component(store, result.index_digest)) is None


def test_dedup_on_s3_issues_no_put_the_second_time() -> None:
    with mock_aws():
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="ckpt-dedup")
        store = S3Store("ckpt-dedup", "run-1", region_name="us-east-1")
        puts: list[str] = []
        store.client.meta.events.register(
            "before-call.s3.PutObject", lambda params, **_: puts.append(params["url_path"])
        )
        store.client.meta.events.register(
            "before-call.s3.CreateMultipartUpload",
            lambda params, **_: puts.append(params["url_path"]),
        )
        try:
            state = dedup_state()
            first = save(store, state, chunk_bytes=MiB)
            assert len(puts) == len(first.blobs) > 0
            keys = {info.key for info in store.list("cas/")}
            assert keys == {blob_key(b.digest) for b in first.blobs}
            puts.clear()
            second = save(store, state, chunk_bytes=MiB)
            assert puts == []
            assert second.uploaded_bytes == 0
            assert {info.key for info in store.list("cas/")} == keys
            loaded = load_component(store, second.index_digest)
            assert first_difference(state, loaded) is None
        finally:
            store.close()


# -- the writer: bounded memory, known blobs, packs -------------------------------------------


class ConcurrencyStore(LocalStore):
    """A real LocalStore whose ``put`` records how many calls run at once."""

    def __init__(self, root: Path, hold: float = 0.03) -> None:
        super().__init__(root, fsync=False)
        self._hold = hold
        self._lock = threading.Lock()
        self.running = 0
        self.max_running = 0
        self.puts = 0

    def put(self, key: str, data: PutData) -> bool:
        with self._lock:
            self.running += 1
            self.puts += 1
            self.max_running = max(self.max_running, self.running)
        try:
            time.sleep(self._hold)
            return super().put(key, data)
        finally:
            with self._lock:
                self.running -= 1


@pytest.mark.parametrize(("budget_mib", "bound"), [(2, 2), (3, 3), (64, None)])
def test_writer_bounds_the_bytes_in_flight(
    tmp_path: Path, budget_mib: int, bound: int | None
) -> None:
    store = ConcurrencyStore(tmp_path / "store")
    state = {"big": random_u8(12 * MiB)}
    options = WriterOptions(
        chunk_bytes=MiB, max_inflight_bytes=budget_mib * MiB, max_workers=8, compression="never"
    )
    with BlobWriter(store, options) as writer:
        result = write_component(writer, state)
    assert store.puts == 12 + 1
    if bound is None:
        # The control: without a tight budget the pool really runs puts side by side, so
        # the bounds asserted above are not an artefact of a serial pipeline.
        assert store.max_running > 3
    else:
        assert 1 <= store.max_running <= bound
    assert first_difference(state, load_component(store, result.index_digest)) is None


def test_writer_runs_a_blob_larger_than_the_budget_alone(tmp_path: Path) -> None:
    store = ConcurrencyStore(tmp_path / "store")
    options = WriterOptions(max_inflight_bytes=MiB, max_workers=8, compression="never")
    with BlobWriter(store, options) as writer:
        blobs = [memoryview(random_bytes(3 * MiB, seed=i)) for i in range(4)]
        futures = [writer.submit(b, Kind.CHUNK, keepalive=b) for b in blobs]
        refs = [f.result() for f in futures]
    assert store.max_running == 1
    assert [r.digest for r in refs] == [digest_bytes(b) for b in blobs]
    assert all(r.uploaded for r in refs)


def test_writer_skips_blobs_the_manifest_knows(store: LocalStore) -> None:
    state = {"a": random_u8(2 * MiB, seed=1), "b": random_u8(2 * MiB, seed=2)}
    known = {digest_bytes(state["a"].numpy())}
    with BlobWriter(store, WriterOptions(), known=known.__contains__) as writer:
        result = write_component(writer, state)
    refs = {b.digest: b for b in result.blobs}
    (a_digest,) = known
    assert not refs[a_digest].uploaded
    assert blob_key(a_digest) not in stored_objects(store)
    assert refs[digest_bytes(state["b"].numpy())].uploaded
    assert set(stored_objects(store)) == {blob_key(d) for d in refs if d != a_digest}


class FailingStore(LocalStore):
    """A real LocalStore whose ``put`` fails from the ``fail_from``-th call on (a full disk)."""

    def __init__(self, root: Path, fail_from: int) -> None:
        super().__init__(root, fsync=False)
        self.fail_from = fail_from
        self._lock = threading.Lock()
        self.calls = 0

    def put(self, key: str, data: PutData) -> bool:
        with self._lock:
            self.calls += 1
            fail = self.calls >= self.fail_from
        if fail:
            raise ObjectStoreError(f"writing {self.url}/{key} failed: No space left on device")
        return super().put(key, data)


def test_a_failed_upload_surfaces_and_no_index_is_written(tmp_path: Path) -> None:
    store = FailingStore(tmp_path / "store", fail_from=3)
    state = {"big": random_u8(6 * MiB)}
    options = WriterOptions(chunk_bytes=MiB, max_inflight_bytes=2 * MiB, max_workers=4)
    with BlobWriter(store, options) as writer:
        with pytest.raises(ObjectStoreError, match="No space left"):
            write_component(writer, state)
        kinds = {header_of(store, digest_from_key(k) or "").kind for k in stored_objects(store)}
        assert Kind.INDEX not in kinds
        # The failed tasks gave their bytes back to the budget: the writer still works.
        store.fail_from = 10**9
        blob = memoryview(random_bytes(2 * MiB, seed=9))
        ref = writer.submit(blob, Kind.CHUNK, keepalive=blob).result(timeout=10)
    assert ref.uploaded


class SlowPayloadStore(LocalStore):
    """A real LocalStore whose ``put`` of one particular buffer is slow to start."""

    def __init__(self, root: Path, slow_address: int) -> None:
        super().__init__(root, fsync=False)
        self.slow_address = slow_address

    def put(self, key: str, data: PutData) -> bool:
        parts = data if isinstance(data, list) else [data]
        if any(
            memoryview(p).nbytes and np.frombuffer(p, np.uint8).ctypes.data == self.slow_address
            for p in parts
        ):
            time.sleep(0.3)
        return super().put(key, data)


def test_uploaded_bytes_counts_a_blob_uploaded_by_a_later_duplicate(tmp_path: Path) -> None:
    a = random_u8(2 * MiB, seed=10)
    store = SlowPayloadStore(tmp_path / "store", slow_address=a.data_ptr())
    result = save(store, {"a": a, "b": a.clone()}, compression="never")
    assert sum(stored_objects(store).values()) == result.uploaded_bytes


def test_pack_layout_and_table_of_contents(store: LocalStore) -> None:
    g = torch.Generator().manual_seed(3)
    state = {f"layer{i}": torch.randn(1 + (i * 37) % 300, generator=g) for i in range(120)}
    state["blob"] = b"raw bytes in a pack"
    result = save(store, state, pack_threshold=4096, pack_bytes=16 * 1024)
    packs = blobs_by(result, Kind.PACK)
    assert len(packs) >= 4
    index = read_index(store, result.index_digest)
    entries = {e.path: e for e in index.entries}
    named: list[str] = []
    for pack in packs:
        header, raw = get_blob(store, pack.digest)
        assert header.kind is Kind.PACK
        toc = read_toc(raw, "test")
        for item in toc:
            named.append(item.name)
            assert item.offset % 8 == 0
            entry = entries[item.name]
            assert entry.segments == (Segment(pack.digest, item.offset, item.length),)
            value = state[item.name]
            expected = value if isinstance(value, bytes) else value.numpy().tobytes()
            assert bytes(raw[item.offset : item.offset + item.length]) == expected
        assert max(i.offset + i.length for i in toc) <= 16 * 1024
    assert sorted(named) == sorted(state)
    assert first_difference(state, load_component(store, result.index_digest)) is None


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"abc",
        b"x" * 100 + b"\x05\x00\x00\x00CKTC",
        b"[]\x02\x00\x00\x00CKTX",
        b"abcd" + b'[["a",0,999]]' + struct.pack("<I4s", 13, b"CKTC"),
        b"abcd" + b'[["a",-1,2]]' + struct.pack("<I4s", 12, b"CKTC"),
    ],
)
def test_read_toc_rejects_what_is_not_a_pack(raw: bytes) -> None:
    with pytest.raises(IntegrityError, match="where"):
        read_toc(memoryview(raw), "where")
