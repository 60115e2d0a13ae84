"""The reference trainer on node-local tiers (checkpointing.local_dir), in-process
(backend=local, one node): a local save every step, drains every save_period and at the end,
a stop on the time budget that leaves the rest for the next start, and a resume from the
newest recoverable checkpoint -- local if the tier survived, the store's if it did not."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from trainer_helpers import LONG_BUDGET, small_config, train

from trainer.config import TrainerConfig


def _checkpoints(cfg: TrainerConfig) -> list[tuple[int, str, str]]:
    engine = create_engine(f"sqlite:///{cfg.checkpointing.db}")
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT c.step, c.status, c.trigger FROM checkpoints c JOIN runs r ON "
                    "r.id = c.run_id WHERE r.name = 't' ORDER BY c.step, c.id"
                )
            ).all()
    finally:
        engine.dispose()
    return [(r.step, r.status, r.trigger) for r in rows]


def tiered(root: Path, **extra: Any) -> TrainerConfig:
    return small_config(
        root,
        checkpointing__local_dir=str(root / "tier-{node}"),
        checkpointing__save_period=3,
        **extra,
    )


def test_local_saves_every_step_drain_every_save_period_and_a_finished_run_is_remote(
    tmp_path: Path,
) -> None:
    cfg = tiered(tmp_path, grpo__max_num_steps=6)
    summary, lines = train(cfg)
    assert summary["train_steps"] == 6
    assert [s for s, *_ in _checkpoints(cfg)] == [1, 2, 3, 4, 5, 6]
    statuses = {s: (status, trigger) for s, status, trigger in _checkpoints(cfg)}
    # Every step was saved to the tier; the save_period ones went to the store; what a drained
    # newer checkpoint made unnecessary was dropped, the keep_last=2 newest stay.
    assert statuses[3] == ("committed", "period")
    assert statuses[6] == ("committed", "period")
    assert statuses[5] == ("local", "local")
    assert {statuses[s][0] for s in (1, 2, 4)} == {"deleted"}
    assert any(x.startswith("drained step 3 to the store") for x in lines), lines
    assert any(x.startswith("drained step 6 to the store") for x in lines), lines
    assert any(x.startswith("saved step 4 (local) to the node-local tiers") for x in lines)

    summary, lines = train(tiered(tmp_path, grpo__max_num_steps=8))
    assert summary["train_steps"] == 8
    assert any(x.startswith("resumed run 't' from step 6") for x in lines), lines
    # The tier still held step 6: nothing was read from the store.
    (read,) = [x for x in lines if x.startswith("resume read step 6 (committed)")]
    assert read.endswith("from the store: 0.00 MiB"), read


def test_a_stop_on_the_time_budget_leaves_the_rest_of_its_drain_to_the_next_start(
    tmp_path: Path,
) -> None:
    first = tiered(
        tmp_path,
        grpo__max_num_steps=8,
        checkpointing__checkpoint_must_save_by=LONG_BUDGET,
    )
    summary, lines = train(first, budget_stop_at=4)
    assert summary["train_steps"] == 4
    # The budget has run out: the save at step 4 is local-durable and its drain sent nothing.
    assert (4, "local", "timeout") in _checkpoints(first)
    assert any("step 4 stays local-durable" in x for x in lines), lines

    summary, lines = train(tiered(tmp_path, grpo__max_num_steps=8))
    assert any(x.startswith("resumed run 't' from step 4") for x in lines), lines
    assert any(x.startswith("drained step 4 to the store") for x in lines), lines
    assert summary["train_steps"] == 8
    # Drained, so no longer local (retention may have deleted it since: a "timeout" save
    # does not compete for keep_top_k, as in the reference).
    assert next(st for s, st, _ in _checkpoints(first) if s == 4) in ("committed", "deleted")


def test_a_lost_tier_resumes_from_the_newest_checkpoint_in_the_store(tmp_path: Path) -> None:
    first = tiered(
        tmp_path, grpo__max_num_steps=8, checkpointing__checkpoint_must_save_by=LONG_BUDGET
    )
    train(first, budget_stop_at=5)
    assert [(s, st) for s, st, _ in _checkpoints(first) if st != "deleted"] == [
        (3, "committed"),
        (4, "local"),
        (5, "local"),
    ]
    for tier in tmp_path.glob("tier-*"):
        shutil.rmtree(tier)  # the node's disk is gone with everything local on it
    summary, lines = train(tiered(tmp_path, grpo__max_num_steps=8))
    assert any(x.startswith("resumed run 't' from step 3") for x in lines), lines
    (read,) = [x for x in lines if x.startswith("resume read step 3 (committed)")]
    assert "from node-local tiers: none;" in read, read
    assert summary["train_steps"] == 8
