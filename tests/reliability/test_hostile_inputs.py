"""Hostile input (issue #6, family 6): a checkpoint from an untrusted bucket or writer, secrets in
URLs and the environment, and misconfiguration a user will make.

``tests/serialize/test_hostile_index.py`` feeds crafted indexes to ``load_component``. Here the
crafted index or blob is *committed*: a worker's receipt names it
(``Run.save(receipts=[...])``, exactly what a hostile or buggy shard writer can do), or a stored
object is swapped behind the store's back. Then every way a user touches it is tried --
``Run.load`` of the step, resume, and the CLI (``show --entries``, ``export``, ``verify``) --
and each must give a clear error naming the problem, run no code, allocate nothing absurd, and
write nothing outside its directory.

Secrets (an AWS secret key, credentials in an S3 endpoint URL, a PostgreSQL password) are run
through saves, loads, failures and CLI commands; every log record (DEBUG, tracebacks included),
every exception text with its whole chain, stdout, stderr and every database cell is scanned.

Misconfiguration (a bad store URL, a missing bucket, wrong credentials, an unreachable or
out-of-date database) must give one line on stderr that names the problem and the fix, with a
non-zero exit code, and a ckptstore error from the Python API.

Families: ``hostile input`` (rejected, code executed, escaped writes), ``secrets`` (scanned
texts, leaked) and ``actionable errors`` (cases, one line).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import logging
import os
import pickle
import re
import struct
import traceback
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import s3servers
import torch
import zstandard
from safetensors.torch import load_file
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url
from store_contract import FAST_RETRY, S3StoreFactory

from ckptstore.cas import BlobRef, Kind, blob_key, put_blob
from ckptstore.cas.codec import BGZSTD, RAW, ZSTD
from ckptstore.cas.codecs import Codec
from ckptstore.cas.header import MAX_RAW_LEN, Header, decode_header
from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer import CheckpointInfo, Run, open_run
from ckptstore.checkpointer.shards import ShardReceipt
from ckptstore.cli import main
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ConfigError,
    DatabaseError,
    IntegrityError,
    ObjectStoreError,
    SaveError,
    SchemaError,
    SerializationError,
)
from ckptstore.maintenance import collect_garbage, export_component, verify
from ckptstore.maintenance.export import safe_path
from ckptstore.manifest import Database
from ckptstore.manifest.db import redact, resolve_url
from ckptstore.objectstore import LocalStore, ObjectStore, S3Store
from ckptstore.serialize import ComponentResult
from ckptstore.serialize.load import read_index
from ckptstore.serialize.tree import MAX_DEPTH

HOSTILE = "hostile input"
SECRETS = "secrets"
ACTIONABLE = "actionable errors"
#: Tensors of 1 KiB and more get chunks of their own.
OPTIONS = WriterOptions(pack_threshold=1024, compression="never", max_workers=2)
MiB = 1 << 20
GiB = 1 << 30


# -- helpers ---------------------------------------------------------------------------------------


def weights(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 16, generator=gen), "b": torch.randn(4, generator=gen)}


def assert_exact(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype
        assert torch.equal(actual[key], value), key


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'manifest.db'}"


def put_index(store: ObjectStore, tree: Any, entries: list[Any]) -> BlobRef:
    body = {"format": "ckptstore/index", "version": 1, "tree": tree, "entries": entries}
    return put_blob(store, json.dumps(body).encode(), Kind.INDEX)


def tensor_entry(path: str, dtype: str, shape: list[int], nbytes: int, segments: Any) -> Any:
    return {
        "path": path,
        "kind": "tensor",
        "dtype": dtype,
        "shape": shape,
        "nbytes": nbytes,
        "segments": segments,
    }


def commit(
    run: Run, step: int, index: BlobRef, *data: BlobRef, component: str = "policy"
) -> CheckpointInfo:
    """Commit a checkpoint whose one component is ``index`` -- what a worker's receipt can do."""
    result = ComponentResult(index.digest, 1, sum(d.logical_bytes for d in data), (index, *data))
    info = run.save(step, receipts=[ShardReceipt(component, result)]).wait()
    assert info.status == "committed"
    return info


def open_writer(db: str, store: ObjectStore, name: str = "r") -> Run:
    run = open_run(name, db=db, store=store, writer_options=OPTIONS)
    run.async_save = False
    return run


@contextlib.contextmanager
def cli_logging() -> Iterator[None]:
    """Logging as in a fresh ``ckptstore`` process: ``main`` installs its own stderr handler."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []
    try:
        yield
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers = handlers
        root.setLevel(level)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    with cli_logging():
        code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def stray_files(tmp_path: Path, *allowed: Path) -> set[Path]:
    """Files under ``tmp_path`` outside the ``allowed`` files and directories and the manifest
    database's own files: what a hostile input made something write where it should not."""
    return {
        p
        for p in files_under(tmp_path)
        if not p.name.startswith("manifest.db") and not any(p.is_relative_to(a) for a in allowed)
    }


class CreatesMarker:
    """Unpickling this creates (opens for writing) the marker file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def live_pickle(marker: Path, tmp_path: Path, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    """A pickle that creates ``marker`` when loaded -- after proving that it does."""
    probe = tmp_path / f"probe-{protocol}"
    pickle.loads(pickle.dumps(CreatesMarker(probe), protocol=protocol)).close()
    assert probe.exists()
    probe.unlink()
    return pickle.dumps({"format": "ckptstore/index", "x": CreatesMarker(marker)}, protocol)


@contextlib.contextmanager
def memory_watch() -> Iterator[dict[str, int]]:
    """Peak bytes Python and numpy allocated (tracemalloc) and peak RSS growth (VmHWM, reset
    through /proc/self/clear_refs) inside the block."""
    figures: dict[str, int] = {}

    def status(field_name: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(field_name)

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = status("VmRSS")
    tracemalloc.start()
    try:
        yield figures
    finally:
        figures["traced"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        figures["rss_growth"] = status("VmHWM") - base


# -- 1. pickles never run --------------------------------------------------------------------------


def test_a_pickle_committed_as_an_index_never_runs(
    sqlite_url: str,
    store: LocalStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """The index of the latest checkpoint is a pickle (and, in a second run, a torch.save file)
    that would create a file if anything unpickled it."""
    marker = tmp_path / "pwned"
    out = tmp_path / "export"
    rejected = 0
    try:
        evil_zip = tmp_path / "evil.pt"
        torch.save({"x": CreatesMarker(marker)}, evil_zip)
        payloads = {"pickled": live_pickle(marker, tmp_path), "torch-saved": evil_zip.read_bytes()}
        for name, payload in payloads.items():
            with open_writer(sqlite_url, store, name) as run:
                run.save(1, {"policy": weights(1)})
                index = put_blob(store, payload, Kind.INDEX)
                commit(run, 2, index)
                where = f"index {index.digest} (run {name!r}, step 2, component 'policy')"
                for load in (lambda run=run: run.load(step=2), lambda run=run: run.load()):
                    with pytest.raises(SerializationError) as info:
                        load()
                    assert str(info.value).startswith(f"{where}: index is not valid JSON")
                    rejected += 1
            base = ["--db", sqlite_url, "--store", str(store.root)]
            for argv in (
                ["show", "--entries", f"{name}@2"],
                ["export", f"{name}@2", str(out)],
                ["export", f"{name}@2", str(out), "--format", "torch"],
            ):
                code, stdout, err = run_cli(capsys, *base, *argv)
                assert code == 3, (argv, stdout, err)
                assert err.count("\n") == 1
                assert err.startswith("ckptstore: error: index ")
                assert "not valid JSON" in err
                assert index.digest in err
                rejected += 1
        assert not out.exists() or files_under(out) == set()
    finally:
        escaped = stray_files(tmp_path, store.root, tmp_path / "evil.pt", marker)
        reliability_report.add(
            HOSTILE,
            rejected=rejected,
            code_executed=int(marker.exists()),
            escaped_writes=len(escaped),
        )
    assert not marker.exists()
    assert escaped == set()


def test_pickled_bytes_inside_a_committed_checkpoint_stay_data(
    sqlite_url: str,
    store: LocalStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """A pickle as the bytes of a data blob: as a ``bytes`` entry it loads as those bytes; as
    an object array it is refused; as a JSON string it is a string. Export writes it as data."""
    marker = tmp_path / "pwned"
    payload = live_pickle(marker, tmp_path, protocol=0)  # protocol 0 is ASCII: a JSON string too
    n = len(payload)
    out = tmp_path / "export"
    rejected = 0
    try:
        data = put_blob(store, payload, Kind.PACK)
        with open_writer(sqlite_url, store) as run:
            as_bytes = {"path": "p", "kind": "bytes", "dtype": "uint8", "shape": [n], "nbytes": n}
            as_json = {"path": "j", "kind": "json", "value": payload.decode("ascii")}
            index = put_index(
                store,
                {"d": [["p", {"e": 0}], ["j", {"e": 1}]]},
                [{**as_bytes, "segments": [[data.digest, 0, n]]}, as_json],
            )
            commit(run, 1, index, data)
            loaded = run.load(step=1).state["policy"]
            assert loaded == {"p": payload, "j": payload.decode("ascii")}

            m = n // 8 * 8
            objects = {
                "path": "o",
                "kind": "ndarray",
                "dtype": "|O",
                "shape": [m // 8],
                "nbytes": m,
                "segments": [[data.digest, 0, m]],
            }
            index = put_index(store, {"e": 0}, [objects])
            commit(run, 2, index, data)
            with pytest.raises(SerializationError, match="numpy dtype") as info:
                run.load(step=2)
            assert "(run 'r', step 2, component 'policy')" in str(info.value)
            rejected += 1
        base = ["--db", sqlite_url, "--store", str(store.root)]
        for fmt in ("safetensors", "torch"):
            code, stdout, err = run_cli(
                capsys, *base, "export", "r@1", str(out / fmt), "--format", fmt
            )
            assert (code, err) == (0, ""), stdout
            code, stdout, err = run_cli(
                capsys, *base, "export", "r@2", str(out / "x"), "--format", fmt
            )
            assert code == 3
            assert err.count("\n") == 1
            assert "numpy dtype" in err
            rejected += 1
        written = files_under(out)
        assert written == {out / "safetensors" / "policy.safetensors", out / "torch" / "policy.pt"}
        exported = load_file(out / "safetensors" / "policy.safetensors")
        assert bytes(exported["p"].numpy()) == payload
    finally:
        escaped = stray_files(tmp_path, store.root, out, marker)
        reliability_report.add(
            HOSTILE,
            rejected=rejected,
            code_executed=int(marker.exists()),
            escaped_writes=len(escaped),
        )
    assert not marker.exists()
    assert escaped == set()


def test_verify_reports_a_committed_index_that_does_not_parse(
    sqlite_url: str,
    store: LocalStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    marker = tmp_path / "pwned"
    with open_writer(sqlite_url, store) as run:
        run.save(1, {"policy": weights(1)})
        index = put_blob(store, live_pickle(marker, tmp_path), Kind.INDEX)
        commit(run, 2, index)
    code, out, err = run_cli(
        capsys, "--db", sqlite_url, "--store", str(store.root), "verify", "--no-mark"
    )
    assert not marker.exists()
    assert code == 1, (out, err)
    assert f"run 'r' step 2 component 'policy': {store.url}/{blob_key(index.digest)}" in out
    reliability_report.add(HOSTILE, rejected=1, code_executed=0, escaped_writes=0)


# -- 2. absurd sizes -------------------------------------------------------------------------------


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


# -- 3. export never writes outside its directory --------------------------------------------------


HOSTILE_NAMES = ["../evil", "../../evil", "/tmp/ckpt-evil", "a/../../evil", "..", "a/./b", "x\0y"]


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_refuses_tensor_names_that_are_paths(
    sqlite_url: str,
    store: LocalStore,
    tmp_path: Path,
    fmt: str,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """Entry paths in a committed index are tensor names in the exported file; one that reads
    as a path out of the export directory is refused before anything is written."""
    out = tmp_path / "out" / "export"
    rejected = escaped = 0
    try:
        with open_writer(sqlite_url, store) as run:
            chunk = put_blob(store, bytes(range(64)), Kind.CHUNK)
            for step, name in enumerate(HOSTILE_NAMES, start=1):
                entry = tensor_entry(name, "float32", [16], 64, [[chunk.digest, 0, 64]])
                commit(run, step, put_index(store, {"d": [["t", {"e": 0}]]}, [entry]), chunk)
        before = files_under(tmp_path)
        base = ["--db", sqlite_url, "--store", str(store.root)]
        for step, name in enumerate(HOSTILE_NAMES, start=1):
            code, stdout, err = run_cli(
                capsys, *base, "export", f"r@{step}", str(out), "--format", fmt
            )
            assert code == 3, (name, stdout, err)
            assert err.count("\n") == 1, err
            assert f"tensor name {name!r} looks like a path outside the export directory" in err
            rejected += 1
        # The database's own files may come and go; anything else new is an escaped write.
        new = {p for p in files_under(tmp_path) - before if not p.name.startswith("manifest.db")}
        escaped = len(new) + len(list(Path("/tmp").glob("ckpt-evil*")))
        assert not out.exists() or files_under(out) == set()
    finally:
        reliability_report.add(HOSTILE, rejected=rejected, code_executed=0, escaped_writes=escaped)
    assert escaped == 0


@pytest.mark.parametrize(
    "component",
    ["../evil", "../../evil", "/tmp/ckpt-evil", "a/../../evil", "a//b", "sub/..", "link/x"],
)
def test_export_refuses_component_names_that_leave_the_directory(
    sqlite_url: str,
    store: LocalStore,
    tmp_path: Path,
    component: str,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """A committed component name (from the database: a worker chose it) that would put the
    exported file outside the export directory -- by ``..``, an absolute path or a symlink in
    the export directory -- is refused, and nothing at all is written."""
    out = tmp_path / "export"
    outside = tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    (out / "link").symlink_to(outside, target_is_directory=True)
    escaped = rejected = 0
    try:
        with open_writer(sqlite_url, store) as run:
            run.save(1, {"policy": weights(1), "planted": weights(2)})
        # save() refuses such names now (ckptstore/names.py); export must not trust the
        # database either, so the name is planted there directly.
        engine = create_engine(sqlite_url)
        with engine.begin() as conn:
            conn.execute(
                text("UPDATE components SET name = :bad WHERE name = 'planted'"),
                {"bad": component},
            )
        engine.dispose()
        before = files_under(tmp_path)
        for fmt in ("safetensors", "torch"):
            code, stdout, err = run_cli(
                capsys,
                *["--db", sqlite_url, "--store", str(store.root)],
                *["export", "r@1", str(out), "--format", fmt],
            )
            assert code == 2, (stdout, err)
            assert err.count("\n") == 1, err
            assert f"component name {component!r}" in err
            rejected += 1
            with pytest.raises(ConfigError):
                safe_path(out, component, ".pt")
        # The database's own files may come and go; anything else new is an escaped write.
        new = {p for p in files_under(tmp_path) - before if not p.name.startswith("manifest.db")}
        escaped = len(new) + len(list(Path("/tmp").glob("ckpt-evil*")))
        assert files_under(outside) == set()
        assert files_under(out) == {out / "link"}
    finally:
        reliability_report.add(HOSTILE, rejected=rejected, code_executed=0, escaped_writes=escaped)
    assert escaped == 0


def test_export_component_refuses_a_hostile_tensor_name_through_the_api(
    store: LocalStore, tmp_path: Path, reliability_report: Any
) -> None:
    chunk = put_blob(store, bytes(range(64)), Kind.CHUNK)
    entry = tensor_entry("../../evil", "float32", [16], 64, [[chunk.digest, 0, 64]])
    index = put_index(store, {"d": [["t", {"e": 0}]]}, [entry])
    with pytest.raises(SerializationError, match="outside the export directory"):
        export_component(store, index.digest, tmp_path / "out" / "p.safetensors", "safetensors")
    assert not (tmp_path / "out").exists()
    assert not (tmp_path.parent / "evil").exists()
    reliability_report.add(HOSTILE, rejected=1, code_executed=0, escaped_writes=0)


# -- 4. deep nesting -------------------------------------------------------------------------------


def nest(depth: int, leaf: Any) -> Any:
    node = leaf
    for _ in range(depth):
        node = {"l": [node]}
    return node


def test_a_committed_index_nested_too_deep_is_refused(
    sqlite_url: str,
    store: LocalStore,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    rejected = 0
    try:
        value = [{"path": "x", "kind": "json", "value": 3}]
        with open_writer(sqlite_url, store) as run:
            run.save(1, {"policy": weights(1)})
            parser_deep = '{"format":"ckptstore/index","version":1,"entries":[],"tree":'
            parser_deep += '{"l":[' * 100_000 + "]}" * 100_000 + "}"
            indexes = {
                2: put_index(store, nest(MAX_DEPTH + 50, {"e": 0}), value),
                3: put_blob(store, parser_deep.encode(), Kind.INDEX),
            }
            for step, index in indexes.items():
                commit(run, step, index)
            for step in indexes:
                with pytest.raises(SerializationError) as info:
                    run.load(step=step)
                assert indexes[step].digest in str(info.value)
                rejected += 1
            assert "not valid JSON" in str(info.value)
        code, out, err = run_cli(
            capsys, "--db", sqlite_url, "--store", str(store.root), "show", "--entries", "r@3"
        )
        assert code == 3, out
        assert err.count("\n") == 1
        assert "not valid JSON" in err
        rejected += 1
    finally:
        reliability_report.add(HOSTILE, rejected=rejected, code_executed=0, escaped_writes=0)


def test_a_tree_nested_too_deep_says_so_and_where(
    sqlite_url: str, store: LocalStore, reliability_report: Any
) -> None:
    with open_writer(sqlite_url, store) as run:
        run.save(1, {"policy": weights(1)})
        index = put_index(store, nest(MAX_DEPTH + 50, {"e": 0}), [])
        commit(run, 2, index)
        with pytest.raises(SerializationError) as info:
            run.load(step=2)
    assert "run 'r', step 2, component 'policy'" in str(info.value)
    assert f"deeper than {MAX_DEPTH}" in str(info.value)
    reliability_report.add(HOSTILE, rejected=1, code_executed=0, escaped_writes=0)


def test_a_state_nested_too_deep_is_refused_at_save_time(
    sqlite_url: str, store: LocalStore, reliability_report: Any
) -> None:
    deep: Any = torch.zeros(2)
    for _ in range(MAX_DEPTH + 5):
        deep = {"a": deep}
    with open_writer(sqlite_url, store) as run:
        with pytest.raises(SerializationError, match=f"nesting deeper than {MAX_DEPTH} levels"):
            run.save(1, {"policy": deep})
        assert run.checkpoints() == []
        with pytest.raises(SerializationError, match="nesting deeper"):
            run.save(1, {"policy": [nest(10_000, 1)]})
        assert run.checkpoints() == []
    reliability_report.add(HOSTILE, rejected=2, code_executed=0, escaped_writes=0)


@pytest.mark.parametrize("argument", ["config", "metrics", "training_info"])
def test_deeply_nested_json_arguments_raise_a_config_error(
    sqlite_url: str, store: LocalStore, argument: str, reliability_report: Any
) -> None:
    deep: Any = 1
    for _ in range(5_000):
        deep = {"a": deep}

    def call() -> None:
        if argument == "config":
            open_run("r", db=sqlite_url, store=store, config=deep).close()
            return
        with open_writer(sqlite_url, store) as run:
            run.save(1, {"policy": weights(1)}, **{argument: deep})

    with pytest.raises(ConfigError, match=argument):
        call()
    reliability_report.add(HOSTILE, rejected=1, code_executed=0, escaped_writes=0)


# -- 5. secrets ------------------------------------------------------------------------------------


@dataclass
class Scanner:
    """Counts every text it is shown and keeps those that contain a secret."""

    secrets: tuple[str, ...]
    texts: int = 0
    leaks: list[tuple[str, str]] = field(default_factory=list)

    def text(self, where: str, value: str) -> None:
        self.texts += 1
        for secret in self.secrets:
            if secret in value:
                start = value.index(secret)
                self.leaks.append((where, value[max(0, start - 120) : start + 40]))

    def exception(self, where: str, exc: BaseException) -> None:
        """The exception's text, its notes, and the whole chain as a traceback prints it."""
        seen: set[int] = set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            self.text(f"{where}: {type(current).__name__}", str(current))
            self.text(f"{where}: repr", repr(current))
            current = current.__cause__ or current.__context__
        self.text(f"{where}: traceback", "".join(traceback.format_exception(exc)))

    def records(self, where: str, records: list[logging.LogRecord]) -> None:
        formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
        for record in records:
            self.text(f"{where}: log {record.name}", formatter.format(record))

    def database(self, url: str) -> None:
        engine = create_engine(url)
        try:
            with engine.connect() as conn:
                inspector = inspect(conn)
                names = inspector.get_table_names() + inspector.get_view_names()
                assert {"runs", "checkpoints", "blobs", "components"} <= set(names)
                for name in names:
                    for row in conn.execute(text(f'SELECT * FROM "{name}"')):
                        self.text(f"database {name}", repr(tuple(row)))
        finally:
            engine.dispose()

    def summary(self) -> str:
        """Where the secret showed up: one line per place, with a count and an excerpt."""
        places: dict[str, tuple[int, str]] = {}
        for where, excerpt in self.leaks:
            count, first = places.get(where, (0, excerpt))
            places[where] = (count + 1, first)
        return "\n".join(f"{n} x {where}: ...{first}..." for where, (n, first) in places.items())

    def report(self, reliability_report: Any) -> None:
        reliability_report.add(SECRETS, scanned_texts=self.texts, leaked=len(self.leaks))


class Recorder(logging.Handler):
    """Every record at DEBUG and above, from every logger (botocore, urllib3, sqlalchemy...)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def record_everything() -> Iterator[Recorder]:
    root = logging.getLogger()
    recorder = Recorder()
    handlers, level = root.handlers[:], root.level
    root.handlers = [recorder]
    root.setLevel(logging.DEBUG)
    try:
        yield recorder
    finally:
        root.handlers = handlers
        root.setLevel(level)


def scan_cli(
    scanner: Scanner, capsys: pytest.CaptureFixture[str], base: list[str], *commands: list[str]
) -> list[int]:
    """Run each command with every log record kept; scan its records, stdout and stderr."""
    codes = []
    for argv in commands:
        capsys.readouterr()
        with record_everything() as recorder:
            codes.append(main([*base, *argv]))
        out, err = capsys.readouterr()
        scanner.text(f"cli {argv[0]} stdout", out)
        scanner.text(f"cli {argv[0]} stderr", err)
        scanner.records(f"cli {argv[0]}", recorder.records)
    return codes


#: What each of CLI_READS exits with after ``workload``: its resume past a damaged blob leaves a
#: checkpoint marked corrupt, which keeps ``verify`` at 1 until it is repaired or released.
CLI_READS_EXIT = [0, 0, 0, 0, 1, 1, 0, 0, 0]
CLI_READS = [
    ["runs"],
    ["ls", "r"],
    ["show", "--entries", "r"],
    ["latest", "r"],
    ["--json", "verify", "--no-mark"],
    ["verify"],
    ["gc", "--dry-run"],
    ["du"],
    ["sql", "SELECT * FROM checkpoints"],
]


def workload(
    scanner: Scanner,
    db: str,
    store: ObjectStore,
    broken: list[Callable[[], Any]],
) -> None:
    """Saves, loads, a resume past a damaged blob, and ``broken`` calls that must fail."""
    with record_everything() as recorder:
        with open_run("r", db=db, store=store, writer_options=OPTIONS) as run:
            run.save(1, {"policy": weights(1)}, metrics={"loss": 1.0}).wait()
            info = run.save(2, {"policy": weights(2)}).wait()
            assert_exact(run.load(step=2).state["policy"], weights(2))
            scanner.text("repr", f"{run!r} {run.db!r} {run.store!r} {info!r}")
            index = read_index(store, info.components[0].index_digest)
            key = blob_key(index.entry("w").segments[0].digest)
            damaged = bytearray(store.get(key))
            damaged[-1] ^= 1
            store.delete([key])
            store.put(key, bytes(damaged))
            loaded = run.load()  # logs the corrupt step at ERROR
            assert loaded.info.step == 1
            scanner.text("skipped", repr(loaded.skipped))
        for call in broken:
            with pytest.raises(CkptStoreError) as info:
                call()
            scanner.exception("broken call", info.value)
    scanner.records("workload", recorder.records)
    assert any(r.levelno >= logging.ERROR for r in recorder.records)


@pytest.mark.integration
def test_an_aws_secret_key_never_leaks(
    seaweed_store_factory: S3StoreFactory,
    sqlite_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """The secret key in AWS_SECRET_ACCESS_KEY, as boto3 reads it, through saves, loads, a
    missing bucket, an unreachable endpoint and every read-only CLI command."""
    secret = "Zq7SECRETxAWSkey0000000000000000000000Zq7"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIACKPTSTORETEST01")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    endpoint = str(seaweed_store_factory.endpoint_url)
    scanner = Scanner((secret,))
    try:
        store = seaweed_store_factory(endpoint_url=endpoint)  # credentials from the environment
        missing = S3Store("no-such-bucket-ckpt", "p", endpoint_url=endpoint, retry=FAST_RETRY)
        unreachable = S3Store(
            "ckpt-unreachable", "p", endpoint_url="http://127.0.0.1:1", retry=FAST_RETRY
        )

        def save_to(target: ObjectStore) -> None:
            with open_run("other", db=sqlite_url, store=target) as run:
                run.save(1, {"policy": weights(3)}).wait()

        workload(
            scanner,
            sqlite_url,
            store,
            [
                lambda: save_to(missing),
                lambda: save_to(unreachable),
                lambda: missing.head("cas/00/00"),
            ],
        )
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        base = ["--db", sqlite_url, "--store", store.url]
        export = ["export", "r@1", str(tmp_path / "export")]
        codes = scan_cli(scanner, capsys, base, *CLI_READS, export)
        assert codes == [*CLI_READS_EXIT, 0]
        elsewhere = ["--db", sqlite_url, "--store", "s3://no-such-bucket-ckpt/p"]
        assert scan_cli(scanner, capsys, elsewhere, ["gc", "--dry-run"]) == [3]
        scanner.database(sqlite_url)
        missing.close()
        unreachable.close()
    finally:
        scanner.report(reliability_report)
    assert scanner.leaks == [], scanner.summary()
    assert scanner.texts > 100


@pytest.mark.integration
def test_credentials_in_an_s3_endpoint_url_never_leak(
    seaweed_store_factory: S3StoreFactory,
    sqlite_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """``http://user:password@host`` as the endpoint (explicit, or in AWS_ENDPOINT_URL). Either
    ckptstore refuses such a URL without echoing it, or the password is never shown."""
    password = "Pw9SECRETinURL"
    port = str(seaweed_store_factory.endpoint_url).rsplit(":", 1)[1]
    with_creds = f"http://ckptuser:{password}@127.0.0.1:{port}"
    scanner = Scanner((password,))
    try:
        try:
            store = seaweed_store_factory(endpoint_url=with_creds)
        except ConfigError as exc:  # refusing such URLs is a fine answer
            scanner.exception("refused endpoint", exc)
        else:
            unreachable = S3Store(
                "b", "p", endpoint_url=f"http://ckptuser:{password}@127.0.0.1:1", retry=FAST_RETRY
            )

            def save_to(target: ObjectStore) -> None:
                with open_run("other", db=sqlite_url, store=target) as run:
                    run.save(1, {"policy": weights(3)}).wait()

            workload(scanner, sqlite_url, store, [lambda: save_to(unreachable)])
            monkeypatch.setenv("AWS_ENDPOINT_URL", with_creds)
            scan_cli(scanner, capsys, ["--db", sqlite_url, "--store", store.url], *CLI_READS)
            scanner.database(sqlite_url)
            unreachable.close()
    finally:
        scanner.report(reliability_report)
    assert scanner.leaks == [], scanner.summary()


@pytest.mark.integration
def test_a_postgresql_password_never_leaks(
    pg_schema_url: str,
    store: LocalStore,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """A password in the database URL (the test server trusts local connections, so it is
    accepted and ignored), then URLs whose connection fails: an unknown role, a database that
    does not exist, a closed port."""
    password = "Pg8SECRETpassword"
    url = make_url(pg_schema_url).set(password=password).render_as_string(hide_password=False)
    failing = [
        make_url(pg_schema_url).set(username="no_such_role_ckpt", password=password),
        make_url(pg_schema_url).set(database="no_such_db_ckpt", password=password),
        make_url(pg_schema_url).set(port=1, password=password),
    ]
    failing_urls = [u.render_as_string(hide_password=False) for u in failing]
    scanner = Scanner((password,))
    try:
        workload(
            scanner,
            url,
            store,
            [lambda u=u: open_run("r", db=u, store=store) for u in failing_urls],
        )
        base = ["--db", url, "--store", str(store.root)]
        # The test server's login is a superuser, which `sql` refuses without the flag.
        reads = [[*c, "--allow-superuser"] if c[0] == "sql" else c for c in CLI_READS]
        more = [
            ["db", "current"],
            ["db", "upgrade"],
            ["sql", "--allow-superuser", "SELECT * FROM no_such_table"],
        ]
        codes = scan_cli(scanner, capsys, base, *reads, *more)
        assert codes == [*CLI_READS_EXIT, 0, 0, 3]
        for bad in failing_urls:
            codes = scan_cli(scanner, capsys, ["--db", bad], ["runs"], ["db", "current"])
            assert codes == [3, 3]
        scanner.database(url)
    finally:
        scanner.report(reliability_report)
    assert scanner.leaks == [], scanner.summary()
    # Outputs, errors, tracebacks and log records (opening a database no longer goes through
    # Alembic, whose INFO lines used to add a few).
    assert scanner.texts > 80


# -- 6. actionable one-line errors -----------------------------------------------------------------


class NotOneLine(AssertionError):
    """stderr held more (or less) than one line."""


@dataclass
class Case:
    """A misconfiguration: how to provoke it from the API and the CLI, and what must be said."""

    argv: list[str]
    api: Callable[[], Any]
    error: type[CkptStoreError]
    says: tuple[str, ...]
    exit_code: int = 3


class AuthSeaweed(s3servers.SeaweedServer):
    """A SeaweedFS that checks credentials (an identities file), unlike the shared one."""

    config: Path = Path()

    def command(self) -> list[str]:
        return [*super().command(), f"-s3.config={self.config}"]


@pytest.fixture(scope="module")
def auth_seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint of a SeaweedFS that accepts only the session's test credentials."""
    root = tmp_path_factory.mktemp("seaweed-auth")
    config = root / "s3.json"
    identity = {
        "name": "ckpt-tests",
        "credentials": [
            {
                "accessKey": os.environ["AWS_ACCESS_KEY_ID"],
                "secretKey": os.environ["AWS_SECRET_ACCESS_KEY"],
            }
        ],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    server = AuthSeaweed(root)
    server.config = config
    server.start()
    try:
        yield server.endpoint_url
    finally:
        server.stop()


def make_case(
    name: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> Case:
    db = f"sqlite:///{tmp_path / 'manifest.db'}"
    store = str(tmp_path / "store")
    if name == "bad store scheme":
        return Case(
            ["--db", db, "--store", "ftp://x", "verify"],
            lambda: open_run("r", db=db, store="ftp://x"),
            ConfigError,
            ("unsupported store URL scheme 'ftp'", "use a directory path", "s3://bucket/prefix"),
            exit_code=2,
        )
    if name == "s3 URL without a bucket":
        return Case(
            ["--db", db, "--store", "s3://", "verify"],
            lambda: open_run("r", db=db, store="s3://"),
            ConfigError,
            ("store URL 's3://' has no bucket", "use s3://bucket/prefix"),
            exit_code=2,
        )
    if name == "missing bucket":
        endpoint = request.getfixturevalue("seaweed_endpoint").endpoint_url
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        bucket = s3servers.random_bucket_name("missing")

        def save() -> None:
            with open_run("r", db=db, store=f"s3://{bucket}/ckpt") as run:
                run.save(1, {"policy": weights(1)}).wait()

        return Case(
            ["--db", db, "--store", f"s3://{bucket}/ckpt", "gc", "--dry-run"],
            save,
            SaveError,
            (f"bucket {bucket!r} does not exist at {endpoint}", "create it or fix the store URL"),
        )
    if name == "wrong credentials":
        endpoint = request.getfixturevalue("auth_seaweed")
        bucket = s3servers.random_bucket_name("auth")
        client = s3servers.plain_client(endpoint)
        client.create_bucket(Bucket=bucket)
        client.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-key")

        def save() -> None:
            with open_run("r", db=db, store=f"s3://{bucket}/ckpt") as run:
                run.save(1, {"policy": weights(1)}).wait()

        return Case(
            ["--db", db, "--store", f"s3://{bucket}/ckpt", "gc", "--dry-run"],
            save,
            SaveError,
            ("access denied (", "check the credentials"),
        )
    if name == "unreachable database":
        url = "postgresql://127.0.0.1:1/x"
        return Case(
            ["--db", url, "runs"],
            lambda: open_run("r", db=url, store=store),
            DatabaseError,
            ("cannot reach the manifest database", "127.0.0.1:1", "check the URL and that the"),
        )
    if name.startswith("out-of-date schema"):
        if name.endswith("(PostgreSQL)"):
            db = request.getfixturevalue("pg_schema_url")
        # An old ckptstore created it: the database stops at revision 0002.
        assert main(["--db", db, "db", "upgrade", "0002"]) == 0
        return Case(
            ["--db", db, "runs"],
            lambda: open_run("r", db=db, store=store),
            SchemaError,
            (
                "schema revision 0002, this ckptstore needs",
                f"run `ckptstore db upgrade --db {redact(resolve_url(db))}`",
            ),
        )
    if name == "schema newer than ckptstore":
        database = Database(db)
        with database.engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = 'f00d'"))
        database.close()
        return Case(
            ["--db", db, "runs"],
            lambda: open_run("r", db=db, store=store),
            SchemaError,
            ("schema revision f00d, newer than this ckptstore knows", "upgrade ckptstore"),
        )
    if name == "no such run":
        Database(db).close()
        Path(store).mkdir()  # a reader needs an existing store; the run is what is missing
        return Case(
            ["--db", db, "ls", "nope"],
            lambda: open_run("nope", db=db, store=store, writable=False),
            CheckpointNotFoundError,
            ("no run named 'nope'",),
        )
    raise AssertionError(name)


CASES = [
    "bad store scheme",
    "s3 URL without a bucket",
    pytest.param("missing bucket", marks=pytest.mark.integration),
    pytest.param("wrong credentials", marks=pytest.mark.integration),
    "unreachable database",
    "out-of-date schema",
    pytest.param("out-of-date schema (PostgreSQL)", marks=pytest.mark.integration),
    "schema newer than ckptstore",
    "no such run",
]


@pytest.mark.parametrize("name", CASES)
def test_actionable_error(
    name: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    case = make_case(name, tmp_path, request, monkeypatch)
    one_line = 0
    try:
        with pytest.raises(case.error) as info:
            case.api()
        api_message = str(info.value)
        for phrase in case.says:
            assert phrase in api_message, (phrase, api_message)

        code, out, err = run_cli(capsys, *case.argv)
        assert code == case.exit_code, (out, err)
        assert out == ""
        assert err.startswith("ckptstore: error: ")
        assert "Traceback" not in err
        for phrase in case.says:
            assert phrase in err, (phrase, err)
        one_line = int(err.count("\n") == 1 and err.endswith("\n"))
    finally:
        reliability_report.add(ACTIONABLE, cases=1, one_line=one_line)
    if not one_line:
        raise NotOneLine(f"stderr is not one line: {err!r}")


# -- 7. a store that is not the one the checkpoints live in --------------------------------------


@pytest.mark.integration
def test_resuming_against_a_missing_bucket_loses_nothing(
    seaweed_store_factory: S3StoreFactory,
    sqlite_url: str,
    reliability_report: Any,
) -> None:
    good = seaweed_store_factory()
    with open_writer(sqlite_url, good) as run:
        run.save(1, {"policy": weights(1)})
        run.save(2, {"policy": weights(2)})
    typo = seaweed_store_factory(bucket=s3servers.random_bucket_name("typo"))
    with open_run("r", db=sqlite_url, store=typo) as run:
        with pytest.raises(ObjectStoreError, match="does not exist") as info:
            run.load()
        assert not isinstance(info.value, IntegrityError | CheckpointNotFoundError)
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "committed"),
            (2, "committed"),
        ]
    assert_nothing_lost(sqlite_url, good)
    reliability_report.add(HOSTILE, rejected=1, code_executed=0, escaped_writes=0)


def test_resuming_against_an_empty_store_directory_loses_nothing(
    sqlite_url: str, store: LocalStore, tmp_path: Path, reliability_report: Any
) -> None:
    with open_writer(sqlite_url, store) as run:
        run.save(1, {"policy": weights(1)})
        run.save(2, {"policy": weights(2)})
    with open_run("r", db=sqlite_url, store=tmp_path / "not-mounted") as run:
        with pytest.raises(CkptStoreError) as info:
            run.load()
        assert not isinstance(info.value, CheckpointNotFoundError), info.value
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "committed"),
            (2, "committed"),
        ]
    assert_nothing_lost(sqlite_url, store)
    reliability_report.add(HOSTILE, rejected=1, code_executed=0, escaped_writes=0)


def assert_nothing_lost(db: str, store: ObjectStore) -> None:
    """Two GC passes with no grace, then the newest checkpoint loads exactly."""
    database = Database(db)
    try:
        for _ in range(2):
            collect_garbage(database, store, grace=dt.timedelta(0))
    finally:
        database.close()
    with open_run("r", db=db, store=store, writable=False) as run:
        loaded = run.load()
        assert (loaded.info.step, loaded.skipped) == (2, ())
        assert_exact(loaded.state["policy"], weights(2))


@pytest.mark.integration
@pytest.mark.parametrize("command", ["verify", "export"])
def test_cli_against_a_missing_bucket_names_the_bucket(
    seaweed_store_factory: S3StoreFactory,
    sqlite_url: str,
    tmp_path: Path,
    command: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    good = seaweed_store_factory()
    with open_writer(sqlite_url, good) as run:
        run.save(1, {"policy": weights(1)})
    monkeypatch.setenv("AWS_ENDPOINT_URL", str(seaweed_store_factory.endpoint_url))
    bucket = s3servers.random_bucket_name("typo")
    argv = ["verify"] if command == "verify" else ["export", "r@1", str(tmp_path / "out")]
    code, out, err = run_cli(capsys, "--db", sqlite_url, "--store", f"s3://{bucket}/x", *argv)
    with open_run("r", db=sqlite_url, store=good, writable=False) as run:
        assert [(c.step, c.status) for c in run.checkpoints()] == [(1, "committed")]
    assert code == 3, (out, err)
    assert err.count("\n") == 1, err
    assert f"bucket {bucket!r} does not exist" in err
    reliability_report.add(ACTIONABLE, cases=1, one_line=1)
