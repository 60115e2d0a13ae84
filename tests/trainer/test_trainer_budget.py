"""A start's budgets: checkpoint_must_save_by is never overrun, stop_after_steps counts steps.

In-process (backend=local). A deadline already passed before the first step stops the start
without training (nothing new exists to save); one that runs out between steps saves the step
not yet saved at once; a real deadline is met by the last commit; stop_after_steps trains that
many steps per start, whatever start-up cost, and the next start resumes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from pathlib import Path
from typing import Any

import pytest
from trainer_helpers import small_config, train

from ckptstore.checkpointer import open_run
from ckptstore.errors import CheckpointNotFoundError
from trainer.budget import StopBudget
from trainer.config import TrainerConfig
from trainer.controller import Controller
from trainer.errors import ConfigurationError


def _rows(cfg: TrainerConfig) -> list[Any]:
    ck = cfg.checkpointing
    try:
        with open_run(ck.run_name, db=ck.db, store=ck.store, writable=False) as run:
            return run.checkpoints(statuses=["committed", "deleted"])
    except CheckpointNotFoundError:  # a start that stopped before its workers: no run row
        return []


def test_a_deadline_passed_before_the_first_step_trains_nothing(tmp_path: Path) -> None:
    # A process "started" 5 s ago with a 1 s budget: start-up has eaten it. No step may run
    # (the old trainer ran one and committed it past the deadline).
    cfg = small_config(tmp_path, checkpointing__checkpoint_must_save_by="00:00:00:01")
    began = time.monotonic()
    summary, lines = train(cfg, process_start=time.time() - 5)
    assert summary["stopped_early"]
    assert summary["train_steps"] == 0
    assert summary["saved_steps"] == []
    assert summary["history"] == []
    stop = [x for x in lines if x.startswith("checkpoint_must_save_by:")]
    assert len(stop) == 1, lines
    assert "ran out before the first step" in stop[0]
    assert "nothing new to save" in stop[0]
    assert "is new: nothing trained yet" in stop[0]
    assert "would run out" not in " ".join(lines)
    assert _rows(cfg) == []  # nothing committed past the deadline
    assert time.monotonic() - began < 60


def test_a_deadline_passed_during_start_up_starts_no_workers(tmp_path: Path) -> None:
    # Starting the workers is the slowest part of start-up left after the warm-up: a start
    # whose deadline already passed stops before it, at once.
    cfg = small_config(tmp_path, checkpointing__checkpoint_must_save_by="00:00:00:01")
    controller = Controller(cfg, time.time() - 5)
    summary = asyncio.run(controller.run_training())
    assert summary["stopped_early"]
    assert summary["train_steps"] == 0
    assert controller.policy is None
    assert not hasattr(controller, "rollout_workers")


def test_a_resumed_start_past_its_deadline_keeps_its_checkpoint(tmp_path: Path) -> None:
    first, _ = train(small_config(tmp_path, grpo__max_num_steps=2))
    assert first["saved_steps"] == [2]
    cfg = small_config(
        tmp_path, grpo__max_num_steps=6, checkpointing__checkpoint_must_save_by="00:00:00:01"
    )
    summary, lines = train(cfg, process_start=time.time() - 5)
    assert (summary["train_steps"], summary["saved_steps"]) == (2, [])
    assert summary["stopped_early"]
    assert any("stays at its checkpoint of step 2" in x for x in lines), lines
    assert [(c.step, c.status) for c in _rows(cfg)] == [(2, "committed")]


def test_time_running_out_between_steps_saves_the_unsaved_step_at_once(
    tmp_path: Path,
) -> None:
    # The budget holds after step 3 (not a save step with save_period=2), then is gone when
    # step 4 would start: step 3 is saved at once ("timeout") and no step 4 runs.
    cfg = small_config(
        tmp_path, grpo__max_num_steps=8, checkpointing__checkpoint_must_save_by="00:01:00:00"
    )
    controller = Controller(cfg, time.time())
    checkpointer = controller.checkpointer
    assert checkpointer.budget is not None
    end = checkpointer.process_start + checkpointer.budget
    reads_at_3 = 0

    def clock() -> float:
        nonlocal reads_at_3
        if controller.train_steps < 3:
            return time.time()
        reads_at_3 += 1
        return time.time() if reads_at_3 == 1 else end  # read 1: step 3's own check

    checkpointer.clock = clock
    summary, lines = train_controller(controller)
    assert summary["stopped_early"]
    assert summary["train_steps"] == 3
    assert summary["saved_steps"] == [2, 3]
    assert {(c.step, c.trigger) for c in _rows(cfg)} >= {(2, "period"), (3, "timeout")}
    stop = [x for x in lines if x.startswith("checkpoint_must_save_by:")]
    assert len(stop) == 1, lines
    assert "saved step 3 of run 't' and stopping early" in stop[0]
    assert not any(x.startswith("step    4") for x in lines)
    resumed, lines = train(small_config(tmp_path, grpo__max_num_steps=5))
    assert (resumed["resumed_from"], resumed["train_steps"]) == (3, 5)


def train_controller(controller: Controller) -> tuple[dict[str, Any], list[str]]:
    """Run a prepared controller in this process to the end (as trainer_helpers.train)."""
    import asyncio

    summary = asyncio.run(controller.run_training())
    return summary, controller.drain()


@pytest.mark.parametrize("budget_s", [5])
def test_a_real_deadline_is_met_by_the_last_commit(tmp_path: Path, budget_s: int) -> None:
    # The real clock: whether start-up leaves time for steps or not (load decides), nothing
    # is committed after the deadline (a slack for the commit's own bookkeeping), and what
    # was trained is saved.
    cfg = small_config(
        tmp_path,
        grpo__max_num_steps=100_000,
        data__train__num_prompts=100_000,
        checkpointing__checkpoint_must_save_by=f"00:00:00:{budget_s:02d}",
    )
    start = time.time()
    summary, lines = train(cfg, process_start=start)
    deadline = dt.datetime.fromtimestamp(start + budget_s, dt.UTC)
    assert summary["stopped_early"], lines
    rows = _rows(cfg)
    committed = {c.step: _utc(c.committed_at) for c in rows}
    slack = dt.timedelta(seconds=1.5)
    assert all(at <= deadline + slack for at in committed.values()), (deadline, committed)
    if summary["train_steps"]:
        assert summary["saved_steps"][-1] == summary["train_steps"], lines
    else:
        assert rows == []


def _utc(at: dt.datetime | None) -> dt.datetime:
    assert at is not None
    return at if at.tzinfo is not None else at.replace(tzinfo=dt.UTC)


def test_stop_after_steps_trains_that_many_steps_per_start(tmp_path: Path) -> None:
    # Start-up cost does not count: a process "started" an hour ago still trains its 3 steps.
    cfg = small_config(tmp_path, grpo__max_num_steps=7, checkpointing__stop_after_steps=3)
    first, lines = train(cfg, process_start=time.time() - 3600)
    assert (first["train_steps"], first["saved_steps"], first["stopped_early"]) == (
        3,
        [2, 3],
        True,
    )
    stop = [x for x in lines if x.startswith("checkpointing.stop_after_steps=3")]
    assert len(stop) == 1, lines
    assert "saved step 3 of run 't' and stopping early" in stop[0]
    second, _ = train(cfg)
    assert (second["resumed_from"], second["train_steps"], second["stopped_early"]) == (
        3,
        6,
        True,
    )
    third, lines = train(cfg)
    # The last step ends the run: a "last" save, not a budget stop.
    assert (third["train_steps"], third["saved_steps"], third["stopped_early"]) == (7, [7], False)
    assert {c.step: c.trigger for c in _rows(cfg) if c.status == "committed"}[7] == "last"


def test_stop_after_steps_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"checkpointing\.stop_after_steps=0"):
        small_config(tmp_path, checkpointing__stop_after_steps=0)


def test_the_budget_leaves_room_for_a_step_and_a_save() -> None:
    now = [1000.0]
    budget = StopBudget(60.0, 950.0, None, lambda: now[0])  # 10 s left
    assert budget.remaining() == pytest.approx(10.0)
    assert not budget.out_of_time(None)
    assert not budget.out_of_time(9.0)
    budget.saved(2.0)  # a save takes 2 s: 9 s step + 2 s save do not fit in 10 s
    assert budget.out_of_time(9.0)
    assert not budget.out_of_time(7.5)
    budget.saved(1.0)  # the estimate is the longest save seen
    assert budget.save_seconds == 2.0
    assert budget.after_step(5, 7.5) is None
    now[0] = 1003.0  # 7 s left
    assert budget.after_step(6, 7.5) == "time"
    assert budget.after_step(7, 7.5) is None  # once per start
    now[0] = 1011.0  # past the deadline: true even with no step timed
    assert StopBudget(60.0, 950.0, None, lambda: now[0]).out_of_time(None)
    counted = StopBudget(None, 0.0, 4, time.time)
    assert [counted.after_step(n, 0.1) for n in (3, 4)] == [None, "steps"]
    assert not counted.out_of_time(None)


def test_the_closing_lines_of_a_start_that_saved_nothing_say_so() -> None:
    from trainer.grpo import where_lines

    summary = {"saved_steps": [], "kept_steps": None, "run": "r", "db": "m.db", "store": "s"}
    first = where_lines(summary)[0]
    assert first.startswith("this process saved no checkpoint; the run keeps what it kept before")
    assert "None" not in first
