"""The CLI on an Azure store, unchanged: ``--store az://container/prefix`` with the credentials in
``AZURE_STORAGE_CONNECTION_STRING`` (Azurite's here) lists, verifies and exports a checkpoint that
the Python API saved there; a missing container is one error line, at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from azureserver import AzureStoreFactory
from safetensors.torch import load_file

import ckptstore


def ckpt(args: list[str], connection: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, AZURE_STORAGE_CONNECTION_STRING=connection, CKPTSTORE_LOCAL_DIR="")
    return subprocess.run(
        [sys.executable, "-m", "ckptstore", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
        check=False,
    )


def test_cli_lists_verifies_and_exports_from_az(
    azure_store_factory: AzureStoreFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    connection = azure_store_factory.endpoint.connection_string
    url = f"az://{azure_store_factory.container}/{azure_store_factory.prefix}"
    db = str(tmp_path / "manifest.db")
    weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3)}
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection)
    with ckptstore.open_run("r", db=db, store=url, async_save=False) as run:
        run.save(1, {"model": weights})
    assert any(k.startswith("cas/") for k in (i.key for i in azure_store_factory().list()))
    common = ["--db", db, "--store", url]

    listed = ckpt([*common, "ls", "r", "--json"], connection, tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert [row["step"] for row in json.loads(listed.stdout)] == [1]

    verified = ckpt([*common, "verify", "r@1"], connection, tmp_path)
    assert verified.returncode == 0, verified.stderr

    out = tmp_path / "export"
    exported = ckpt(
        [*common, "export", "r@1", str(out), "--format", "safetensors"], connection, tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    tensors = {}
    for path in out.rglob("*.safetensors"):
        tensors.update(load_file(path))
    assert any(torch.equal(t, weights["w"]) for t in tensors.values()), sorted(tensors)


def test_cli_missing_container_is_one_line_at_once(
    azure_store_factory: AzureStoreFactory, tmp_path: Path
) -> None:
    db = str(tmp_path / "manifest.db")
    with ckptstore.open_run("r", db=db, store=tmp_path / "local", async_save=False) as run:
        run.save(1, {"model": {"w": torch.ones(4)}})
    start = time.monotonic()
    done = ckpt(
        ["--db", db, "--store", "az://no-such-container/ckpts", "verify"],
        azure_store_factory.endpoint.connection_string,
        tmp_path,
    )
    lines = done.stderr.splitlines()
    assert done.returncode == 3, done.stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith("ckptstore: error: store az://no-such-container/ckpts")
    assert "az storage container create --name no-such-container" in lines[0]
    assert time.monotonic() - start < 20
