"""ComponentReader (ckptstore.serialize.reader): one index fetch serves every read of a
component, the results equal the load functions', and a damaged index is refused naming the
component."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from component_helpers import random_bytes, save
from counting_store import CountingStore

from ckptstore.cas import Kind, blob_key, put_blob
from ckptstore.errors import IntegrityError, SerializationError
from ckptstore.objectstore import LocalStore
from ckptstore.serialize import (
    ComponentReader,
    ComponentResult,
    load_byte_range,
    load_component,
    load_paths,
    read_index,
)
from ckptstore.serialize.compare import first_difference

MiB = 1 << 20
CONTEXT = "run 'r', step 3, component 'policy'"


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(3 * MiB // 4 + 100, generator=g),  # four 1 MiB chunks
        "small": {f"b{i}": torch.randn(16, generator=g) for i in range(4)},  # one pack
        "ids": np.arange(7),
        "blob": b"bytes",
        "step": 3,
        "lr": 1e-4,
    }


@pytest.fixture
def saved(tmp_path: Path) -> tuple[CountingStore, dict[str, Any], ComponentResult]:
    store = CountingStore(tmp_path / "store")
    original = state()
    result = save(store, original, chunk_bytes=MiB)
    store.reads.clear()
    return store, original, result


def test_one_reader_fetches_the_index_once_for_every_read(
    saved: tuple[CountingStore, dict[str, Any], ComponentResult],
) -> None:
    store, original, result = saved
    reader = ComponentReader(store, result.index_digest, context=CONTEXT)
    assert not store.reads  # nothing is fetched before it is needed
    assert first_difference(original, reader.load()) is None
    assert (
        first_difference(original["small"]["b2"], reader.load_paths(["small/b2"])["small/b2"])
        is None
    )
    start, stop = MiB + 10, 2 * MiB + 7
    expected = original["big"].view(torch.uint8).numpy().tobytes()[start:stop]
    assert reader.byte_range("big", start, stop) == expected
    assert len(reader.entries) == result.entries
    assert reader.digests
    assert store.reads[blob_key(result.index_digest)] == 1


def test_the_reader_returns_what_the_load_functions_return(
    saved: tuple[CountingStore, dict[str, Any], ComponentResult],
) -> None:
    store, _, result = saved
    digest = result.index_digest
    reader = ComponentReader(store, digest)
    assert reader.index == read_index(store, digest)
    assert first_difference(reader.load(), load_component(store, digest)) is None
    paths = ["small/", "step", "big"]
    assert first_difference(reader.load_paths(paths), load_paths(store, digest, paths)) is None
    assert reader.byte_range("big", 5, MiB + 3) == load_byte_range(store, digest, "big", 5, MiB + 3)
    assert reader.digests == {b.digest for b in result.blobs} - {digest}


def test_values_follow_the_order_of_entries(
    saved: tuple[CountingStore, dict[str, Any], ComponentResult],
) -> None:
    store, _, result = saved
    reader = ComponentReader(store, result.index_digest)
    values = reader.values()
    assert len(values) == len(reader.entries)
    for entry, value in zip(reader.entries, values, strict=True):
        assert first_difference(value, reader.load_paths([entry.path])[entry.path]) is None


def test_byte_range_fetches_only_the_chunk_that_holds_it(
    saved: tuple[CountingStore, dict[str, Any], ComponentResult],
) -> None:
    store, _, result = saved
    reader = ComponentReader(store, result.index_digest)
    chunks = [s.digest for s in reader.entry("big").segments]
    reader.byte_range("big", MiB + 1, MiB + 100)
    assert set(store.reads) == {blob_key(result.index_digest), blob_key(chunks[1])}


def test_concurrent_first_use_fetches_the_index_once(
    saved: tuple[CountingStore, dict[str, Any], ComponentResult],
) -> None:
    store, _, result = saved
    reader = ComponentReader(store, result.index_digest)
    barrier = threading.Barrier(8)
    seen: list[Any] = []

    def use() -> None:
        barrier.wait()
        seen.append(reader.index)

    threads = [threading.Thread(target=use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 8
    assert all(index is seen[0] for index in seen)
    assert store.reads[blob_key(result.index_digest)] == 1


def test_a_damaged_index_is_refused_naming_the_component_and_retried_later(
    saved: tuple[CountingStore, dict[str, Any], ComponentResult],
) -> None:
    store, original, result = saved
    path = store.root / blob_key(result.index_digest)
    intact = path.read_bytes()
    damaged = bytearray(intact)
    damaged[-1] ^= 0xFF
    path.write_bytes(damaged)
    reader = ComponentReader(store, result.index_digest, context=CONTEXT)
    for read in (reader.load, lambda: reader.load_paths(["step"]), lambda: reader.entries):
        with pytest.raises(IntegrityError) as info:
            read()
        assert CONTEXT in str(info.value)
        assert blob_key(result.index_digest) in str(info.value)
    path.write_bytes(intact)  # a good copy restored: the same reader now reads
    assert first_difference(original, reader.load()) is None


def test_an_index_that_is_no_index_is_refused_naming_the_component(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    not_json = put_blob(store, b"not json", Kind.INDEX).digest
    with pytest.raises(SerializationError, match="not valid JSON") as info:
        ComponentReader(store, not_json, context=CONTEXT).load_paths(["step"])
    assert CONTEXT in str(info.value)
    chunk = put_blob(store, random_bytes(100), Kind.CHUNK).digest
    with pytest.raises(IntegrityError, match="is a chunk, not an index") as info2:
        ComponentReader(store, chunk, context=CONTEXT).load()
    assert CONTEXT in str(info2.value)


def test_the_manifest_index_length_bounds_the_fetch(
    saved: tuple[CountingStore, dict[str, Any], ComponentResult],
) -> None:
    store, _, result = saved
    with pytest.raises(IntegrityError, match="more than the 10"):
        ComponentReader(store, result.index_digest, index_len=10).load()
