"""A DCP load reads through the one shared blob cache (``ckptstore.extending.BlobCache``): every
object it needs is fetched once, however many stored items or boxes share it -- a pack of small
tensors, one chunk that two identical tensors deduplicate to -- and nothing else is fetched."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from counting_store import CountingStore

import ckptstore
from ckptstore.checkpointer import Run
from ckptstore.integrations import dcp as ckpt_dcp


@pytest.fixture
def run(tmp_path: Path) -> Iterator[tuple[Run, CountingStore]]:
    store = CountingStore(tmp_path / "store")
    with ckptstore.open_run("cache", db=tmp_path / "m.db", store=store) as opened:
        yield opened, store


def state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    big = torch.randn(512, 1024, generator=gen)  # 2 MiB: a chunk of its own
    small = {f"s{i}": torch.randn(4, 4, generator=gen) for i in range(20)}  # one pack
    return {"big": big, "twin": big.clone(), "small": small, "lr": 0.5}


def zeros_like(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: zeros_like(v) for k, v in tree.items()}
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else None


def test_a_load_fetches_every_blob_it_needs_once(run: tuple[Run, CountingStore]) -> None:
    opened, store = run
    saved = state()
    info = ckpt_dcp.save(saved, opened, 1)
    assert isinstance(info, ckptstore.CheckpointInfo)
    store.reads.clear()
    target = zeros_like(saved)
    ckpt_dcp.load(target, opened, 1)
    for key in ("big", "twin"):
        assert torch.equal(target[key], saved[key])
    for name, tensor in saved["small"].items():
        assert torch.equal(target["small"][name], tensor)
    assert target["lr"] == 0.5
    assert store.reads, "the load read nothing"
    assert max(store.reads.values()) == 1, store.reads
    # "big" and "twin" are one chunk; the 20 small tensors one pack: few objects in all.
    assert len(store.reads) <= 8, store.reads


def test_a_load_of_compressed_blobs_fetches_each_once(run: tuple[Run, CountingStore]) -> None:
    """Compressible tensors are stored compressed and decode into read-only buffers: each is
    still fetched (and decompressed) once. Every read of such a blob took and released it twice,
    so the cache dropped it while later boxes needed it: a pack of small tensors was fetched
    once per tensor, 186 times in a 1 GiB DCP load over S3 (bench/bench_s3_dcp.py)."""
    opened, store = run
    saved = {
        "steps": {f"s{i}": torch.full((64, 64), float(i)) for i in range(12)},  # one pack
        "mask": torch.zeros(512, 1024),  # a chunk of its own, compressed to almost nothing
    }
    ckpt_dcp.save(saved, opened, 1)
    store.reads.clear()
    target = zeros_like(saved)
    ckpt_dcp.load(target, opened, 1)
    assert torch.equal(target["mask"], saved["mask"])
    for name, tensor in saved["steps"].items():
        assert torch.equal(target["steps"][name], tensor)
    assert max(store.reads.values()) == 1, store.reads
