"""The checkpointer end to end: real SQLite and PostgreSQL manifests, a real LocalStore.

Every test runs on both dialects through ``db_url``. Faults are injected only through small
subclasses of the real LocalStore (a ``put`` that raises on demand) or by damaging the bytes a
real save wrote. The multi-process cases (crash, concurrent writers, shard workers) live in
``test_checkpointer_concurrency.py``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from component_helpers import FlakyStore
from sqlalchemy import func, select, text

from ckptstore.cas.digest import blob_key, digest_bytes
from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer import CheckpointInfo, RetentionPolicy, Run, SaveHandle, open_run
from ckptstore.errors import (
    CheckpointNotFoundError,
    ConfigError,
    FencedError,
    IntegrityError,
    ObjectStoreError,
    RunStateError,
    SaveError,
)
from ckptstore.manifest import Database
from ckptstore.manifest._orm import checkpoints as q
from ckptstore.manifest.models import BlobRow, CheckpointBlobRow, CheckpointRow, RunRow, Status
from ckptstore.objectstore import LocalStore
from ckptstore.serialize.compare import first_difference

MiB = 1 << 20
#: float32 elements of a "large" tensor: 1.2 MB, above the 1 MiB pack threshold, so every
#: large tensor is stored in chunks of its own (never in a pack shared with other values).
LARGE = 300_000


# -- helpers ---------------------------------------------------------------------------------------


def weights(seed: int, n: int = 2, numel: int = LARGE) -> dict[str, torch.Tensor]:
    """``n`` distinct random tensors, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(n)}


def model_state(seed: int, numel: int = 20_000) -> dict[str, Any]:
    """A small but realistic checkpoint: weights, an optimizer with small tensors, JSON."""
    gen = torch.Generator().manual_seed(seed + 1000)
    return {
        "policy": weights(seed, numel=numel),
        "optimizer": {
            "step": torch.tensor(seed, dtype=torch.int64),
            "exp_avg": torch.randn(64, generator=gen, dtype=torch.float32).to(torch.bfloat16),
            "param_groups": [{"lr": 1e-4 * (seed + 1), "betas": [0.9, 0.95]}],
        },
        "dataloader": {"epoch": seed // 3, "position": seed * 17, "name": "gsm8k"},
    }


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Components bit-exact (a load returns components in name order, not save order)."""
    assert sorted(actual) == sorted(expected)
    for name, state in expected.items():
        diff = first_difference(actual[name], state, name)
        assert diff is None, diff


def statuses(run: Run) -> list[tuple[int, str]]:
    return [(c.step, c.status) for c in run.checkpoints()]


def wait_done(handle: SaveHandle, timeout: float = 60.0) -> None:
    """Wait for a background save to finish without consuming (reporting) its error."""
    deadline = time.monotonic() + timeout
    while not handle.done():
        assert time.monotonic() < deadline, f"save at step {handle.step} did not finish"
        time.sleep(0.01)


def blob_digests(run: Run, checkpoint_id: int) -> set[str]:
    with run.db.read() as session:
        return set(
            session.scalars(
                select(CheckpointBlobRow.digest).where(
                    CheckpointBlobRow.checkpoint_id == checkpoint_id
                )
            )
        )


def stored_bytes_of(run: Run, digests: set[str]) -> int:
    with run.db.read() as session:
        sizes = session.scalars(select(BlobRow.stored_bytes).where(BlobRow.digest.in_(digests)))
        return sum(sizes)


def chunk_digests(tensor: torch.Tensor, chunk_bytes: int) -> list[str]:
    """The digests a tensor's chunks must have: BLAKE3 of each element-aligned slice."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    step = chunk_bytes // tensor.element_size() * tensor.element_size()
    return [digest_bytes(raw[i : i + step]) for i in range(0, len(raw), step)]


@pytest.fixture
def flaky_store(tmp_path: Path) -> Iterator[FlakyStore]:
    store = FlakyStore(tmp_path / "flaky-store")
    yield store
    store.close()


# -- the fixtures themselves -----------------------------------------------------------------------


def test_db_url_is_a_fresh_isolated_database(db_url: str) -> None:
    db = Database(db_url)
    try:
        assert db.current_revision() is not None
        with db.read() as session:
            assert session.scalar(select(func.count()).select_from(RunRow)) == 0
            if db.dialect == "postgresql":
                schema = session.scalar(text("SELECT current_schema()"))
                assert schema is not None
                assert schema.startswith("t_")
                where = session.execute(
                    text(
                        "SELECT DISTINCT table_schema FROM information_schema.tables "
                        "WHERE table_name IN ('runs', 'checkpoints', 'alembic_version')"
                    )
                ).scalars()
                assert list(where) == [schema]  # nothing leaked into public
    finally:
        db.close()


# -- 1. resume -------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", ["pending", "failed", "deleted", "corrupt"])
def test_resume_skips_rows_that_are_not_committed(
    db_url: str, store: LocalStore, hidden: str
) -> None:
    states = {step: model_state(step) for step in (1, 2, 3)}
    with open_run("resume", db=db_url, store=store) as run:
        for step in (1, 2):
            run.save(step, states[step]).wait()
        if hidden == "pending":
            # What a writer that died mid-upload leaves behind.
            epoch = run.epoch
            assert epoch is not None
            run.db.write(lambda s: q.insert_pending(s, run.id, 3, epoch, "period"))
        else:
            info = run.save(3, states[3]).wait()
            note = f"{hidden} in this test"
            run.db.write(lambda s: q.set_status(s, info.id, Status(hidden), note))

    # A new job resumes: only committed checkpoints exist for it.
    with open_run("resume", db=db_url, store=store) as resumed:
        latest = resumed.latest()
        assert latest is not None
        assert (latest.step, latest.status) == (2, "committed")
        loaded = resumed.load()
        assert loaded.info.step == 2
        assert loaded.skipped == ()
        assert_same(loaded.state, states[2])
        # Asked for explicitly, step 3 is refused with its status; a corrupt one says why.
        refused = IntegrityError if hidden == "corrupt" else CheckpointNotFoundError
        with pytest.raises(refused, match="step 3"):
            resumed.load(step=3)
        # The new writer marks the dead writer's pending row failed ("abandoned").
        after = "failed" if hidden == "pending" else hidden
        assert statuses(resumed) == [(1, "committed"), (2, "committed"), (3, after)]
        if hidden == "pending":
            row = resumed.checkpoints(["failed"])[0]
            assert row.error is not None
            assert row.error.startswith("abandoned: its writer was replaced by writer epoch")

    reader = open_run("resume", db=db_url, store=store, writable=False)
    with reader:
        assert reader.latest() == latest


def test_resume_picks_the_highest_step_and_loads_any_committed_one(
    db_url: str, store: LocalStore
) -> None:
    states = {step: model_state(step) for step in (10, 20, 30)}
    with open_run("steps", db=db_url, store=store) as run:
        assert run.latest() is None
        with pytest.raises(CheckpointNotFoundError):
            run.load()
        for step, state in states.items():
            run.save(step, state, training_info={"consumed_samples": step * 8}).wait()
    with open_run("steps", db=db_url, store=store, writable=False) as run:
        latest = run.latest()
        assert latest is not None
        assert latest.step == 30
        assert latest.training_info == {"consumed_samples": 240}
        assert {c.name for c in latest.components} == {"policy", "optimizer", "dataloader"}
        for step, state in states.items():
            assert_same(run.load(step=step).state, state)
        part = run.load(components=["dataloader"])
        assert_same(part.state, {"dataloader": states[30]["dataloader"]})


# -- 3. deduplication ------------------------------------------------------------------------------


def test_saving_the_same_state_twice_uploads_almost_nothing(db_url: str, store: LocalStore) -> None:
    state = model_state(1, numel=LARGE)
    with open_run("dedup", db=db_url, store=store) as run:
        first = run.save(1, state).wait()
        second = run.save(2, state).wait()
    assert first.uploaded_bytes > 0
    assert second.logical_bytes == first.logical_bytes
    assert second.uploaded_bytes < 0.01 * second.logical_bytes
    assert second.deduplicated_bytes >= 0.99 * second.stored_bytes


def test_changing_one_tensor_changes_exactly_its_blobs(db_url: str, store: LocalStore) -> None:
    options = WriterOptions(chunk_bytes=1 * MiB)  # each large tensor spans two chunks
    state_a = {"policy": weights(1, n=4)}
    changed = torch.randn(LARGE, generator=torch.Generator().manual_seed(99))
    state_b = {"policy": {**state_a["policy"], "layer2.weight": changed}}
    with open_run("delta", db=db_url, store=store, writer_options=options) as run:
        info_a = run.save(1, state_a).wait()
        info_b = run.save(2, state_b).wait()
        digests_a = blob_digests(run, info_a.id)
        digests_b = blob_digests(run, info_b.id)
        assert_same(run.load(step=1).state, state_a)
        assert_same(run.load(step=2).state, state_b)
        new_blob_bytes = stored_bytes_of(run, digests_b - digests_a)

    (index_a,) = [c.index_digest for c in info_a.components]
    (index_b,) = [c.index_digest for c in info_b.components]
    old_chunks = set(chunk_digests(state_a["policy"]["layer2.weight"], options.chunk_bytes))
    new_chunks = set(chunk_digests(changed, options.chunk_bytes))
    assert len(old_chunks) == len(new_chunks) == 2
    assert digests_a - digests_b == old_chunks | {index_a}
    assert digests_b - digests_a == new_chunks | {index_b}
    # Only the changed tensor's chunks and the new index went to the store the second time.
    assert info_b.uploaded_bytes == new_blob_bytes


def test_distinct_weights_never_share_a_digest(db_url: str, store: LocalStore) -> None:
    options = WriterOptions(chunk_bytes=1 * MiB)
    tensors = weights(5, n=6)
    with open_run("distinct", db=db_url, store=store, writer_options=options) as run:
        info = run.save(1, {"policy": tensors}).wait()
        digests = blob_digests(run, info.id)
    per_tensor = [set(chunk_digests(t, options.chunk_bytes)) for t in tensors.values()]
    all_chunks = set().union(*per_tensor)
    assert len(all_chunks) == sum(len(s) for s in per_tensor)  # pairwise disjoint
    assert digests == all_chunks | {info.components[0].index_digest}


# -- 4. errors of background saves -----------------------------------------------------------------


def failed_rows(run: Run) -> list[CheckpointInfo]:
    return run.checkpoints([Status.FAILED])


def test_failed_save_surfaces_at_the_next_save(db_url: str, flaky_store: FlakyStore) -> None:
    with open_run("err-next", db=db_url, store=flaky_store) as run:
        run.save(1, model_state(1)).wait()
        flaky_store.failing = True
        failing = run.save(2, model_state(2))
        wait_done(failing)
        flaky_store.failing = False
        with pytest.raises(SaveError, match=r"step 2.*injected failure") as excinfo:
            run.save(3, model_state(3))
        assert isinstance(excinfo.value.__cause__, ObjectStoreError)
        (failed,) = failed_rows(run)
        assert failed.step == 2
        assert failed.error is not None
        assert "injected failure" in failed.error
        # The error was reported once; the store works again, so saving works again.
        ok = run.save(3, model_state(3)).wait()
        assert ok.status == "committed"
        latest = run.latest()
        assert latest is not None
        assert latest.step == 3
        assert statuses(run) == [(1, "committed"), (2, "failed"), (3, "committed")]


def test_failed_save_surfaces_at_finalize(db_url: str, flaky_store: FlakyStore) -> None:
    with open_run("err-finalize", db=db_url, store=flaky_store) as run:
        flaky_store.failing = True
        run.save(1, model_state(1))
        with pytest.raises(SaveError, match="step 1"):
            run.finalize()
        assert run.finalize() is None  # reported once, not again
        flaky_store.failing = False
        run.save(2, model_state(2))
        done = run.finalize()
        assert done is not None
        assert (done.step, done.status) == (2, "committed")
        assert statuses(run) == [(1, "failed"), (2, "committed")]


def test_failed_save_surfaces_at_close(db_url: str, flaky_store: FlakyStore) -> None:
    run = open_run("err-close", db=db_url, store=flaky_store)
    flaky_store.failing = True
    run.save(1, model_state(1))
    with pytest.raises(SaveError, match="step 1"):
        run.close()
    run.close()  # closed, nothing left to report
    with pytest.raises(RunStateError, match="closed"):
        run.save(2, model_state(2))
    flaky_store.failing = False
    with open_run("err-close", db=db_url, store=flaky_store) as again:
        assert statuses(again) == [(1, "failed")]
        assert again.latest() is None
        again.save(1, model_state(1)).wait()
        assert statuses(again) == [(1, "failed"), (1, "committed")]


def test_failed_save_surfaces_through_wait_once(db_url: str, flaky_store: FlakyStore) -> None:
    with open_run("err-wait", db=db_url, store=flaky_store) as run:
        flaky_store.failing = True
        handle = run.save(1, model_state(1))
        with pytest.raises(SaveError, match="step 1") as excinfo:
            handle.wait()
        assert "injected failure" in str(excinfo.value)
        flaky_store.failing = False
        # Already reported to the caller: the next save and close do not raise it again.
        run.save(2, model_state(2)).wait()
    with open_run("err-wait", db=db_url, store=flaky_store) as run:
        (failed,) = failed_rows(run)
        assert failed.error is not None
        assert "ObjectStoreError" in failed.error
        assert statuses(run) == [(1, "failed"), (2, "committed")]


def test_synchronous_save_raises_at_once(db_url: str, flaky_store: FlakyStore) -> None:
    with open_run("err-sync", db=db_url, store=flaky_store, async_save=False) as run:
        flaky_store.failing = True
        with pytest.raises(SaveError, match="injected failure"):
            run.save(1, model_state(1))
        flaky_store.failing = False
        handle = run.save(2, model_state(2))
        assert handle.done()
        assert statuses(run) == [(1, "failed"), (2, "committed")]


def test_exception_in_the_with_block_is_not_masked_by_a_failed_save(
    db_url: str, flaky_store: FlakyStore, caplog: pytest.LogCaptureFixture
) -> None:
    with (  # noqa: PT012
        pytest.raises(RuntimeError) as excinfo,
        open_run("err-exc", db=db_url, store=flaky_store) as run,
    ):
        flaky_store.failing = True
        run.save(7, model_state(7))
        raise RuntimeError("boom")
    assert type(excinfo.value) is RuntimeError
    assert excinfo.value.args == ("boom",)
    notes = "\n".join(getattr(excinfo.value, "__notes__", []))
    assert "save" in notes
    assert "failed" in notes
    assert "step 7" in notes
    assert "injected failure" in notes
    assert any(r.levelno >= logging.ERROR for r in caplog.records)
    flaky_store.failing = False
    with open_run("err-exc", db=db_url, store=flaky_store) as again:
        assert statuses(again) == [(7, "failed")]


# -- 5. retention ----------------------------------------------------------------------------------


REWARD = "train:reward"


def R(value: Any) -> dict[str, Any]:
    return {"train:reward": value}


def test_retention_end_to_end_with_off_period_saves(db_url: str, store: LocalStore) -> None:
    policy = RetentionPolicy(keep_top_k=2, metric_name=REWARD, keep_latest_k=1)
    small = {"w": torch.arange(1000, dtype=torch.float32)}
    with open_run("retain", db=db_url, store=store, retention=policy) as run:
        plan: list[tuple[int, str, dict[str, Any] | None]] = [
            (10, "period", R(0.1)),
            (20, "period", R(0.8)),
            (30, "period", R(0.5)),
            (35, "timeout", None),  # off-period: a time-limit save without the metric
        ]
        for step, trigger, metrics in plan:
            run.save(step, {"policy": small}, trigger=trigger, metrics=metrics)
        run.finalize()
        # 35 has no metric, but it is the latest, so it survives; 10 fell out of the top 2.
        assert statuses(run) == [
            (10, "deleted"),
            (20, "committed"),
            (30, "committed"),
            (35, "committed"),
        ]
        run.save(40, {"policy": small}, trigger="period", metrics=R(0.9))
        run.save(45, {"policy": small}, trigger="last", metrics=R(0.2))
        run.finalize()
        assert statuses(run) == [
            (10, "deleted"),
            (20, "committed"),
            (30, "deleted"),
            (35, "deleted"),
            (40, "committed"),
            (45, "committed"),
        ]
        assert [c.trigger for c in run.checkpoints()] == [p[1] for p in plan] + ["period", "last"]
        latest = run.latest()
        assert latest is not None
        assert latest.step == 45
        with pytest.raises(CheckpointNotFoundError):
            run.load(step=30)
        assert_same(run.load(step=20).state, {"policy": small})


def test_a_nan_metric_does_not_block_the_save(db_url: str, store: LocalStore) -> None:
    policy = RetentionPolicy(keep_top_k=1, metric_name=REWARD)
    small = {"w": torch.ones(16)}
    with open_run("nan", db=db_url, store=store, retention=policy) as run:
        run.save(1, {"policy": small}, metrics=R(0.5)).wait()
        run.save(2, {"policy": small}, metrics=R(math.nan)).wait()
        run.save(3, {"policy": small}, metrics=R(0.1)).wait()
        assert statuses(run) == [(1, "committed"), (2, "deleted"), (3, "committed")]


# -- 6. fencing (one process; several processes in test_checkpointer_concurrency.py) ---------------


def test_a_stale_writer_cannot_commit(db_url: str, store: LocalStore) -> None:
    old = open_run("fenced", db=db_url, store=store)
    try:
        old.save(1, model_state(1)).wait()
        with open_run("fenced", db=db_url, store=store) as new:
            assert new.epoch is not None
            assert old.epoch is not None
            assert new.epoch > old.epoch
            stale = old.save(2, model_state(2))
            with pytest.raises(FencedError, match="newer writer"):
                stale.wait()
            info = new.save(2, model_state(102)).wait()
            assert (info.step, info.status, info.writer_epoch) == (2, "committed", new.epoch)
            rows = new.checkpoints()
            assert [(c.step, c.status, c.writer_epoch) for c in rows] == [
                (1, "committed", old.epoch),
                (2, "failed", old.epoch),
                (2, "committed", new.epoch),
            ]
            assert rows[1].error is not None
            assert "FencedError" in rows[1].error
            loaded = new.load()
            assert loaded.info.id == info.id
            assert_same(loaded.state, model_state(102))
            # The stale writer stays fenced for every later save.
            with pytest.raises(FencedError):
                old.save(3, model_state(3)).wait()
    finally:
        old.close()


def test_a_refused_reopen_does_not_fence_the_writer(db_url: str, store: LocalStore) -> None:
    config = {"lr": 1e-4, "model": "tiny"}
    with open_run("cfg", db=db_url, store=store, config=config) as writer:
        with pytest.raises(ConfigError, match="lr"):
            open_run("cfg", db=db_url, store=store, config={**config, "lr": 3e-4})
        info = writer.save(1, model_state(1)).wait()
        assert info.status == "committed"


# -- 8. corruption ---------------------------------------------------------------------------------


def corrupt_one_blob(
    run: Run, store: LocalStore, newer: CheckpointInfo, older: CheckpointInfo
) -> str:
    """Flip a byte of a chunk only ``newer`` references; returns its key."""
    indexes = {c.index_digest for c in newer.components}
    only_newer = sorted(blob_digests(run, newer.id) - blob_digests(run, older.id) - indexes)
    assert only_newer
    key = blob_key(only_newer[0])
    path = store.root / key
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    return key


def test_corrupt_latest_falls_back_to_the_previous_checkpoint(
    db_url: str, store: LocalStore, caplog: pytest.LogCaptureFixture
) -> None:
    state1, state2 = model_state(1), model_state(2)
    with open_run("corrupt", db=db_url, store=store) as run:
        info1 = run.save(1, state1).wait()
        info2 = run.save(2, state2).wait()
        key = corrupt_one_blob(run, store, info2, info1)

        # An explicit load of the damaged step fails loudly and names the step and the key.
        with pytest.raises(IntegrityError) as excinfo:
            run.load(step=2)
        assert "step 2" in str(excinfo.value)
        assert key in str(excinfo.value)
        with pytest.raises(IntegrityError):
            run.load(fallback=False)
        assert statuses(run) == [(1, "committed"), (2, "committed")]

        with caplog.at_level(logging.ERROR, logger="ckptstore"):
            loaded = run.load()
        assert loaded.info.step == 1
        assert_same(loaded.state, state1)
        assert [step for step, _ in loaded.skipped] == [2]
        assert key in loaded.skipped[0][1]
        assert any("step 2" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)

        rows = run.checkpoints()
        assert [(c.step, c.status) for c in rows] == [(1, "committed"), (2, "corrupt")]
        assert rows[1].error is not None
        assert key in rows[1].error
        latest = run.latest()
        assert latest is not None
        assert latest.step == 1

    with open_run("corrupt", db=db_url, store=store) as resumed:
        again = resumed.load()
        assert again.info.step == 1
        assert again.skipped == ()  # already marked: resume goes straight to step 1


def test_explicit_load_of_a_step_marked_corrupt_says_so(db_url: str, store: LocalStore) -> None:
    with open_run("corrupt-explicit", db=db_url, store=store) as run:
        info1 = run.save(1, model_state(1)).wait()
        info2 = run.save(2, model_state(2)).wait()
        corrupt_one_blob(run, store, info2, info1)
        assert run.load().info.step == 1
        with pytest.raises(IntegrityError, match="corrupt"):
            run.load(step=2)


def test_resaving_after_corruption_stores_good_bytes(db_url: str, store: LocalStore) -> None:
    state1, state2 = model_state(1), model_state(2)
    with open_run("corrupt-resave", db=db_url, store=store) as run:
        info1 = run.save(1, state1).wait()
        info2 = run.save(2, state2).wait()
        corrupt_one_blob(run, store, info2, info1)
        assert run.load().info.step == 1
        # Deterministic training redoes step 2 and produces the same weights.
        run.save(3, state2).wait()
        loaded = run.load()
        assert loaded.skipped == ()
        assert loaded.info.step == 3
        assert_same(loaded.state, state2)


# -- 9. lineage and config -------------------------------------------------------------------------


def parent_of(run: Run) -> int | None:
    with run.db.read() as session:
        return session.scalar(select(RunRow.parent_checkpoint_id).where(RunRow.id == run.id))


def test_fork_records_its_parent_checkpoint(db_url: str, store: LocalStore) -> None:
    with open_run("base", db=db_url, store=store) as base:
        infos = {step: base.save(step, model_state(step)).wait() for step in (1, 2, 3)}
        assert parent_of(base) is None
    with open_run("child", db=db_url, store=store, fork_from="base@3") as child:
        assert parent_of(child) == infos[3].id
        assert child.latest() is None  # a fork starts with no checkpoints of its own
    with open_run("child2", db=db_url, store=store, fork_from=("base", 2)) as child2:
        assert parent_of(child2) == infos[2].id
    # Reopening the fork keeps its lineage.
    with open_run("child", db=db_url, store=store) as child:
        assert parent_of(child) == infos[3].id

    with pytest.raises(CheckpointNotFoundError, match="step 4"):
        open_run("bad-step", db=db_url, store=store, fork_from="base@4")
    with pytest.raises(CheckpointNotFoundError, match="nope"):
        open_run("bad-run", db=db_url, store=store, fork_from="nope@1")
    with pytest.raises(ConfigError, match="RUN@STEP"):
        open_run("bad-form", db=db_url, store=store, fork_from="base")
    with pytest.raises(CheckpointNotFoundError):  # a refused fork created no run
        open_run("bad-step", db=db_url, store=store, writable=False)


def test_reopening_with_another_config_needs_permission(db_url: str, store: LocalStore) -> None:
    config = {"lr": 1e-4, "model": "tiny", "seed": 1}
    with open_run("conf", db=db_url, store=store, config=config) as run:
        run.save(1, model_state(1)).wait()
    with open_run("conf", db=db_url, store=store, config=dict(config)):
        pass  # same config: fine
    with open_run("conf", db=db_url, store=store):
        pass  # no config given: resume as is
    with pytest.raises(ConfigError, match="identity=") as excinfo:
        open_run("conf", db=db_url, store=store, config={**config, "lr": 2e-4, "seed": 2})
    assert "lr" in str(excinfo.value)
    assert "seed" in str(excinfo.value)
    assert "model" not in str(excinfo.value)
    changed = {**config, "lr": 2e-4}
    with open_run("conf", db=db_url, store=store, config=changed, identity={}) as run:
        latest = run.latest()
        assert latest is not None
        assert latest.step == 1
        with run.db.read() as session:
            assert session.scalar(select(RunRow.config).where(RunRow.id == run.id)) == changed
    # The changed config is now the run's: reopening with it needs no permission.
    with open_run("conf", db=db_url, store=store, config=changed):
        pass


# -- 10. summary views -----------------------------------------------------------------------------


def run_summary(run: Run) -> dict[str, Any]:
    with run.db.read() as session:
        row = session.execute(
            text("SELECT * FROM run_summary WHERE run = :name"), {"name": run.name}
        ).mappings()
        return dict(row.one())


def checkpoint_summary(run: Run) -> list[dict[str, Any]]:
    with run.db.read() as session:
        rows = session.execute(
            text("SELECT * FROM checkpoint_summary WHERE run = :name ORDER BY checkpoint_id"),
            {"name": run.name},
        ).mappings()
        return [dict(r) for r in rows]


def committed_stored_bytes(run: Run) -> int:
    with run.db.read() as session:
        digests = (
            select(CheckpointBlobRow.digest)
            .join(CheckpointRow, CheckpointRow.id == CheckpointBlobRow.checkpoint_id)
            .where(CheckpointRow.run_id == run.id, CheckpointRow.status == Status.COMMITTED)
        )
        total = session.scalar(
            select(func.sum(BlobRow.stored_bytes)).where(BlobRow.digest.in_(digests))
        )
        return int(total or 0)


def test_summary_views(db_url: str, flaky_store: FlakyStore) -> None:
    hi = RetentionPolicy(metric_name=REWARD)
    with open_run("sum-hi", db=db_url, store=flaky_store, retention=hi) as run:
        same = model_state(1)
        infos = [
            run.save(1, same, metrics=R(0.5)).wait(),
            run.save(2, same, metrics=R(0.9)).wait(),  # fully deduplicated
        ]
        flaky_store.failing = True
        with pytest.raises(SaveError):
            run.save(3, model_state(3), metrics=R(5.0)).wait()  # failed: its metric never counts
        flaky_store.failing = False
        infos.append(run.save(4, model_state(4), metrics=R(0.7)).wait())
        infos.append(run.save(5, {"policy": weights(5, n=1, numel=20_000)}).wait())  # no metric
        summary = run_summary(run)
        assert summary["checkpoints"] == 5
        assert summary["committed"] == 4
        assert summary["failed"] == 1
        assert summary["latest_step"] == 5
        assert summary["metric_name"] == REWARD
        assert summary["best_metric"] == pytest.approx(0.9)
        assert summary["writer_epoch"] == run.epoch
        # SUM() is NUMERIC (Decimal) on PostgreSQL, INTEGER on SQLite.
        assert int(summary["logical_bytes"]) == sum(i.logical_bytes for i in infos)
        assert int(summary["stored_bytes"]) == committed_stored_bytes(run)
        assert int(summary["stored_bytes"]) < int(summary["logical_bytes"]) * 0.8  # 1 and 2 share

        rows = checkpoint_summary(run)
        assert [(r["step"], r["status"]) for r in rows] == [
            (1, "committed"),
            (2, "committed"),
            (3, "failed"),
            (4, "committed"),
            (5, "committed"),
        ]
        assert [r["components"] for r in rows] == [3, 3, 0, 3, 1]
        assert rows[1]["uploaded_bytes"] < rows[0]["uploaded_bytes"] * 0.01
        assert rows[2]["error"] is not None
        assert "injected failure" in rows[2]["error"]
        assert rows[2]["committed_at"] is None
        assert all(r["committed_at"] is not None for r in rows if r["status"] == "committed")
        assert all(r["trigger"] == "manual" for r in rows)
        for row, info in zip([rows[i] for i in (0, 1, 3, 4)], infos, strict=True):
            assert row["checkpoint_id"] == info.id
            assert row["logical_bytes"] == info.logical_bytes
            assert row["stored_bytes"] == info.stored_bytes

    lo = RetentionPolicy(metric_name="val:loss", higher_is_better=False)
    with open_run("sum-lo", db=db_url, store=flaky_store, retention=lo) as run:
        for step, loss in [(1, 2.0), (2, 1.25), (3, 1.5)]:
            run.save(step, {"policy": weights(step, n=1, numel=20_000)}, metrics={"val:loss": loss})
        run.finalize()
        summary = run_summary(run)
        assert (summary["committed"], summary["latest_step"]) == (3, 3)
        assert summary["best_metric"] == pytest.approx(1.25)

    with open_run("sum-empty", db=db_url, store=flaky_store) as run:
        summary = run_summary(run)
        assert (summary["checkpoints"], summary["committed"], summary["failed"]) == (0, 0, 0)
        assert summary["latest_step"] is None
        assert summary["metric_name"] is None
        assert summary["best_metric"] is None


def test_run_summary_ignores_non_numeric_metrics(db_url: str, store: LocalStore) -> None:
    lo = RetentionPolicy(metric_name="val:loss", higher_is_better=False)
    with open_run("sum-text", db=db_url, store=store, retention=lo) as run:
        for step, loss in [(1, 2.0), (2, "n/a"), (3, 1.5), (4, True)]:
            run.save(step, {"policy": weights(step, n=1, numel=20_000)}, metrics={"val:loss": loss})
        run.finalize()
        assert run_summary(run)["best_metric"] == pytest.approx(1.5)


# -- 10. dedup asks the manifest once per save -----------------------------------------------------


class ProbeCountingStore(LocalStore):
    """A LocalStore that counts ``exists`` and ``put`` calls (what dedup costs the store)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.probes = 0

    def exists(self, key: str) -> bool:
        self.probes += 1
        return super().exists(key)

    def put(self, key: str, data: Any, **kwargs: Any) -> Any:
        self.probes += 1
        return super().put(key, data, **kwargs)


def test_an_unchanged_save_asks_the_manifest_once_and_probes_nothing(
    db_url: str, tmp_path: Path
) -> None:
    """The writer's dedup set is one query per save (the newest committed checkpoint's live
    blobs): an unchanged re-save uploads nothing and touches no object, however many blobs."""
    from sqlalchemy import event

    store = ProbeCountingStore(tmp_path / "counted")
    options = WriterOptions(chunk_bytes=1 << 20, pack_threshold=1 << 20)
    state = {"model": {f"w{i}": torch.randn(512, 1024) for i in range(6)}}  # 12 chunks
    with open_run("dedup", db=db_url, store=store, writer_options=options) as run:
        first = run.save(1, state).wait()
        statements: list[str] = []

        def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            statements.append(statement)

        event.listen(run.db.engine, "before_cursor_execute", count)
        store.probes = 0
        second = run.save(2, state).wait()
        event.remove(run.db.engine, "before_cursor_execute", count)
    assert first.uploaded_bytes > 0
    assert second.uploaded_bytes == 0
    assert second.stored_bytes == first.stored_bytes
    # No object was probed or written: every blob, the index too, was in the dedup set.
    assert store.probes == 0
    lookups = [s for s in statements if "blobs.state" in s and "checkpoint_blobs" in s]
    assert len(lookups) == 1, statements


def test_a_forks_first_save_reuses_its_parents_blobs(db_url: str, store: LocalStore) -> None:
    state = model_state(5)
    with open_run("parent", db=db_url, store=store) as parent:
        parent.save(3, state).wait()
    with open_run("forked", db=db_url, store=store, fork_from="parent@3") as child:
        info = child.save(4, state).wait()
    assert info.uploaded_bytes == 0
