"""``export --hf`` into a directory that is not empty: an earlier export there is replaced
(its shards and files that the new one does not write again are removed, never left beside
the new ones); safetensors files that no export wrote there are refused before anything is
written. And the side-file reader of ``import``: names, symlinks and sizes checked."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.cli import main
from ckptstore.errors import ConfigError
from ckptstore.integrations import dcp as ckpt_dcp
from ckptstore.integrations.importing import _source, side_files


@pytest.fixture
def site(tmp_path: Path) -> list[str]:
    """--db/--store of a store whose run "m" has step 1 (a DCP checkpoint of 6 tensors)."""
    db, store = tmp_path / "m.db", tmp_path / "store"
    state = {f"layer{i}.weight": torch.full((64, 64), float(i)) for i in range(6)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ckptstore.open_run("m", db=db, store=store, async_save=False) as run:
            ckpt_dcp.save(state, run, 1)
    return ["--db", str(db), "--store", str(store)]


def export(capsys: pytest.CaptureFixture[str], base: list[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main([*base, "export", "m@1", *argv, "--hf"])
    return code, capsys.readouterr().err


def test_a_second_export_replaces_the_first_and_leaves_no_old_shard(
    site: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert export(capsys, site, str(out), "--shard-size", "16KiB") == (0, "")
    assert len(list(out.glob("model-*-of-00006.safetensors"))) == 6
    (out / "notes.md").write_text("mine\n")  # not the export's: left alone
    assert export(capsys, site, str(out)) == (0, "")
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "notes.md",
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}


def test_files_of_an_earlier_export_go_with_it(
    site: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config an earlier export wrote (listed in its index) is not left beside weights it
    does not describe."""
    out = tmp_path / "out"
    assert export(capsys, site, str(out)) == (0, "")
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"]["ckptstore_files"] = ["config.json"]
    index_path.write_text(json.dumps(index))
    (out / "config.json").write_text("{}")
    assert export(capsys, site, str(out)) == (0, "")
    assert not (out / "config.json").exists()


def test_safetensors_that_no_export_wrote_are_refused_before_writing(
    site: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"someone else's")
    code, err = export(capsys, site, str(out))
    assert code == 2
    assert "no earlier export there wrote (model.safetensors)" in err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_an_index_that_is_not_one_is_refused(
    site: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text("[1, 2]")
    code, err = export(capsys, site, str(out))
    assert code == 2
    assert "is not a safetensors index" in err
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../outside.safetensors"}})
    )
    code, err = export(capsys, site, str(out))
    assert (code, "names files outside the directory" in err) == (2, True)


# -- what import keeps of a directory ---------------------------------------------------------


def test_side_files_are_configs_and_tokenizer_files_only(tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json", "merges.txt", "spm.model", "chat.jinja"):
        (tmp_path / name).write_text(name)
    (tmp_path / "model.safetensors").write_bytes(b"w")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    (tmp_path / "README.md").write_text("no")
    (tmp_path / ".hidden.json").write_text("no")
    (tmp_path / "sub.json").mkdir()
    (tmp_path / "vocab.json").symlink_to(tmp_path / "config.json")  # inside: followed
    found = side_files(tmp_path)
    assert sorted(found) == [
        "chat.jinja",
        "config.json",
        "merges.txt",
        "spm.model",
        "tokenizer.json",
        "vocab.json",
    ]
    assert found["vocab.json"] == b"config.json"


def test_a_symlink_out_of_the_directory_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").symlink_to(secret)
    with pytest.raises(ConfigError, match="symlink to a file outside"):
        side_files(model)


def test_odd_names_and_large_files_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "con fig.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a plain file name"):
        side_files(odd)
    big = tmp_path / "big"
    big.mkdir()
    (big / "tokenizer.json").write_bytes(os.urandom(2048))
    monkeypatch.setattr(_source, "MAX_SIDE_FILE", 1024)
    with pytest.raises(ConfigError, match="too large for a config or tokenizer file"):
        side_files(big)
    monkeypatch.setattr(_source, "MAX_SIDE_FILE", 4096)
    monkeypatch.setattr(_source, "MAX_SIDE_TOTAL", 3000)
    (big / "vocab.json").write_bytes(os.urandom(2048))
    with pytest.raises(ConfigError, match="in all"):
        side_files(big)
