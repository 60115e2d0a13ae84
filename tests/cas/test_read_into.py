"""Reading a raw blob straight into its destinations (``cas.blobs.read_into``): every byte of
the blob is hashed as it arrives, bytes no destination wants included; anything that does not
verify raises, naming the blob; blobs it cannot read in place are left to ``get_blob``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ckptstore.cas import Kind, blob_key, put_blob
from ckptstore.cas.blobs import READ_PIECE, MissingBlobError, get_blob, read_into
from ckptstore.cas.codec import MIN_GAIN
from ckptstore.cas.digest import digest_bytes
from ckptstore.cas.header import Header
from ckptstore.errors import IntegrityError
from ckptstore.objectstore import LocalStore
from ckptstore.objectstore.base import RandomAccess

RAW_ONLY = float("inf")  # compression threshold no codec meets


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store", fsync=False)


def stored(store: LocalStore, data: bytes) -> str:
    ref = put_blob(store, data, Kind.CHUNK, threshold=RAW_ONLY)
    assert ref.codec == "raw"
    return ref.digest


def read(store: LocalStore, digest: str, *pairs: tuple[int, bytearray]) -> Header | None:
    """``read_into`` with (offset, destination buffer) pairs."""
    targets = [(offset, len(dest)) for offset, dest in pairs]
    return read_into(store, digest, targets, lambda i: memoryview(pairs[i][1]))


def test_a_local_store_reads_in_pieces() -> None:
    assert issubclass(LocalStore, RandomAccess)


def test_destinations_get_their_ranges_and_gaps_are_verified(store: LocalStore) -> None:
    data = random_bytes(3 * READ_PIECE + 1234)
    digest = stored(store, data)
    # Two disjoint ranges, a gap between them, and unread bytes at both ends; plus one range
    # repeated exactly (equal tensors stored once) and one inside an earlier range.
    ranges = [(100, 5000), (READ_PIECE + 7, 2 * READ_PIECE), (100, 5000), (200, 300)]
    dests = [bytearray(n) for _, n in ranges]
    header = read_into(store, digest, ranges, lambda i: memoryview(dests[i]))
    assert header is not None
    assert header.raw_len == len(data)
    for (offset, n), dest in zip(ranges, dests, strict=True):
        assert dest == data[offset : offset + n]


def test_a_whole_blob_in_one_destination(store: LocalStore) -> None:
    data = random_bytes(READ_PIECE * 2)
    dest = bytearray(len(data))
    assert read(store, stored(store, data), (0, dest)) is not None
    assert dest == data


def test_a_flipped_byte_nobody_asked_for_still_fails(store: LocalStore) -> None:
    data = random_bytes(2 * READ_PIECE)
    digest = stored(store, data)
    path = store.root / blob_key(digest)
    damaged = bytearray(path.read_bytes())
    damaged[-10] ^= 0x01  # in the blob's tail, which the destination below does not cover
    os.chmod(path, 0o644)
    path.write_bytes(bytes(damaged))
    dest = bytearray(100)
    with pytest.raises(IntegrityError, match="corrupt") as caught:
        read(store, digest, (0, dest))
    assert caught.value.digest == digest  # type: ignore[attr-defined]
    assert str(store.root) in str(caught.value)


def test_a_truncated_object_fails_before_anything_is_read(store: LocalStore) -> None:
    data = random_bytes(READ_PIECE)
    digest = stored(store, data)
    path = store.root / blob_key(digest)
    os.chmod(path, 0o644)
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(IntegrityError, match="truncated or corrupt"):
        read(store, digest, (0, bytearray(10)))


def test_a_range_past_the_end_is_refused(store: LocalStore) -> None:
    digest = stored(store, random_bytes(1000))
    with pytest.raises(IntegrityError, match="past the end"):
        read_into(store, digest, [(990, 20)], lambda i: pytest.fail("allocated for a bad range"))


def test_a_missing_blob(store: LocalStore) -> None:
    digest = digest_bytes(b"never stored")
    with pytest.raises(MissingBlobError, match="missing"):
        read(store, digest, (0, bytearray(4)))


def test_what_it_cannot_read_in_place_is_left_to_get_blob(store: LocalStore) -> None:
    # A compressed blob, and ranges that partly overlap: nothing read, the caller decodes.
    compressible = bytes(4 * READ_PIECE)
    ref = put_blob(store, compressible, Kind.CHUNK, threshold=MIN_GAIN)
    assert ref.codec != "raw"
    dest = bytearray(10)
    assert read(store, ref.digest, (0, dest)) is None
    assert dest == bytes(10)
    assert get_blob(store, ref.digest)[1] == compressible
    digest = stored(store, random_bytes(1000))
    assert read(store, digest, (0, bytearray(100)), (50, bytearray(100))) is None
