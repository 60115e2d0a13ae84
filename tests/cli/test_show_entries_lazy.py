"""``ckptstore show RUN@STEP --entries`` reads indexes, never tensors, so it answers without
importing torch: a plain checkpoint's entries come from its components' indexes, a DCP
checkpoint's state dict from its metadata document (``integrations._common.dcp_listing``),
which lists what the loader's own decoding (``dcp._reader.state_dict_items``) lists. Importing
torch (and torch.distributed.checkpoint) made the command take 14.5 s instead of 1.4 s. A
local store does not import boto3 either."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from crafted_checkpoints import MegatronCheckpoint, Shard, commit_megatron, rows

import ckptstore
from ckptstore.errors import IntegrityError, MalformedMetadataError, UnreadableError
from ckptstore.integrations import dcp as ckpt_dcp
from ckptstore.integrations._common import (
    dcp_listing,
    megatron_layout,
    megatron_listing,
    megatron_source,
)
from ckptstore.integrations.dcp import _metadata, _reader
from ckptstore.objectstore import open_store

# Runs the command in a fresh interpreter; reports its exit code, output and whether it
# imported torch, and boto3 (which a local store does not need either).
PROBE = """
import contextlib, io, json, sys
from ckptstore.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "out": out.getvalue(), "torch": "torch" in sys.modules,
                  "boto3": "boto3" in sys.modules}))
"""

STATE = {
    "model": {"w": torch.ones(5, 4), "b": torch.zeros(3, dtype=torch.bfloat16)},
    "optim": {"lr": 0.1, "step": torch.tensor(7)},
    "epoch": 3,
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Run ``r``: step 1 a DCP checkpoint, step 2 a plain one, step 3 a Megatron one."""
    root = tmp_path_factory.mktemp("lazy-show")
    db, store = str(root / "m.db"), str(root / "store")
    with ckptstore.open_run("r", db=db, store=store, async_save=False) as run:
        ckpt_dcp.save(STATE, run, 1)
        run.save(2, {"model": {"w": torch.ones(4)}, "meta": {"note": "plain"}})
        shards = [
            Shard("decoder.w", [6, 8], [0, 0], rows(3, 8)),
            Shard("decoder.w", [6, 8], [3, 0], rows(3, 8, start=3)),
            Shard("embed", [2, 8], [0, 0], rows(2, 8, dtype=torch.bfloat16)),
        ]
        commit_megatron(run, 3, MegatronCheckpoint(shards))
    return db, store


def probe(site: tuple[str, str], tmp_path: Path, *command: str) -> dict[str, object]:
    db, store = site
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "--db", db, "--store", store, *command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(report, dict)
    return report


@pytest.mark.parametrize("target", ["r@1", "r@2", "r@3"], ids=["dcp", "plain", "megatron"])
def test_show_entries_imports_no_torch(site: tuple[str, str], tmp_path: Path, target: str) -> None:
    report = probe(site, tmp_path, "show", target, "--entries", "--json")
    assert report["code"] == 0, report
    assert report["torch"] is False
    assert report["boto3"] is False
    doc = json.loads(str(report["out"]))
    if target == "r@1":
        items = {i["name"]: i for i in doc["state_dict"]["items"]}
        assert items["model.w"] == {
            "name": "model.w",
            "kind": "tensor",
            "dtype": "float32",
            "shape": [5, 4],
            "ranks": [0],
        }
        assert items["epoch"]["kind"] == "value"
    elif target == "r@3":
        assert doc["state_dict"]["items"] == [
            {"name": "decoder.w", "kind": "tensor", "dtype": "float32", "shape": [6, 8]}
            | {"ranks": [0]},
            {"name": "embed", "kind": "tensor", "dtype": "bfloat16", "shape": [2, 8]}
            | {"ranks": [0]},
        ]
    else:
        entries = {e["path"]: e for e in doc["entries"]["model"]}
        assert entries["w"]["shape"] == [4]
        assert entries["w"]["dtype"] == "float32"


def test_the_text_listing_imports_no_torch(site: tuple[str, str], tmp_path: Path) -> None:
    report = probe(site, tmp_path, "show", "r@1", "--entries")
    assert report["torch"] is False
    assert "state dict (torch DCP):" in str(report["out"])


def test_the_listings_agree_with_the_loaders_decoding(site: tuple[str, str]) -> None:
    db, store_path = site
    with ckptstore.open_run("r", db=db, store=store_path, writable=False) as run:
        dcp_info, megatron_info = run.checkpoint(1), run.checkpoint(3)
    store = open_store(store_path, create=False)
    try:
        listed = dcp_listing.state_dict_items(store, dcp_info)
        assert listed == _reader.state_dict_items(store, dcp_info)
        listed = megatron_listing.state_dict_items(store, megatron_info)
        assert listed == megatron_source.state_dict_items(store, megatron_info)
    finally:
        store.close()


def test_the_constants_are_the_writers() -> None:
    assert dcp_listing.COMPONENT_FORMAT == _metadata.METADATA_FORMAT
    assert dcp_listing.DOCUMENT_FORMAT == _metadata.FORMAT
    assert dcp_listing.DOCUMENT_VERSION == _metadata.VERSION
    assert megatron_listing.FORMAT == megatron_layout.FORMAT
    assert megatron_listing.VERSION == megatron_layout.VERSION


@pytest.mark.parametrize(
    ("layout", "error"),
    [
        (None, "not a JSON object"),
        ('{"tensors": []}', "missing field 'objects'"),
        (
            '{"tensors": [["k", "megatron/rank0", "t0", "float32", [2]]], "objects": []}',
            "7-element",
        ),
        (
            '{"tensors": [["k", "megatron/meta", "t0", "float32", [2], [0], [2]]], "objects": []}',
            "no rank component",
        ),
        (
            '{"tensors": [["k", "megatron/rank0", "t0", "float32", [-2], [0], [2]]], '
            '"objects": []}',
            "non-negative",
        ),
    ],
)
def test_a_malformed_layout_is_one_clear_error(layout: str | None, error: str) -> None:
    with pytest.raises(IntegrityError, match=rf"run 'r', step 3: malformed Megatron .*{error}"):
        megatron_listing.layout_items(layout, "run 'r', step 3")


@pytest.mark.parametrize(
    ("document", "error"),
    [
        ("[1, 2]", "not a ckptstore DCP metadata document"),
        ('{"format": "ckptstore/dcp-metadata", "version": 0}', "version 0"),
        (
            '{"format": "ckptstore/dcp-metadata", "version": 1, "values": [], "tensors": '
            '{"w": {"dtype": "float32", "size": [-1]}}, "locations": []}',
            "non-negative integer",
        ),
        ('{"format": "ckptstore/dcp-metadata", "version": 1}', "missing field"),
    ],
)
def test_a_malformed_document_is_one_clear_error(document: str, error: str) -> None:
    with pytest.raises(MalformedMetadataError, match=rf"run 'r', step 1: malformed .*{error}"):
        dcp_listing.document_items(document, "run 'r', step 1")


def test_a_newer_document_says_upgrade() -> None:
    doc = '{"format": "ckptstore/dcp-metadata", "version": 99}'
    with pytest.raises(UnreadableError, match=r"newer than this ckptstore reads.*upgrade"):
        dcp_listing.document_items(doc, "run 'r', step 1")
