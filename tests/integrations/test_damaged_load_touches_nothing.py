"""Issue 40's invariant when the stored bytes themselves are damaged: a load that finds a blob
failing verification touches no target -- not the tensors whose blobs verified before it, not
the plain values -- and names what failed. Run.load(into=) covers it in
tests/checkpointer/test_fallback_into_targets.py; here the DCP load (which torchtitan's resume
uses), atomic by default, and its streaming opt-out for contrast."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from ckptstore.cas import blob_key
from ckptstore.checkpointer import open_run
from ckptstore.errors import IntegrityError
from ckptstore.integrations import dcp as ckpt_dcp
from ckptstore.serialize import read_index

N = 1 << 18  # 1 MiB of fp32 per tensor: one blob each


def _damage_one_blob(run: object, store_dir: Path) -> None:
    """Flip a byte in the third tensor's blob of the rank's component."""
    info = run.checkpoint(1)  # type: ignore[attr-defined]
    [rank] = [c for c in info.components if c.name.endswith("rank0")]
    entries = read_index(run.store, rank.index_digest).entries  # type: ignore[attr-defined]
    digest = entries[2].segments[0].digest
    blob = store_dir / blob_key(digest)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))


def _saved() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {**{k: torch.randn(N, generator=g) for k in "abcd"}, "step": 7}


def _targets() -> dict[str, object]:
    return {**{k: torch.full((N,), -7.0) for k in "abcd"}, "step": -1}


def test_a_dcp_load_of_a_damaged_blob_touches_no_target(tmp_path: Path) -> None:
    warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        ckpt_dcp.save(_saved(), run, 1)
        _damage_one_blob(run, tmp_path / "s")
        state = _targets()
        with pytest.raises(IntegrityError):
            ckpt_dcp.load(state, run, 1)
    assert state["step"] == -1
    for key in "abcd":
        assert bool((state[key] == -7.0).all()), f"{key!r} was written"  # type: ignore[union-attr]


def test_a_streaming_dcp_load_writes_as_blobs_verify(tmp_path: Path) -> None:
    """``reader.atomic = False``: the boxes whose blobs verified are written as they arrive
    (what the atomic default holds back), the damaged one never."""
    warnings.simplefilter("ignore", UserWarning)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptstore.integrations.dcp import CkptStoreReader, NoPickleLoadPlanner

    saved = _saved()
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        ckpt_dcp.save(saved, run, 1)
        _damage_one_blob(run, tmp_path / "s")
        state = _targets()
        reader = CkptStoreReader.from_run(run, 1, max_workers=1)
        reader.atomic = False
        with pytest.raises(CheckpointException, match="corrupt"):  # DCP wraps each rank's error
            dcp.load(state, storage_reader=reader, planner=NoPickleLoadPlanner())
    written = [k for k in "abcd" if torch.equal(state[k], saved[k])]  # type: ignore[arg-type]
    assert written, "a streaming load writes the boxes that verified"
    assert not torch.equal(state["c"], saved["c"])  # type: ignore[arg-type]
