"""Reading a raw blob straight into its destinations (``cas.blobs.read_into``): every byte of
the blob is hashed as it arrives, bytes no destination wants included; anything that does not
verify raises, naming the blob; blobs it cannot read in place are left to ``get_blob``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from component_helpers import save

from ckptstore.cas import Kind, blob_key, put_blob
from ckptstore.cas.blobs import READ_PIECE, MissingBlobError, get_blob, read_into
from ckptstore.cas.codec import MIN_GAIN
from ckptstore.cas.digest import digest_bytes
from ckptstore.cas.header import Header
from ckptstore.errors import IntegrityError
from ckptstore.objectstore import LocalStore
from ckptstore.objectstore.base import RandomAccess
from ckptstore.serialize import load_component, load_paths

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


def test_a_range_past_the_end_is_left_to_get_blob(store: LocalStore) -> None:
    # Nothing allocated; get_blob verifies the blob whole, so the caller can tell a bad range
    # (the index's fault) from a damaged blob.
    digest = stored(store, random_bytes(1000))
    bad_range = read_into(
        store, digest, [(990, 20)], lambda i: pytest.fail("allocated for a bad range")
    )
    assert bad_range is None


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


class NoWholeReads(LocalStore):
    """A real LocalStore that refuses to hand out whole objects other than ``allowed`` (the
    index): a load that works through it read every data blob in place (``open_reader``)."""

    def __init__(self, root: Path, allowed: set[str]) -> None:
        super().__init__(root, fsync=False)
        self.allowed = allowed

    def get_view(self, key: str) -> memoryview:
        assert key in self.allowed, f"{key} was read whole"
        return super().get_view(key)

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        assert key in self.allowed, f"{key} was read whole"
        return super().get(key, byte_range)


def test_a_component_loads_from_a_local_store_without_whole_object_reads(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3 * READ_PIECE // 4 + 5, generator=g)  # several chunks, a ragged tail
    state = {
        "big": big,
        "same": big.clone(),  # stored once: filled by a copy after verification
        "small": {f"b{i}": torch.randn(7, generator=g) for i in range(5)},  # one pack
        "step": 3,
    }
    result = save(LocalStore(tmp_path / "store", fsync=False), state, chunk_bytes=READ_PIECE)
    store = NoWholeReads(tmp_path / "store", {blob_key(result.index_digest)})
    loaded = load_component(store, result.index_digest)
    assert torch.equal(loaded["big"], big)
    assert torch.equal(loaded["same"], big)
    assert loaded["big"].data_ptr() != loaded["same"].data_ptr()
    assert all(torch.equal(loaded["small"][k], v) for k, v in state["small"].items())
    assert loaded["step"] == 3
    part = load_paths(store, result.index_digest, ["small/b3"])
    assert torch.equal(part["small/b3"], state["small"]["b3"])
