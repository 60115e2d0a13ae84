"""A load into the caller's tensors never hands back a target holding bytes that did not
verify (issue 40's invariant: every target filled from verified bytes, or none touched).

The default load is atomic: no target is written until every blob of the checkpoint has
verified, so a damaged checkpoint leaves every target as it was -- raised (``fallback=False``,
an explicit step) or skipped for the older one. ``atomic=False`` streams: a blob's bytes land
in its target as they arrive and its digest is checked at its end, so a failed attempt may
have written a target. The checkpoint the load falls back to must write every such target
again; when it has no entry for one, the load fails and names it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptstore.cas import blob_key
from ckptstore.checkpointer import open_run
from ckptstore.errors import IntegrityError
from ckptstore.serialize import read_index

N = 1 << 18


def _damage(run: object, tmp_path: Path, step: int, path: str) -> None:
    [comp] = run.checkpoint(step).components  # type: ignore[attr-defined]
    digest = read_index(run.store, comp.index_digest).entry(path).segments[0].digest  # type: ignore[attr-defined]
    blob = tmp_path / "s" / blob_key(digest)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))


def _tensors(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(N, generator=g) for _ in range(3))


def _two_blob_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(N, generator=g) for name in ("a", "b", "c", "d")}


@pytest.mark.parametrize("how", ["fallback=False", "explicit step"])
def test_an_atomic_load_that_fails_verification_touches_no_target(tmp_path: Path, how: str) -> None:
    """The damaged blob is one of several; the others verify and would have been written by
    a streaming load. Atomic: every target keeps every byte it had."""
    state = _two_blob_state(3)
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        run.save(1, {"m": state})
        _damage(run, tmp_path, 1, "c")
        targets = {k: torch.full((N,), -7.0) for k in state}
        step, fallback = (None, False) if how == "fallback=False" else (1, True)
        with pytest.raises(IntegrityError) as failed:
            run.load(step, into={"m": targets}, fallback=fallback)
    assert "entry c" in str(failed.value)  # the error names the blob's entry
    for name, target in targets.items():
        assert bool((target == -7.0).all()), f"target {name!r} was touched"


def test_an_atomic_load_whose_fallback_lacks_a_target_leaves_it_alone(tmp_path: Path) -> None:
    """Atomic: the failed step 2 wrote nothing, so step 1 (which has no 'b') loads and 'b'
    keeps what the caller had (the streaming load below must refuse instead)."""
    a1, a2, b2 = _tensors(0)
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        run.save(1, {"m": {"a": a1}})
        run.save(2, {"m": {"a": a2, "b": b2}})
        _damage(run, tmp_path, 2, "b")
        a, b = torch.full((N,), -7.0), torch.full((N,), -7.0)
        loaded = run.load(into={"m": {"a": a, "b": b}})
    assert loaded.info.step == 1
    assert torch.equal(a, a1)
    assert bool((b == -7.0).all())


def test_a_target_the_fallback_checkpoint_lacks_fails_the_load(tmp_path: Path) -> None:
    a1, a2, b2 = _tensors(0)
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        run.save(1, {"m": {"a": a1}})
        run.save(2, {"m": {"a": a2, "b": b2}})
        _damage(run, tmp_path, 2, "b")
        a, b = torch.full((N,), -7.0), torch.full((N,), -7.0)
        # Before: step 1 loaded, 'b' silently kept step 2's bytes that did not verify.
        with pytest.raises(IntegrityError, match=r"step 2 did not verify.*no entry 'b'"):
            run.load(into={"m": {"a": a, "b": b}}, atomic=False)


def test_a_fallback_that_writes_every_target_again_loads(tmp_path: Path) -> None:
    a1, a2, b2 = _tensors(1)
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        run.save(1, {"m": {"a": a1, "b": -a1}})
        run.save(2, {"m": {"a": a2, "b": b2}})
        _damage(run, tmp_path, 2, "b")
        a, b = torch.full((N,), -7.0), torch.full((N,), -7.0)
        loaded = run.load(into={"m": {"a": a, "b": b}}, atomic=False)
    assert loaded.info.step == 1
    assert [s for s, _ in loaded.skipped] == [2]
    assert torch.equal(a, a1)
    assert torch.equal(b, -a1)


def test_a_target_neither_checkpoint_has_is_left_alone(tmp_path: Path) -> None:
    a1, a2, _ = _tensors(2)
    with open_run("r", db=tmp_path / "m.db", store=tmp_path / "s", async_save=False) as run:
        run.save(1, {"m": {"a": a1}})
        run.save(2, {"m": {"a": a2}})
        _damage(run, tmp_path, 2, "a")
        a, extra = torch.full((N,), -7.0), torch.full((4,), -7.0)
        loaded = run.load(into={"m": {"a": a, "extra": extra}}, atomic=False)
    assert loaded.info.step == 1
    assert torch.equal(a, a1)
    assert bool((extra == -7).all())
