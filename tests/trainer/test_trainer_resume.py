"""The trainer's save and resume semantics (DESIGN.md §9.5-§9.6), in-process (backend=local)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from trainer_helpers import LONG_BUDGET, small_config, train

from ckptstore.checkpointer import open_run
from ckptstore.errors import SaveError
from ckptstore.manifest._orm import runs as q
from ckptstore.manifest._sql.lookups import fetch_committed_at_step
from ckptstore.manifest.db import Database
from trainer.config import TrainerConfig, parse_deadline
from trainer.controller import Controller
from trainer.errors import ConfigurationError, ResumeError, TrainerError
from trainer.replay import Rollout
from trainer.workers import RolloutRequest, RolloutWorker


def _run(cfg: TrainerConfig) -> Any:
    ck = cfg.checkpointing
    return open_run(ck.run_name, db=ck.db, store=ck.store, writable=False)


def _restored(cfg: TrainerConfig) -> dict[str, Any]:
    """Set a controller up (restore included) without starting the pumps; report its state."""

    async def go() -> dict[str, Any]:
        controller = Controller(cfg, time.time())
        await controller.setup()
        state = {
            "train_steps": controller.train_steps,
            "buffered": len(controller.buffer),
            "free_permits": controller.permits._value,
            "dispatch_index": controller.sampler.dispatch_index,
            "redispatch": len(controller.ledger.redispatch),
            "lines": controller.drain(),
        }
        await controller._shutdown(None)
        return state

    return asyncio.run(go())


def test_resumed_run_ends_at_max_steps_and_saves_only_after_the_resume(tmp_path: Path) -> None:
    first, _ = train(small_config(tmp_path, grpo__max_num_steps=2))
    assert first["train_steps"] == 2
    assert first["saved_steps"] == [2]
    second, lines = train(small_config(tmp_path, grpo__max_num_steps=4))
    assert second["resumed_from"] == 2
    assert second["train_steps"] == 4  # not 2 (M - N) and not 6 (M + N)
    assert second["saved_steps"] == [4]
    assert any(line.startswith("resumed run 't' from step 2") for line in lines)
    # consumed_samples counts prompts (the reference's meaning); generations are prompts x G.
    assert second["consumed_samples"] == 4 * 2
    assert second["consumed_generations"] == 4 * 2 * 4
    with _run(small_config(tmp_path)) as run:
        assert [c.step for c in run.checkpoints(["committed"])] == [2, 4]
        latest = run.latest()
        assert latest is not None
        assert latest.training_info is not None
        assert latest.training_info["consumed_samples"] == 4 * 2
        assert latest.training_info["consumed_generations"] == 4 * 2 * 4
        assert latest.training_info["current_step"] == 4
        assert latest.trigger == "period"  # a multiple of save_period, also the last step
        assert {c.name for c in latest.components} == {
            "policy",
            "optimizer",
            "replay_buffer",
            "dataloader",
            "rollout_state",
        }


def test_missing_dataloader_state_raises(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, grpo__max_num_steps=2)
    train(cfg)
    ck = cfg.checkpointing
    with open_run("t", db=ck.db, store=ck.store, async_save=False) as run:
        loaded = run.load()
        state = {k: v for k, v in loaded.state.items() if k != "dataloader"}
        info = dict(loaded.info.training_info or {}, current_step=3)
        run.save(3, state, training_info=info)
    with pytest.raises(ResumeError, match="step 3 has no dataloader state"):
        train(small_config(tmp_path))


def test_changed_dataset_starts_the_dataloader_fresh_with_a_warning(tmp_path: Path) -> None:
    train(small_config(tmp_path, grpo__max_num_steps=2))
    state = _restored(small_config(tmp_path, data__train__dataset_name="other-digits"))
    assert any("dataset changed ('reverse-digits' -> 'other-digits')" in x for x in state["lines"])
    assert state["redispatch"] == 0  # prompts of the old dataset are not re-dispatched
    summary, _ = train(small_config(tmp_path, data__train__dataset_name="other-digits"))
    assert summary["train_steps"] == 4


def test_sampler_change_skips_the_buffer_and_restored_groups_hold_permits(tmp_path: Path) -> None:
    train(small_config(tmp_path, grpo__max_num_steps=2))
    with _run(small_config(tmp_path)) as run:
        saved = run.load(components=["replay_buffer"]).state["replay_buffer"]
    saved_groups = len(saved["groups"])
    assert saved_groups > 0, "the test needs a non-empty saved buffer"

    same = _restored(small_config(tmp_path))
    assert same["buffered"] == saved_groups
    assert same["free_permits"] == 8 - saved_groups  # one permit per restored group
    assert same["train_steps"] == 2

    other = _restored(small_config(tmp_path, async_rl__sampler__name="ready_first"))
    assert other["buffered"] == 0
    assert other["free_permits"] == 8
    assert any("sampler changed ('windowed' -> 'ready_first')" in x for x in other["lines"])


def test_dispatch_index_is_restored_as_saved(tmp_path: Path) -> None:
    train(small_config(tmp_path, grpo__max_num_steps=2, async_rl__sampler__name="in_order"))
    with _run(small_config(tmp_path)) as run:
        rollout = run.load(components=["rollout_state"]).state["rollout_state"]
    outstanding = rollout["batches"]
    assert outstanding, "the test needs prompts in flight at the save"
    assert [b["dispatch_index"] for b in outstanding] == list(range(2, 2 + len(outstanding)))
    state = _restored(small_config(tmp_path, async_rl__sampler__name="in_order"))
    # Not derived from the step (which would give 1 and make fresh batches reuse the
    # re-dispatched batches' indices): the index of the newest admitted batch.
    assert state["dispatch_index"] == rollout["dispatch_index"] == 1 + len(outstanding)


def test_exactly_once_prompts_across_an_interruption(tmp_path: Path) -> None:
    extra = {"async_rl__sampler__name": "in_order", "async_rl__sampler__gate_window": 2}
    whole, _ = train(small_config(tmp_path / "a", grpo__max_num_steps=6, **extra))
    part1, _ = train(small_config(tmp_path / "b", grpo__max_num_steps=3, **extra))
    part2, lines = train(small_config(tmp_path / "b", grpo__max_num_steps=6, **extra))
    assert any("prompts to re-dispatch" in line for line in lines)
    uninterrupted = [h["prompt_ids"] for h in whole["history"]]
    interrupted = [h["prompt_ids"] for h in part1["history"] + part2["history"]]
    assert interrupted == uninterrupted
    flat = [p for step in interrupted for p in step]
    assert len(flat) == len(set(flat)) == 6 * 2  # each prompt once


def test_deadline_saves_at_the_first_boundary_and_stops_early(tmp_path: Path) -> None:
    # The budget runs out at the first step boundary (the helper's clock): step 1 is saved
    # ("timeout") and the run stops. A budget gone before the first step: test_trainer_budget.
    cfg = small_config(tmp_path, checkpointing__checkpoint_must_save_by=LONG_BUDGET)
    summary, lines = train(cfg, budget_stop_at=1)
    assert summary["stopped_early"]
    assert summary["train_steps"] == 1
    assert summary["saved_steps"] == [1]
    assert any("checkpoint_must_save_by" in x and "stopping early" in x for x in lines)
    with _run(cfg) as run:
        latest = run.latest()
        assert latest is not None
        assert (latest.step, latest.trigger) == (1, "timeout")


def test_deadline_formats() -> None:
    start = 1_700_000_000.0
    assert parse_deadline("01:02:03:04", start) == ((24 + 2) * 60 + 3) * 60 + 4
    assert parse_deadline("2023-11-14T22:15:00Z", start) == pytest.approx(100.0)
    assert parse_deadline(None, start) is None
    with pytest.raises(ConfigurationError, match="DD:HH:MM:SS"):
        parse_deadline("tomorrow", start)
    with pytest.raises(ConfigurationError, match="within 23:59:59"):
        parse_deadline("00:25:00:00", start)


def test_model_config_change_is_refused_unless_forked(tmp_path: Path) -> None:
    train(small_config(tmp_path, grpo__max_num_steps=2))
    with pytest.raises(ResumeError, match=r"different model config \(changed: policy.d_model\)"):
        train(small_config(tmp_path, policy__d_model=48))
    with pytest.raises(ResumeError, match=r"checkpointing\.fork_init=fresh"):
        train(small_config(tmp_path, policy__d_model=48, checkpointing__fork=True))
    summary, lines = train(
        small_config(
            tmp_path, policy__d_model=48, checkpointing__fork=True, checkpointing__fork_init="fresh"
        )
    )
    assert summary["run"].startswith("t-fork-")
    assert summary["train_steps"] == 4
    assert any("forking run 't'@2" in x and "fork_init=fresh" in x for x in lines)
    assert any("starts from the warm-up model" in x for x in lines)
    db = Database(small_config(tmp_path).checkpointing.db)
    try:
        with db.read() as session:
            parent = q.load_run_row(session, "t")
            fork = q.load_run_row(session, summary["run"])
            assert parent is not None
            assert fork is not None
            parent_ckpt = fetch_committed_at_step(session, parent.id, 2)
            assert fork.parent_checkpoint_id == parent_ckpt.id
            assert fork.config["fork_init"] == "fresh"
    finally:
        db.close()


def test_shutdown_raises_a_failed_flush_and_chains_it_under_an_exception(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    ck = cfg.checkpointing

    def failing_save() -> Any:
        stale = open_run("t", db=ck.db, store=ck.store)
        open_run("t", db=ck.db, store=ck.store).close()  # a newer writer fences it
        stale.save(1, {"x": {"v": 1}})
        return stale

    clean = Controller(cfg, time.time())
    clean.checkpointer.run = failing_save()
    with pytest.raises(SaveError, match="step 1"):
        asyncio.run(clean.checkpointer.close(None, None))

    during = Controller(cfg, time.time())
    during.checkpointer.run = failing_save()
    original = ValueError("training blew up")
    asyncio.run(during.checkpointer.close(None, original))  # never masks the exception
    assert any("pending checkpoint save also failed" in note for note in original.__notes__)


def test_a_failed_rollout_is_dispatched_again_and_no_prompt_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = {"async_rl__sampler__name": "in_order", "async_rl__sampler__gate_window": 2}
    clean, _ = train(small_config(tmp_path / "a", grpo__max_num_steps=4, **extra))
    generate = RolloutWorker.generate
    calls = {"n": 0}

    def flaky(self: RolloutWorker, requests: list[RolloutRequest]) -> list[Rollout]:
        calls["n"] += 1
        if calls["n"] in (2, 3):  # two failures in a row, then it recovers
            raise RuntimeError("rollout worker lost")
        return generate(self, requests)

    monkeypatch.setattr(RolloutWorker, "generate", flaky)
    flaky_run, _ = train(small_config(tmp_path / "b", grpo__max_num_steps=4, **extra))
    assert [h["prompt_ids"] for h in flaky_run["history"]] == [
        h["prompt_ids"] for h in clean["history"]
    ]


def test_rollouts_that_keep_failing_stop_training_with_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: RolloutWorker, requests: list[RolloutRequest]) -> list[Rollout]:
        raise RuntimeError("rollout worker lost")

    monkeypatch.setattr(RolloutWorker, "generate", broken)
    with pytest.raises(TrainerError, match=r"rollouts failed 3 times in a row.*worker lost"):
        train(small_config(tmp_path))
