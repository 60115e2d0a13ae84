"""A DCP save through a run uses the run's writer options (``open_run(writer_options=...)``),
as ``Run.save`` does, unless the call gives its own: a run opened with ``compression="never"``
stored its DCP saves compressed."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import ckptstore
from ckptstore.cas import WriterOptions
from ckptstore.integrations import dcp as ckpt_dcp

MiB = 1 << 20


def _stored_bytes(tmp_path: Path, name: str, **save_options: object) -> int:
    warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
    state = {"mask": torch.zeros(MiB // 4)}  # 1 MiB of zeros: compresses to almost nothing
    with ckptstore.open_run(
        name,
        db=tmp_path / "m.db",
        store=tmp_path / name,
        async_save=False,
        writer_options=WriterOptions(compression="never"),
    ) as run:
        info = ckpt_dcp.save(state, run, 1, **save_options)  # type: ignore[arg-type]
        assert isinstance(info, ckptstore.CheckpointInfo)
        back = {"mask": torch.ones(MiB // 4)}
        ckpt_dcp.load(back, run, 1)
        assert torch.equal(back["mask"], state["mask"])
        return info.uploaded_bytes


def test_the_runs_writer_options_apply_to_a_dcp_save(tmp_path: Path) -> None:
    assert _stored_bytes(tmp_path, "run-options") >= MiB  # stored raw, as the run asked


def test_options_given_to_the_save_win(tmp_path: Path) -> None:
    given = WriterOptions(compression="always")
    assert _stored_bytes(tmp_path, "save-options", writer_options=given) < MiB // 8
