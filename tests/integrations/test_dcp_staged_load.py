"""A DCP load into device tensors goes through the staging buffers (``_boxes.BoxWrites``):
atomic, the boxes go to device scratch or wait in host memory and are sent on every thread at
the end; not atomic, each is sent as it verifies. No GPU here: the staging policy is set to
stage CPU targets, which runs all of it but the CUDA calls."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore.cas import blob_key
from ckptstore.checkpointer import open_run
from ckptstore.errors import IntegrityError
from ckptstore.integrations import dcp as ckpt_dcp
from ckptstore.integrations.dcp import CkptStoreReader, NoPickleLoadPlanner
from ckptstore.serialize import read_index, staging
from ckptstore.serialize.staging import Policy, Staging

CPU = frozenset({"cpu"})


@pytest.fixture(autouse=True)
def _single_process_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        yield


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes of each piece put through a staging buffer (the real ``put`` runs)."""
    pieces: list[int] = []
    put = Staging.put

    def counted(self: Staging, target: torch.Tensor, source: torch.Tensor) -> None:
        pieces.append(source.numel() * source.element_size())
        put(self, target, source)

    monkeypatch.setattr(Staging, "put", counted)
    return pieces


def saved() -> dict[str, Any]:
    g = torch.Generator().manual_seed(4)
    return {
        "embed": torch.randn(1024, 300, generator=g),  # 1.2 MiB: a blob of its own
        "norm": torch.randn(300, generator=g),
        "half": torch.randn(64, 48, generator=g).bfloat16(),
        "mask": torch.rand(77, generator=g) > 0.5,
        "step": 7,
    }


def sentinels() -> dict[str, Any]:
    return {
        "embed": torch.full((300, 1024), -7.0).t(),  # not contiguous
        "norm": torch.full((300,), -7.0),
        "half": torch.full((64, 48), -7.0, dtype=torch.bfloat16),
        "mask": torch.ones(77, dtype=torch.bool),
        "step": -1,
    }


def untouched(state: dict[str, Any]) -> bool:
    tensors = [t for t in state.values() if isinstance(t, torch.Tensor)]
    sentinel = {torch.bool: True}
    return state["step"] == -1 and all(
        bool((t == sentinel.get(t.dtype, -7)).all()) for t in tensors
    )


@pytest.mark.parametrize("scratch", [0, 1 << 40], ids=["host-held", "scratch"])
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_a_staged_dcp_load_fills_every_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sent: list[int], atomic: bool, scratch: int
) -> None:
    monkeypatch.setattr(
        staging, "POLICY", Policy(device_types=CPU, cap=50_000, scratch_bytes=scratch)
    )
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        ckpt_dcp.save(saved(), run, 1)
        state = sentinels()
        reader = CkptStoreReader.from_run(run, 1, max_workers=3)
        reader.atomic = atomic
        dcp.load(state, storage_reader=reader, planner=NoPickleLoadPlanner())
    for key, value in saved().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state[key], value), key
    assert state["step"] == 7
    # Every tensor went through the staging buffers, the 1.2 MiB one in pieces of a buffer
    # each (a scratch copy is filled that way too).
    assert max(sent, default=0) <= 50_000
    assert sum(sent) == sum(
        t.numel() * t.element_size() for t in saved().values() if isinstance(t, torch.Tensor)
    )


@pytest.mark.parametrize("scratch", [0, 1 << 40], ids=["host-held", "scratch"])
def test_an_atomic_staged_dcp_load_of_a_damaged_blob_touches_no_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scratch: int
) -> None:
    monkeypatch.setattr(staging, "POLICY", Policy(device_types=CPU, scratch_bytes=scratch))
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        ckpt_dcp.save(saved(), run, 1)
        [rank] = [c for c in run.checkpoint(1).components if c.name.endswith("rank0")]
        entries = read_index(run.store, rank.index_digest).entries
        digest = max(entries, key=lambda e: e.nbytes).segments[0].digest  # the embedding's
        blob = tmp_path / "s" / blob_key(digest)
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.chmod(0o644)
        blob.write_bytes(bytes(data))
        state = sentinels()
        with pytest.raises(IntegrityError, match="corrupt"):
            ckpt_dcp.load(state, run, 1)
    assert untouched(state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scratch", [0, None], ids=["host-held", "scratch-if-room"])
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_a_dcp_load_into_cuda_tensors_is_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool, scratch: int | None
) -> None:
    monkeypatch.setattr(staging, "POLICY", Policy(cap=50_000, scratch_bytes=scratch))
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        ckpt_dcp.save(saved(), run, 1)
        state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in sentinels().items()}
        reader = CkptStoreReader.from_run(run, 1, max_workers=3)
        reader.atomic = atomic
        dcp.load(state, storage_reader=reader, planner=NoPickleLoadPlanner())
    for key, value in saved().items():
        if isinstance(value, torch.Tensor):
            assert state[key].is_cuda
            assert torch.equal(state[key].cpu(), value), key
    assert state["step"] == 7
