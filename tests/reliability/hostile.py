"""What the hostile-input tests share: the report's families, small states, committing a crafted
index as a worker's receipt would, running the CLI as a fresh process logs, and watching files
and memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.cas import BlobRef, Kind, put_blob
from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer import CheckpointInfo, Run, open_run
from ckptstore.checkpointer.shards import ShardReceipt
from ckptstore.cli import main
from ckptstore.objectstore import ObjectStore
from ckptstore.serialize import ComponentResult

HOSTILE = "hostile input"
SECRETS = "secrets"
ACTIONABLE = "actionable errors"
#: Tensors of 1 KiB and more get chunks of their own.
OPTIONS = WriterOptions(pack_threshold=1024, compression="never", max_workers=2)
MiB = 1 << 20
GiB = 1 << 30


def weights(seed: int) -> dict[str, Any]:
    """A small reproducible component: a 16x16 matrix and a bias."""
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 16, generator=gen), "b": torch.randn(4, generator=gen)}


def assert_exact(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Same keys in the same order, same dtypes, equal tensors."""
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype
        assert torch.equal(actual[key], value), key


def put_index(store: ObjectStore, tree: Any, entries: list[Any]) -> BlobRef:
    """Store a hand-written component index (any tree and entries, however hostile)."""
    body = {"format": "ckptstore/index", "version": 1, "tree": tree, "entries": entries}
    return put_blob(store, json.dumps(body).encode(), Kind.INDEX)


def tensor_entry(path: str, dtype: str, shape: list[int], nbytes: int, segments: Any) -> Any:
    """An index entry for a tensor, with whatever sizes and segments it claims."""
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
    """A writable run whose saves are synchronous."""
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
    """``ckptstore ARGV`` in-process, logging as in a fresh process: (code, stdout, stderr)."""
    capsys.readouterr()
    with cli_logging():
        code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def files_under(root: Path) -> set[Path]:
    """Every file and link under ``root``."""
    return {p for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def stray_files(tmp_path: Path, *allowed: Path) -> set[Path]:
    """Files under ``tmp_path`` outside the ``allowed`` files and directories and the manifest
    database's own files: what a hostile input made something write where it should not."""
    return {
        p
        for p in files_under(tmp_path)
        if not p.name.startswith("manifest.db") and not any(p.is_relative_to(a) for a in allowed)
    }


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
