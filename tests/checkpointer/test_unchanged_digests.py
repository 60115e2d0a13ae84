"""Reusing the digests of tensors PyTorch's version counter says are unchanged
(``WriterOptions(reuse_unchanged_digests=True)``, ckptstore/serialize/unchanged.py): what is
skipped, what is not, and the guard that catches writes the counter misses."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore.cas.writer as blob_writer
from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer import commit, open_run
from ckptstore.checkpointer.run import Run
from ckptstore.errors import SaveError
from ckptstore.serialize.compare import first_difference
from ckptstore.serialize.unchanged import STAMP_MIN_BYTES, WINDOW, WINDOWS, stamp_of

BIG = 1 << 18  # fp32 elements: 1 MiB, stored in chunks of its own


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the blobs the writer hashed, in order."""
    sizes: list[int] = []
    digest = blob_writer.digest_bytes

    def counting(data: Any) -> str:
        sizes.append(memoryview(data).nbytes)
        return digest(data)

    monkeypatch.setattr(blob_writer, "digest_bytes", counting)
    return sizes


def _state(n: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(BIG, generator=gen) for i in range(n)}
    state["bias"] = torch.randn(16, generator=gen)  # packed: always hashed
    return state


def _run(tmp_path: Path, *, reuse: bool = True, async_save: bool = False) -> Run:
    return open_run(
        "r",
        db=tmp_path / "m.db",
        store=tmp_path / "s",
        async_save=async_save,
        writer_options=WriterOptions(reuse_unchanged_digests=reuse),
    )


def _chunks_hashed(sizes: list[int]) -> int:
    return sum(size == BIG * 4 for size in sizes)


def _same(run: Run, step: int, state: dict[str, torch.Tensor]) -> None:
    loaded = run.load(step).state["model"]
    assert first_difference(loaded, state) is None


@pytest.mark.parametrize("async_save", [False, True])
def test_only_the_tensors_that_changed_are_hashed_again(
    tmp_path: Path, hashed: list[int], async_save: bool
) -> None:
    state = _state()
    with _run(tmp_path, async_save=async_save) as run:
        run.save(1, {"model": state})
        run.finalize()
        assert _chunks_hashed(hashed) == 4
        hashed.clear()
        state["w1"].add_(1.0)
        with torch.no_grad():
            state["w2"].view(512, 512)[3].mul_(2.0)  # through a view: the base's counter moves
        run.save(2, {"model": state})
        run.finalize()
        assert _chunks_hashed(hashed) == 2
        _same(run, 2, state)
        hashed.clear()
        run.save(3, {"model": state})  # nothing changed: only the pack and index are hashed
        run.finalize()
        assert _chunks_hashed(hashed) == 0
        _same(run, 3, state)
        assert run.checkpoint(3).components[0].index_digest == (
            run.checkpoint(2).components[0].index_digest
        )


def test_by_default_every_byte_is_hashed(tmp_path: Path, hashed: list[int]) -> None:
    state = _state()
    with _run(tmp_path, reuse=False) as run:
        run.save(1, {"model": state})
        hashed.clear()
        run.save(2, {"model": state})
    assert _chunks_hashed(hashed) == 4


def test_a_replaced_tensor_is_hashed_although_its_counter_and_shape_match(
    tmp_path: Path, hashed: list[int]
) -> None:
    state = _state()
    with _run(tmp_path) as run:
        run.save(1, {"model": state})
        hashed.clear()
        state["w0"] = torch.zeros(BIG)  # a new storage at version 0, as the old one was
        run.save(2, {"model": state})
        assert _chunks_hashed(hashed) == 1
        _same(run, 2, state)


def test_a_write_the_counter_misses_is_caught_and_ends_reuse(
    tmp_path: Path, hashed: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ckptstore.serialize")
    state = _state()
    with _run(tmp_path) as run:
        run.save(1, {"model": state})
        state["w3"].data.add_(1.0)  # .data: a counter of its own, w3's does not move
        hashed.clear()
        run.save(2, {"model": state})
        assert _chunks_hashed(hashed) == 4  # the whole save hashed every byte
        _same(run, 2, state)
        (warning,) = [r.getMessage() for r in caplog.records]
        assert "'w3' changed although its version counter did not" in warning
        assert "reuse_unchanged_digests off" in warning
        hashed.clear()
        run.save(3, {"model": state})  # the run no longer trusts the counters
        assert _chunks_hashed(hashed) == 4


def test_the_guard_covers_the_whole_save_before_any_digest_is_reused(tmp_path: Path) -> None:
    """One component's missed write falls between the fingerprint's windows; another's is
    caught: the save checks every component before it reuses anything, so neither is stale."""
    first, second = _state(1), _state(1)
    with _run(tmp_path) as run:
        run.save(1, {"a": first, "b": second})
        first["w0"].data[2048] = 7.0  # byte 8192: between the first two windows
        second["w0"].data.add_(1.0)
        run.save(2, {"a": first, "b": second})
        loaded = run.load(2).state
        assert first_difference(loaded, {"a": first, "b": second}) is None


def test_a_fused_optimizer_step_is_caught(tmp_path: Path) -> None:
    """torch's fused AdamW updates parameters without bumping their version counters: the
    guard sees every element change and the save stores the new weights."""
    param = torch.nn.Parameter(torch.randn(BIG))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    with _run(tmp_path) as run:
        run.save(1, {"model": {"p": param}})
        version = param._version
        param.grad = torch.ones_like(param)
        optimizer.step()
        assert param._version == version  # what makes the guard necessary
        run.save(2, {"model": {"p": param}})
        assert torch.equal(run.load(2).state["model"]["p"], param.detach())


def test_a_digest_whose_blob_is_not_live_is_hashed_and_stored_again(
    tmp_path: Path, hashed: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first save stores its blobs but its commit fails: they are no live blobs, so the
    next save cannot take their digests on trust; it hashes the tensors and checks the store
    (the commit then finds every blob it references)."""
    state = _state()
    with _run(tmp_path) as run:
        real = commit.tx.commit_checkpoint

        def lost(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("the database went away")

        monkeypatch.setattr(commit.tx, "commit_checkpoint", lost)
        with pytest.raises(SaveError, match="the database went away"):
            run.save(1, {"model": state})
        monkeypatch.setattr(commit.tx, "commit_checkpoint", real)
        orphans = [info.key for info in run.store.list("cas/")]
        run.store.delete(orphans)  # as a GC of the failed save's blobs would
        hashed.clear()
        run.save(2, {"model": state})
        assert _chunks_hashed(hashed) == 4
        assert all(size is not None for size in run.store.sizes(orphans).values())
        _same(run, 2, state)  # every blob read and verified


def test_what_a_stamp_matches() -> None:
    base = torch.randn(BIG)
    stamp = stamp_of(base)
    assert stamp is not None
    same = stamp_of(base.detach())  # another tensor object over the same storage
    assert same is not None
    assert same.matches(stamp)
    view = stamp_of(base[1:])
    assert view is not None
    assert not view.matches(stamp)
    base.add_(0.0)
    bumped = stamp_of(base)
    assert bumped is not None
    assert not bumped.matches(stamp)
    assert stamp_of(torch.randn(STAMP_MIN_BYTES // 8)) is None  # small: packed, hashed anyway
    with torch.inference_mode():
        inference = torch.randn(BIG)
    assert stamp_of(inference) is None  # keeps no version counter
    gone = torch.randn(BIG)
    kept = stamp_of(gone)
    assert kept is not None
    del gone  # its storage is freed: nothing can match it any more
    assert not kept.matches(kept)
    assert WINDOWS * WINDOW < BIG * 4  # the tests above exercise the sampled fingerprint
