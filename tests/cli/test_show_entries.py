"""``ckptstore show RUN@STEP --entries`` names a DCP or Megatron checkpoint's state dict --
each fqn with its global dtype and shape and the ranks that hold it -- instead of listing its
rank components' items as ``0, 1, 2 ...``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from crafted_checkpoints import MegatronCheckpoint, Shard, commit_megatron, rows

import ckptstore
from ckptstore.cli import main
from ckptstore.integrations import dcp as ckpt_dcp


@pytest.fixture
def site(tmp_path: Path) -> tuple[list[str], Any]:
    db, store = tmp_path / "m.db", tmp_path / "store"
    with ckptstore.open_run("r", db=db, store=store, async_save=False) as run:
        yield ["--db", str(db), "--store", str(store)], run


def show(capsys: pytest.CaptureFixture[str], base: list[str], *args: str) -> str:
    capsys.readouterr()
    code = main([*base, "show", *args])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    return out


def test_a_dcp_checkpoint_is_listed_by_state_dict_name(
    site: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    base, run = site
    state = {
        "model": {"w": torch.ones(5, 4), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "epoch": 3,
    }
    ckpt_dcp.save(state, run, 1)
    doc = json.loads(show(capsys, base, "--json", "r@1", "--entries"))
    assert doc["state_dict"]["format"] == "torch DCP"
    items = {i["name"]: i for i in doc["state_dict"]["items"]}
    assert items["model.w"] == {
        "name": "model.w",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [5, 4],
        "ranks": [0],
    }
    assert items["model.b"]["dtype"] == "bfloat16"
    assert items["epoch"] == {
        "name": "epoch",
        "kind": "value",
        "dtype": None,
        "shape": None,
        "ranks": [0],
    }
    # The rank and metadata components' numbered items are not listed.
    assert not any(name.startswith("dcp/") for name in doc["entries"])
    text = show(capsys, base, "r@1", "--entries")
    assert "state dict (torch DCP):" in text
    line = next(line for line in text.splitlines() if line.startswith("model.w"))
    assert line.split() == ["model.w", "tensor", "float32", "[5,4]", "0"]


def test_a_megatron_checkpoint_is_listed_by_key(
    site: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    base, run = site
    shards = [
        Shard("decoder.w", [6, 8], [0, 0], rows(3, 8)),
        Shard("decoder.w", [6, 8], [3, 0], rows(3, 8, start=3)),
        Shard("embed", [2, 8], [0, 0], rows(2, 8, dtype=torch.bfloat16)),
    ]
    commit_megatron(run, 2, MegatronCheckpoint(shards))
    doc = json.loads(show(capsys, base, "--json", "r@2", "--entries"))
    assert doc["state_dict"]["format"] == "Megatron-Core"
    assert doc["state_dict"]["items"] == [
        {"name": "decoder.w", "kind": "tensor", "dtype": "float32", "shape": [6, 8], "ranks": [0]},
        {"name": "embed", "kind": "tensor", "dtype": "bfloat16", "shape": [2, 8], "ranks": [0]},
    ]
    assert not any(name.startswith("megatron/rank") for name in doc["entries"])


def test_a_plain_checkpoint_keeps_its_entries(
    site: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    base, run = site
    run.save(3, {"model": {"w": torch.ones(2, 2)}}).wait()
    doc = json.loads(show(capsys, base, "--json", "r@3", "--entries"))
    assert "state_dict" not in doc
    assert [e["path"] for e in doc["entries"]["model"]] == ["w"]
