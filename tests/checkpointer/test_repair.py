"""Corruption is a fact about a blob, not a verdict on a checkpoint (checkpointer/repair.py).

A byte flipped in a chunk that several checkpoints share marks all of them corrupt on load;
nothing of theirs may be lost to GC meanwhile, and once good bytes of that digest are stored
again (the next save of the same content, or an operator restoring the object) they verify
and are committed again. Every case runs on SQLite and PostgreSQL with a real LocalStore.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
import torch
from sqlalchemy import select

from ckptstore.cas.digest import blob_key
from ckptstore.checkpointer import CheckpointInfo, Run, open_run
from ckptstore.errors import CheckpointNotFoundError
from ckptstore.maintenance import collect_garbage, verify
from ckptstore.manifest.models import CheckpointBlobRow
from ckptstore.objectstore import LocalStore
from ckptstore.serialize.compare import first_difference

#: float32 elements: above the pack threshold, so the tensor is stored in chunks of its own.
LARGE = 300_000
NO_GRACE = dt.timedelta(0)


def frozen_reference() -> torch.Tensor:
    """A frozen reference model / embedding table: identical in every checkpoint."""
    return torch.randn(LARGE, generator=torch.Generator().manual_seed(7))


def state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {
        "reference": {"embed.weight": frozen_reference()},
        "policy": {"w": torch.randn(LARGE, generator=gen), "step": step},
    }


def digests_of(run: Run, checkpoint_id: int) -> set[str]:
    with run.db.read() as session:
        return set(
            session.scalars(
                select(CheckpointBlobRow.digest).where(
                    CheckpointBlobRow.checkpoint_id == checkpoint_id
                )
            )
        )


def shared_chunk(run: Run, infos: list[CheckpointInfo]) -> str:
    """A chunk every checkpoint in ``infos`` references (not an index blob)."""
    indexes = {c.index_digest for info in infos for c in info.components}
    common = set.intersection(*(digests_of(run, info.id) for info in infos)) - indexes
    assert common, "the frozen reference should be stored once and shared"
    return sorted(common)[0]


def flip_a_byte(store: LocalStore, digest: str) -> bytes:
    """Damage the stored object; returns its good bytes."""
    path = store.root / blob_key(digest)
    good = path.read_bytes()
    damaged = bytearray(good)
    damaged[-1] ^= 0xFF
    path.write_bytes(bytes(damaged))
    return good


def statuses(run: Run) -> dict[int, str]:
    return {c.step: c.status for c in run.checkpoints()}


def assert_loads(run: Run, step: int) -> None:
    loaded = run.load(step)
    expected = state(step)
    for name in expected:
        diff = first_difference(loaded.state[name], expected[name], name)
        assert diff is None, diff


def test_one_damaged_shared_chunk_is_repaired_by_the_next_save(
    db_url: str, store: LocalStore
) -> None:
    with open_run("shared", db=db_url, store=store) as run:
        infos = [run.save(step, state(step)).wait() for step in (1, 2, 3)]
        digest = shared_chunk(run, infos)
        flip_a_byte(store, digest)

        # One load walks back through all three: each references the damaged chunk.
        with pytest.raises(CheckpointNotFoundError, match="skipped corrupt steps"):
            run.load()
        assert statuses(run) == {1: "corrupt", 2: "corrupt", 3: "corrupt"}

        # GC, even with no grace at all, keeps every blob the corrupt checkpoints reference.
        before = {d for info in infos for d in digests_of(run, info.id)}
        report = collect_garbage(run.db, store, grace=NO_GRACE)
        assert report.swept == 0
        assert report.corrupt_checkpoints == 3
        assert report.kept_for_corrupt == len(before)
        assert {d for info in infos for d in digests_of(run, info.id)} == before
        for d in before - {digest}:
            assert store.exists(blob_key(d)), "GC deleted a blob of a repairable checkpoint"

        # The next save stores the same reference again: good bytes under the same digest.
        info4 = run.save(4, state(4)).wait()
        assert digest in digests_of(run, info4.id)
        assert statuses(run) == {1: "committed", 2: "committed", 3: "committed", 4: "committed"}
        for step in (1, 2, 3, 4):
            assert_loads(run, step)
        repaired = next(c for c in run.checkpoints() if c.step == 2)
        assert repaired.error is not None
        assert repaired.error.startswith("repaired")
        report = verify(run.db, store)
        assert report.problems == []
        assert report.checkpoints == 4


def test_verify_recheck_restores_a_checkpoint_whose_object_was_put_back(
    db_url: str, store: LocalStore
) -> None:
    with open_run("restored", db=db_url, store=store) as run:
        infos = [run.save(step, state(step)).wait() for step in (1, 2)]
        digest = shared_chunk(run, infos)
        good = flip_a_byte(store, digest)

        report = verify(run.db, store)
        assert sorted(report.corrupt_checkpoints) == [("restored", 1), ("restored", 2)]
        assert statuses(run) == {1: "corrupt", 2: "corrupt"}
        assert not store.exists(blob_key(digest)), "the damaged object is quarantined"

        # Still damaged (nothing put back): a recheck reports it and changes nothing.
        again = verify(run.db, store, recheck=True)
        assert again.repaired == []
        assert {p.kind for p in again.problems} == {"missing"}
        assert statuses(run) == {1: "corrupt", 2: "corrupt"}

        # Report-only recheck of a good copy changes nothing either.
        store.put(blob_key(digest), good)
        dry = verify(run.db, store, recheck=True, mark_corrupt=False)
        assert dry.repaired == []
        assert dry.problems == []
        assert statuses(run) == {1: "corrupt", 2: "corrupt"}

        fixed = verify(run.db, store, recheck=True)
        assert sorted(fixed.repaired) == [("restored", 1), ("restored", 2)]
        assert fixed.problems == []
        assert statuses(run) == {1: "committed", 2: "committed"}
        assert run.load().info.step == 2
        assert_loads(run, 1)


def test_gc_releases_corrupt_checkpoints_only_when_asked(db_url: str, store: LocalStore) -> None:
    with open_run("given-up", db=db_url, store=store) as run:
        infos = [run.save(step, state(step)).wait() for step in (1, 2)]
        flip_a_byte(store, shared_chunk(run, infos))
        verify(run.db, store)
        assert statuses(run) == {1: "corrupt", 2: "corrupt"}
        dry = collect_garbage(run.db, store, grace=NO_GRACE, dry_run=True, release_corrupt=True)
        assert dry.condemned > 0
        kept = collect_garbage(run.db, store, grace=NO_GRACE)
        assert kept.condemned == 0
        assert kept.swept == 0
        released = collect_garbage(run.db, store, grace=NO_GRACE, release_corrupt=True)
        assert released.swept > 0
        assert not any(store.list("cas/")), "released blobs are deleted"


def test_saving_a_step_again_supersedes_the_older_checkpoint(
    db_url: str, store: LocalStore
) -> None:
    with open_run("twice", db=db_url, store=store) as run:
        first = run.save(5, state(5)).wait()
        second = run.save(5, state(6)).wait()
        rows = run.checkpoints()
        assert [(c.id, c.status) for c in rows] == [(first.id, "deleted"), (second.id, "committed")]
        assert rows[0].error is not None
        assert "superseded" in rows[0].error
        latest = run.latest()
        assert latest is not None
        assert latest.id == second.id
        loaded = run.load(5)
        assert loaded.info.id == second.id
        assert torch.equal(loaded.state["policy"]["w"], state(6)["policy"]["w"])
        assert [c.step for c in run.checkpoints(["committed"])] == [5]
