"""Hostile input against export: tensor names and component names from a committed checkpoint
(a worker chose them) that read as paths out of the export directory -- ``..``, absolute
paths, a symlink inside the directory -- are refused and nothing at all is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hostile import (
    HOSTILE,
    commit,
    files_under,
    open_writer,
    put_index,
    run_cli,
    tensor_entry,
    weights,
)
from sqlalchemy import create_engine, text

from ckptstore.cas import Kind, put_blob
from ckptstore.errors import ConfigError, SerializationError
from ckptstore.maintenance import export_component
from ckptstore.maintenance.export import safe_path
from ckptstore.objectstore import LocalStore

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
