"""``ckptstore export`` of a DCP or Megatron checkpoint whose metadata lies: one clean error line,
a non-zero exit, and nothing written -- never uninitialised memory in a file, a 256 MiB file
for 1 MiB of data, or a traceback.

The checkpoints are committed through the public API (crafted_checkpoints.py): healthy blobs,
valid digests, wrong metadata.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from crafted_checkpoints import (
    DCP_LIES,
    MEGATRON_LIES,
    MegatronCheckpoint,
    Shard,
    commit_dcp,
    commit_megatron,
    nested,
    rows,
)

import ckptstore
from ckptstore.checkpointer import Run
from ckptstore.cli import main
from ckptstore.cli.exits import EXIT_ERROR


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    with ckptstore.open_run("lies", db=tmp_path / "m.db", store=tmp_path / "store") as opened:
        yield opened


def export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], step: int, *options: str
) -> tuple[int, str, str]:
    capsys.readouterr()
    base = ["--db", str(tmp_path / "m.db"), "--store", str(tmp_path / "store")]
    code = main([*base, "export", f"lies@{step}", str(tmp_path / "out"), *options])
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *needles: str, fmt: str = "safetensors"
) -> None:
    code, out, err = export(tmp_path, capsys, 1, "--format", fmt)
    assert (code, out) == (EXIT_ERROR, "")
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckptstore: error: run 'lies', step 1"), err
    for needle in needles:
        assert needle in lines[0], err
    assert not (tmp_path / "out").exists()  # no file, not even the directory


@pytest.mark.parametrize("case", list(DCP_LIES))
def test_export_of_a_dcp_checkpoint_whose_metadata_lies_is_refused(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    tensor, _, needle = DCP_LIES[case]
    commit_dcp(run, 1, {"w": tensor})
    assert_refused(tmp_path, capsys, "tensor 'w'", needle)


def test_export_of_dcp_metadata_nested_100000_deep_is_refused(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    commit_dcp(run, 1, {}, text=nested(100_000))
    assert_refused(tmp_path, capsys, "nested deeper than any writer", fmt="torch")


@pytest.mark.parametrize("case", list(MEGATRON_LIES))
def test_export_of_a_megatron_checkpoint_whose_layout_lies_is_refused(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    checkpoint, needle = MEGATRON_LIES[case]
    commit_megatron(run, 1, checkpoint)
    assert_refused(tmp_path, capsys, "tensor 'w'", needle)


def test_export_of_a_megatron_layout_nested_100000_deep_is_refused(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = Shard("w", [128, 64], [0, 0], rows(128))
    commit_megatron(run, 1, MegatronCheckpoint([shard], layout_text=nested(100_000)))
    assert_refused(tmp_path, capsys, "nested deeper than any writer")
