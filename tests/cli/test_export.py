"""``ckptstore export RUN@STEP DIR``: one file per component, safetensors or torch, bit-exact, and
never a file outside DIR.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from populated import (
    OPTIONS,
    Populated,
    alpha_state,
    assert_one_line_error,
    assert_same,
    beta_state,
    cli,
    cli_json,
    flatten,
    randn,
)
from safetensors import safe_open
from safetensors.torch import load_file
from sqlalchemy import text

from ckptstore.checkpointer import open_run
from ckptstore.cli import main
from ckptstore.manifest import Database


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, to compare bit for bit (NaNs and signed zeros included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def tree(path: Path) -> dict[str, bytes | str]:
    """Everything under ``path`` (not following links): relative path -> bytes or link target."""
    found: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = str(full.relative_to(path))
            if full.is_symlink():
                found[rel] = f"-> {os.readlink(full)}"
            elif full.is_file():
                found[rel] = full.read_bytes()
            else:
                found[rel] = "<dir>"
    return found


def test_export_safetensors_round_trips(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = populated.work / "alpha-4"
    code, out, err = cli(populated, capsys, "export", "alpha@4", str(out_dir))
    assert (code, err) == (0, "")
    files = {out_dir / "optimizer.safetensors", out_dir / "policy.safetensors"}
    assert {Path(line) for line in out.split()} == files
    assert {p for p in out_dir.rglob("*") if p.is_file()} == files  # no leftovers
    saved = alpha_state(4)
    for name in ("policy", "optimizer"):
        path = out_dir / f"{name}.safetensors"
        expected = flatten(saved[name])
        tensors = load_file(str(path))
        assert sorted(tensors) == sorted(p for p, v in expected.items() if torch.is_tensor(v))
        for entry, value in tensors.items():
            assert_same(value, expected[entry])
            assert torch.equal(as_bytes(value), as_bytes(expected[entry]))
        with safe_open(str(path), framework="pt") as f:
            values = json.loads(f.metadata()["ckptstore.values"])
        assert values == {p: v for p, v in expected.items() if not torch.is_tensor(v)}

    # Nested component names become directories; --json lists the files.
    out_dir = populated.work / "beta-2"
    record = cli_json(populated, capsys, "export", "beta@2", str(out_dir))
    assert sorted(record["files"]) == [
        str(out_dir / "policy" / "rank0.safetensors"),
        str(out_dir / "policy" / "rank1.safetensors"),
    ]
    for rank in (0, 1):
        tensors = load_file(str(out_dir / "policy" / f"rank{rank}.safetensors"))
        expected = beta_state(2)[f"policy/rank{rank}"]
        assert sorted(tensors) == sorted(expected)
        assert_same({k: tensors[k] for k in expected}, expected)


def test_export_torch_format(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = populated.work / "torch"
    for target, state in (("alpha@7", alpha_state(7)), ("beta@1", beta_state(1))):
        code, out, err = cli(
            populated, capsys, "export", target, str(out_dir / target), "--format", "torch"
        )
        assert (code, err) == (0, "")
        for name, component in state.items():
            path = out_dir / target / f"{name}.pt"
            assert str(path) in out.split()
            assert_same(torch.load(path, weights_only=False), component)
            # Plain tensors, containers and numbers: loadable without unpickling code, too.
            assert_same(torch.load(path, weights_only=True), component)


def test_export_refuses_names_that_leave_the_directory(
    db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    parent = tmp_path / "exports"
    out_dir = parent / "out"
    out_dir.mkdir(parents=True)
    (parent / "outside").mkdir()
    (out_dir / "link").symlink_to(parent / "outside", target_is_directory=True)
    bad_components = ["../../etc/x", "../escape", "/etc/passwd", "a/../../b", "link/x", "a\\..\\b"]
    tensor_value = randn(1, 8)
    with open_run("nasty", db=db_url, store=root, writer_options=OPTIONS) as run:
        for step in range(1, len(bad_components) + 1):
            run.save(step, {"policy": {"w": tensor_value}}).wait()
        # A well-named component whose entry path climbs out.
        entry_step = len(bad_components) + 1
        run.save(entry_step, {"policy": {"..": {"..": {"etc": {"x": tensor_value}}}}}).wait()
    # save() refuses such names now; a manifest written before it did may still hold them.
    database = Database(db_url)
    try:
        with database.engine.begin() as conn:
            for step, name in enumerate(bad_components, start=1):
                conn.execute(
                    text(
                        "UPDATE components SET name = :name WHERE checkpoint_id = "
                        "(SELECT id FROM checkpoints WHERE step = :step)"
                    ),
                    {"name": name, "step": step},
                )
    finally:
        database.close()
    base = ["--db", db_url, "--store", str(root)]
    before = tree(parent)

    for fmt in ("safetensors", "torch"):
        for step, name in enumerate(bad_components, start=1):
            capsys.readouterr()
            code = main([*base, "export", f"nasty@{step}", str(out_dir), "--format", fmt])
            out, err = capsys.readouterr()
            assert (code, out) == (2, ""), name
            assert_one_line_error(err, repr(name))
            assert tree(parent) == before, name
        capsys.readouterr()
        code = main([*base, "export", f"nasty@{entry_step}", str(out_dir), "--format", fmt])
        out, err = capsys.readouterr()
        assert (code, out) == (3, "")
        assert_one_line_error(err, "../../etc/x", "refusing")
        assert tree(parent) == before
    assert not (tmp_path / "etc").exists()
