"""The CLI on a GCS store, unchanged: ``--store gs://bucket/prefix`` with the emulator found
through ``STORAGE_EMULATOR_HOST`` lists, verifies and exports a checkpoint that the Python API
saved there; a missing bucket is one error line, at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gcsserver
import torch
from safetensors.torch import load_file

import ckptstore
from ckptstore.objectstore import open_store


def ckpt(args: list[str], emulator: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, STORAGE_EMULATOR_HOST=emulator, CKPTSTORE_LOCAL_DIR="")
    return subprocess.run(
        [sys.executable, "-m", "ckptstore", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
        check=False,
    )


def test_cli_lists_verifies_and_exports_from_gs(
    gcs_store_url: str, gcs_emulator: gcsserver.GCSEmulator, tmp_path: Path
) -> None:
    db = str(tmp_path / "manifest.db")
    weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3)}
    with ckptstore.open_run("r", db=db, store=gcs_store_url, async_save=False) as run:
        run.save(1, {"model": weights})
    with open_store(gcs_store_url, create=False) as store:
        assert any(info.key.startswith("cas/") for info in store.list())
    common = ["--db", db, "--store", gcs_store_url]
    endpoint = gcs_emulator.endpoint_url

    listed = ckpt([*common, "ls", "r", "--json"], endpoint, tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert [row["step"] for row in json.loads(listed.stdout)] == [1]

    verified = ckpt([*common, "verify", "r@1"], endpoint, tmp_path)
    assert verified.returncode == 0, verified.stderr

    out = tmp_path / "export"
    exported = ckpt(
        [*common, "export", "r@1", str(out), "--format", "safetensors"], endpoint, tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    tensors = {}
    for path in out.rglob("*.safetensors"):
        tensors.update(load_file(path))
    assert any(torch.equal(t, weights["w"]) for t in tensors.values()), sorted(tensors)


def test_cli_missing_bucket_is_one_line_at_once(
    gcs_emulator: gcsserver.GCSEmulator, tmp_path: Path
) -> None:
    db = str(tmp_path / "manifest.db")
    with ckptstore.open_run("r", db=db, store=tmp_path / "local", async_save=False) as run:
        run.save(1, {"model": {"w": torch.ones(4)}})
    start = time.monotonic()
    done = ckpt(
        ["--db", db, "--store", "gs://no-such-bucket/ckpts", "verify"],
        gcs_emulator.endpoint_url,
        tmp_path,
    )
    lines = done.stderr.splitlines()
    assert done.returncode == 3, done.stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith("ckptstore: error: store gs://no-such-bucket/ckpts")
    assert "gcloud storage buckets create gs://no-such-bucket" in lines[0]
    assert time.monotonic() - start < 20
