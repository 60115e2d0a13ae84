"""Hostile input against the blob layer: a stored object swapped behind the store's back for one
whose header declares an absurd or false length, and indexes whose shapes, lengths and
segments disagree. Each is refused naming the key and where it was read from, before anything
near the declared size is allocated; resume falls back to the last good step.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hostile import (
    HOSTILE,
    GiB,
    MiB,
    assert_exact,
    commit,
    files_under,
    memory_watch,
    open_writer,
    put_index,
    run_cli,
    tensor_entry,
    weights,
)

from ckptstore.cas import Kind, blob_key, put_blob
from ckptstore.cas.codec import BGZSTD, RAW, ZSTD
from ckptstore.cas.codecs import Codec
from ckptstore.cas.header import MAX_RAW_LEN, Header, decode_header
from ckptstore.checkpointer import Run
from ckptstore.errors import IntegrityError, SerializationError
from ckptstore.maintenance import verify
from ckptstore.objectstore import LocalStore
from ckptstore.serialize.load import read_index


def swap_blob(
    run: Run, store: LocalStore, step: int, craft: Callable[[Header], bytes], which: str = "chunk"
) -> str:
    """Replace the object of ``w``'s chunk (or of the index) of ``step`` with ``craft(its
    header)``; returns its key."""
    info = next(c for c in run.checkpoints() if c.step == step)
    index_digest = info.components[0].index_digest
    digest = index_digest
    if which == "chunk":
        digest = read_index(store, index_digest).entry("w").segments[0].digest
    key = blob_key(digest)
    path = store.root / key
    path.write_bytes(craft(decode_header(memoryview(path.read_bytes()), key)))
    return key


def crafted(header: Header, codec: Codec, raw_len: int, payload: bytes, **fields: Any) -> bytes:
    """A blob object that keeps ``header``'s digest but declares its own codec and length."""
    forged = Header(
        header.kind,
        codec,
        fields.get("itemsize", 1),
        raw_len,
        len(payload),
        header.digest,
        fields.get("params", b""),
    )
    return forged.encode() + payload


@functools.cache
def zeros_frame(n: int) -> bytes:
    """A zstd frame of ``n`` zero bytes (it records its size): 8 KiB for 256 MiB."""
    return zstandard.ZstdCompressor(level=3).compress(bytes(n))


def sizeless_frame(data: bytes) -> bytes:
    """A zstd frame that does not record its content size."""
    return zstandard.ZstdCompressor(write_content_size=False).compress(data)


IMPLAUSIBLE = {
    "raw 2^40": lambda h: crafted(h, RAW, 1 << 40, b"x" * 64),
    "zstd 2^40": lambda h: crafted(h, ZSTD, 1 << 40, sizeless_frame(b"x" * 64)),
    "byte-grouped 2^40": lambda h: crafted(
        h, BGZSTD, 1 << 40, b"x" * 64, itemsize=2, params=struct.pack("<BQBQ", 0, 32, 0, 32)
    ),
    "raw 1 GiB over 64 bytes": lambda h: crafted(h, RAW, GiB, b"x" * 64),
    "one byte past the limit": lambda h: crafted(h, ZSTD, MAX_RAW_LEN + 1, b"x" * 64),
}


TOO_LONG = re.escape("implausible blob header (corrupt or crafted)")


#: Why each is refused (the reason after the key and its context).
IMPLAUSIBLE_REASONS = {
    "raw 2^40": TOO_LONG,
    "zstd 2^40": TOO_LONG,
    "byte-grouped 2^40": TOO_LONG,
    # Bounded by what the index says the blob holds (1 KiB, plus room for a pack's contents).
    "raw 1 GiB over 64 bytes": rf"header declares {GiB} bytes, more than the \d{{4,6}} this "
    r"blob can hold \(damaged or crafted\)",
    "one byte past the limit": TOO_LONG,
}


@pytest.mark.parametrize("case", list(IMPLAUSIBLE))
def test_an_implausible_declared_length_is_refused_without_allocating(
    sqlite_url: str,
    store: LocalStore,
    case: str,
    caplog: pytest.LogCaptureFixture,
    reliability_report: Any,
) -> None:
    rejected = 0
    try:
        with open_writer(sqlite_url, store) as run:
            run.save(1, {"policy": weights(1)})
            run.save(2, {"policy": weights(2)})
            key = swap_blob(run, store, 2, IMPLAUSIBLE[case])
            with memory_watch() as memory, pytest.raises(IntegrityError) as info:
                run.load(step=2)
            message = str(info.value)
            assert key in message
            assert "run 'r', step 2, component 'policy', entry w" in message
            assert re.fullmatch(IMPLAUSIBLE_REASONS[case], message.rsplit("): ", 1)[1]), message
            assert memory["traced"] < 16 * MiB, memory
            assert memory["rss_growth"] < 64 * MiB, memory
            rejected += 1
            with caplog.at_level(logging.ERROR, logger="ckptstore"):
                loaded = run.load()
            assert (loaded.info.step, [s for s, _ in loaded.skipped]) == (1, [2])
            assert_exact(loaded.state["policy"], weights(1))
    finally:
        reliability_report.add(HOSTILE, rejected=rejected, code_executed=0, escaped_writes=0)


PLAUSIBLE_BUT_FALSE = {
    # A zstd frame without a content size: decompress() reserves the whole declared length.
    "zstd, 1 GiB declared": lambda h: crafted(h, ZSTD, GiB, sizeless_frame(b"x" * 64)),
    # Byte-grouping allocates the declared length for its planes up front.
    "byte-grouped, 1 GiB declared": lambda h: crafted(
        h,
        BGZSTD,
        GiB,
        sizeless_frame(b"x" * 64),
        params=struct.pack("<BQ", ZSTD.id, len(sizeless_frame(b"x" * 64))),
    ),
    # A 8 KiB object that really inflates to 256 MiB of zeros, touched and hashed before the
    # digest says it is not the blob: 2 MiB of it would take 64 GiB.
    "zstd bomb, 256 MiB": lambda h: crafted(h, ZSTD, 256 * MiB, zeros_frame(256 * MiB)),
}


def false_length(
    run: Run, store: LocalStore, craft: Callable[[Header], bytes], which: str, entry: str
) -> dict[str, int]:
    """Swap step 1's blob for ``craft``'s object, read it through ``entry``; memory figures."""
    key = swap_blob(run, store, 1, craft, which)
    with memory_watch() as memory:
        if entry == "load":
            with pytest.raises(IntegrityError, match=key):
                run.load(step=1)
        else:
            report = verify(run.db, store, mark_corrupt=False)
            assert [p.key for p in report.problems] == [f"{store.url}/{key}"]
    return memory


@pytest.mark.parametrize("entry", ["load", "verify"])
@pytest.mark.parametrize("case", list(PLAUSIBLE_BUT_FALSE))
def test_a_false_declared_length_allocates_nothing_before_the_digest_check(
    sqlite_url: str,
    store: LocalStore,
    case: str,
    entry: str,
    reliability_report: Any,
) -> None:
    """The chunk of a 1 KiB tensor is swapped for an object that declares a much larger raw
    length. The index and the manifest say the blob is 1 KiB: nothing near the declared size
    may be allocated before the object is refused."""
    rejected = 0
    try:
        with open_writer(sqlite_url, store) as run:
            run.save(1, {"policy": weights(1)})
            memory = false_length(run, store, PLAUSIBLE_BUT_FALSE[case], "chunk", entry)
        assert memory["traced"] < 64 * MiB, memory
        assert memory["rss_growth"] < 64 * MiB, memory
        rejected = 1
    finally:
        reliability_report.add(HOSTILE, rejected=rejected, code_executed=0, escaped_writes=0)


@pytest.mark.parametrize("entry", ["load", "verify"])
def test_a_false_declared_index_length_allocates_nothing_before_the_digest_check(
    sqlite_url: str,
    store: LocalStore,
    entry: str,
    reliability_report: Any,
) -> None:
    """The same for the component's index: the manifest says how long it is."""
    craft = PLAUSIBLE_BUT_FALSE["zstd, 1 GiB declared"]
    with open_writer(sqlite_url, store) as run:
        run.save(1, {"policy": weights(1)})
        memory = false_length(run, store, craft, "index", entry)
    assert memory["traced"] < 64 * MiB, memory
    assert memory["rss_growth"] < 64 * MiB, memory
    reliability_report.add(HOSTILE, rejected=1, code_executed=0, escaped_writes=0)


def test_a_shape_of_10_to_the_12_elements_is_refused_without_allocating(
    sqlite_url: str,
    store: LocalStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """A committed index declares a float32 [10^6, 10^6] tensor (4 TB) whose segments, each as
    large as a blob may be, all point at one real 64-byte chunk."""
    out = tmp_path / "export"
    rejected = 0
    try:
        with open_writer(sqlite_url, store) as run:
            run.save(1, {"policy": weights(1)})
            chunk = put_blob(store, bytes(range(64)), Kind.CHUNK)
            nbytes = 4 * 10**12
            full, rest = divmod(nbytes, MAX_RAW_LEN)
            segments = [[chunk.digest, 0, MAX_RAW_LEN]] * full + [[chunk.digest, 0, rest]]
            entry = tensor_entry("w", "float32", [10**6, 10**6], nbytes, segments)
            index = put_index(store, {"d": [["w", {"e": 0}]]}, [entry])
            commit(run, 2, index, chunk)
            for load in (
                lambda: run.load(step=2),
                lambda: run.load(step=2, paths={"policy": ["w"]}),
            ):
                with memory_watch() as memory, pytest.raises(IntegrityError) as info:
                    load()
                message = str(info.value)
                assert "run 'r', step 2, component 'policy', entry w" in message
                assert "points past the end of the blob" in message
                assert memory["traced"] < 16 * MiB, memory
                assert memory["rss_growth"] < 64 * MiB, memory
                rejected += 1
            base = ["--db", sqlite_url, "--store", str(store.root)]
            code, stdout, err = run_cli(capsys, *base, "--json", "show", "--entries", "r@2")
            assert (code, err) == (0, "")
            assert json.loads(stdout)["entries"]["policy"][0]["shape"] == [10**6, 10**6]
            with memory_watch() as memory:
                code, stdout, err = run_cli(capsys, *base, "export", "r@2", str(out))
            assert code == 3
            assert err.count("\n") == 1
            assert "points past the end of the blob" in err
            assert memory["traced"] < 16 * MiB, memory
            assert not out.exists() or files_under(out) == set()
            rejected += 1
            loaded = run.load()  # resume skips the unloadable step
            assert (loaded.info.step, [s for s, _ in loaded.skipped]) == (1, [2])
            assert_exact(loaded.state["policy"], weights(1))
    finally:
        reliability_report.add(HOSTILE, rejected=rejected, code_executed=0, escaped_writes=0)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        # The shape needs 64 bytes; the segment asks for 64 bytes of a 32-byte blob.
        (tensor_entry("w", "float32", [4, 4], 64, [["SMALL", 0, 64]]), "points past the end"),
        # nbytes agrees with the segments but not with the shape.
        (tensor_entry("w", "float32", [4, 4], 32, [["SMALL", 0, 32]]), "needs 64 bytes"),
        # The shape and nbytes agree; the segments cover half.
        (tensor_entry("w", "float32", [4, 4], 64, [["SMALL", 0, 32]]), "segments cover 32"),
        # The right number of bytes, read from past the blob's end.
        (tensor_entry("w", "float32", [2, 4], 32, [["SMALL", 8, 32]]), "points past the end"),
    ],
)
def test_a_shape_and_length_mismatch_is_refused(
    sqlite_url: str,
    store: LocalStore,
    entry: Any,
    message: str,
    reliability_report: Any,
) -> None:
    rejected = 0
    try:
        with open_writer(sqlite_url, store) as run:
            run.save(1, {"policy": weights(1)})
            small = put_blob(store, bytes(32), Kind.CHUNK)
            entry = json.loads(json.dumps(entry).replace('"SMALL"', json.dumps(small.digest)))
            index = put_index(store, {"d": [["w", {"e": 0}]]}, [entry])
            commit(run, 2, index, small)
            with pytest.raises((IntegrityError, SerializationError), match=message) as info:
                run.load(step=2)
            assert "run 'r', step 2, component 'policy'" in str(info.value)
            assert "'w'" in str(info.value) or "entry w" in str(info.value)
            rejected += 1
    finally:
        reliability_report.add(HOSTILE, rejected=rejected, code_executed=0, escaped_writes=0)
