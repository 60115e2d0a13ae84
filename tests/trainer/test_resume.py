"""Resuming after the configuration changed (trainer/resume.py, DESIGN.md §9.5), in-process: a
resumed run makes progress or exits with one line that says why, whatever the saved state and the
new limits; a prompt in flight at the save keeps its start weight; a fork that changes the seed
starts its data fresh and keeps the weights; a run whose checkpoints are all corrupt is never
silently started over."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from trainer_helpers import small_config, small_overrides, train

from ckptstore.cas import blob_key
from ckptstore.checkpointer import open_run
from trainer.config import TrainerConfig
from trainer.data import epoch_permutation
from trainer.errors import ResumeError
from trainer.grpo import main
from trainer.trace import read_trace


def _query(cfg: TrainerConfig, sql: str) -> list[Any]:
    engine = create_engine(f"sqlite:///{cfg.checkpointing.db}")
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql)).all())
    finally:
        engine.dispose()


def _saved_state(cfg: TrainerConfig, components: list[str]) -> dict[str, Any]:
    ck = cfg.checkpointing
    with open_run("t", db=ck.db, store=ck.store, writable=False) as run:
        return run.load(components=components).state


def _trace(root: Path) -> dict[str, str]:
    return {"logger__prompt_trace": str(root / "trace.jsonl")}


def _trained(root: Path) -> list[int]:
    return [
        p
        for e in read_trace(root / "trace.jsonl")
        if e["event"] == "train"
        for p in e["prompt_ids"]
    ]


# A windowed run with more prompts admitted than permits: the in-flight limit lets a fifth
# batch in while the four before it hold all 8 permits, so every save lists 10 prompts (the
# fifth batch's waiting for a permit).
WIDE = {"async_rl__max_inflight_prompts": 10, "async_rl__max_buffered_rollouts": 8}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sampler", ["in_order", "weight_fifo", "ready_first"])
def test_a_changed_sampler_skips_the_saved_prompts_and_trains_on(
    tmp_path: Path, sampler: str
) -> None:
    train(small_config(tmp_path, grpo__max_num_steps=2, **WIDE, **_trace(tmp_path)))
    outstanding = _saved_state(small_config(tmp_path), ["rollout_state"])["rollout_state"]
    saved = {entry[1] for b in outstanding["batches"] for entry in b["prompts"]}
    assert len(saved) == 10  # more than the 8 permits
    # Before the fix the rollout pump took a permit for every saved prompt before starting any
    # rollout: nothing became ready and both pumps waited forever.
    summary, lines = train(
        small_config(
            tmp_path, grpo__max_num_steps=6, async_rl__sampler__name=sampler, **_trace(tmp_path)
        )
    )
    assert summary["train_steps"] == 6
    warning = f"sampler changed ('windowed' -> {sampler!r}): skipping the saved replay buffer"
    assert any(warning in x and f"and {len(saved)} prompts" in x for x in lines), lines
    # The reference's rule: the saved prompts are not trained; the trace says so, and the data
    # order goes on after them (no prompt is trained twice).
    events = read_trace(tmp_path / "trace.jsonl")
    skipped = {e["prompt_id"] for e in events if e["event"] == "drop" and e["reason"] == "skipped"}
    assert skipped == saved
    trained = _trained(tmp_path)
    assert len(trained) == len(set(trained)) == 6 * 2
    assert not skipped & set(trained)


@pytest.mark.timeout(120)
def test_a_smaller_buffer_redispatches_what_does_not_fit_and_trains_on(tmp_path: Path) -> None:
    train(small_config(tmp_path, grpo__max_num_steps=4, **WIDE, **_trace(tmp_path)))
    # Before the fix: steps 5 and 6 trained on the restored groups, then the pump waited for
    # more permits than there are, holding the ones it had, and nothing moved again.
    summary, lines = train(
        small_config(
            tmp_path, grpo__max_num_steps=8, async_rl__max_buffered_rollouts=4, **_trace(tmp_path)
        )
    )
    assert summary["train_steps"] == 8
    resumed = next(x for x in lines if x.startswith("resumed run 't' from step 4"))
    found = re.search(r"(\d+) buffered groups, (\d+) prompts to re-dispatch", resumed)
    assert found, resumed
    # The freshest ready groups that fit are restored; every other saved prompt goes out again.
    buffered, redispatch = int(found[1]), int(found[2])
    assert buffered <= 4
    assert buffered + redispatch == 10
    trained = _trained(tmp_path)
    assert len(trained) == len(set(trained)) == 8 * 2  # no prompt twice


def _as_if_in_flight(cfg: TrainerConfig, group_ids: set[int]) -> None:
    """Save the newest checkpoint again (same step: it supersedes the original) without these
    buffered groups, as if their rollouts had not finished at the save."""
    components = ["policy", "optimizer", "dataloader", "replay_buffer", "rollout_state"]
    state = _saved_state(cfg, components)
    buffer = dict(state["replay_buffer"])
    buffer["groups"] = [g for g in buffer["groups"] if g["group_id"] not in group_ids]
    buffer["payloads"] = {k: v for k, v in buffer["payloads"].items() if int(k) not in group_ids}
    ck = cfg.checkpointing
    with open_run("t", db=ck.db, store=ck.store, async_save=False) as run:
        info = run.latest()
        assert info is not None
        state = {**state, "replay_buffer": buffer}
        run.save(info.step, state, training_info=info.training_info, metrics=info.metrics)


@pytest.mark.timeout(120)
def test_target_steps_that_no_longer_fit_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # in_order with gate_window=3 keeps 6 prompts promised to target steps 2-4 at the step-2
    # save. Say target 2's were in flight: a resume with gate_window=2 and 4 permits restores
    # the buffered groups of targets 3 and 4, which can hold every permit while target 2's
    # prompts -- the step the trainer waits for -- wait for one. Before the fix that hung.
    in_order = {"async_rl.sampler.name": "in_order", "async_rl.max_inflight_prompts": 8}
    wide = {"async_rl.sampler.gate_window": 3, "async_rl.max_buffered_rollouts": 6}
    narrow = {"async_rl.sampler.gate_window": 2, "async_rl.max_buffered_rollouts": 4}
    first = small_overrides(tmp_path, backend="local", **{"grpo.max_num_steps": 2}, **in_order)
    assert main([*first, *(f"{k}={v}" for k, v in wide.items())]) == 0
    cfg = small_config(tmp_path)
    batches = _saved_state(cfg, ["rollout_state"])["rollout_state"]["batches"]
    assert sorted(b["target_step"] for b in batches for _ in b["prompts"]) == [2, 2, 3, 3, 4, 4]
    _as_if_in_flight(cfg, {e[0] for b in batches if b["target_step"] == 2 for e in b["prompts"]})
    capsys.readouterr()
    second = small_overrides(tmp_path, backend="local", **in_order, **narrow)
    assert main(second) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: run 't' step 2 has 6 prompts admitted for target steps")
    assert "async_rl.max_buffered_rollouts=4" in err[0]
    assert "at least 6" in err[0]


def test_a_prompt_in_flight_at_the_save_keeps_its_start_weight(tmp_path: Path) -> None:
    # A window wide enough that nothing is evicted: the group is trained, and the trace shows
    # the start weight the sampler saw.
    wide = {"async_rl__sampler__max_staleness_versions": 8, **_trace(tmp_path)}
    cfg = small_config(tmp_path, grpo__max_num_steps=2, **wide)
    train(cfg)
    state = _saved_state(cfg, ["replay_buffer", "rollout_state"])
    buffered = {g["group_id"]: g for g in state["replay_buffer"]["groups"]}
    saved = [entry for b in state["rollout_state"]["batches"] for entry in b["prompts"]]
    # The rollout state records each dispatched prompt's start weight (the buffered ones agree
    # with their groups); a prompt still waiting for a permit has none.
    for group_id, _, start_weight in saved:
        if group_id in buffered:
            assert start_weight == buffered[group_id]["start_weight"]
    # The first-dispatched saved prompt: made a rollout in flight at the save if it was not.
    gid, start = min(((g, w) for g, _, w in saved if w is not None), key=lambda e: (e[1], e[0]))
    assert start < 2, "the case needs a prompt dispatched before the save's step"
    _as_if_in_flight(cfg, {gid})
    summary, _ = train(small_config(tmp_path, **wide))
    assert summary["train_steps"] == 4
    # Dispatched again at version 2, it still counts as started at its first dispatch's
    # version: the sampler orders (and would evict) it as the uninterrupted run did.
    trained = [e for e in read_trace(tmp_path / "trace.jsonl") if e["event"] == "train"]
    starts = {
        g: w for e in trained for g, w in zip(e["group_ids"], e["start_weights"], strict=True)
    }
    assert starts[gid] == start


def test_a_fork_with_a_new_seed_keeps_the_weights_and_starts_the_data_fresh(
    tmp_path: Path,
) -> None:
    train(small_config(tmp_path, grpo__max_num_steps=2))
    summary, lines = train(small_config(tmp_path, seed=4, checkpointing__fork=True))
    assert summary["run"].startswith("t-fork-")
    assert summary["resumed_from"] == 2
    assert summary["train_steps"] == 4
    assert any("forking run 't'@2" in x and "with its weights" in x for x in lines), lines
    assert any("the fork changed seed" in x and "data order starts fresh" in x for x in lines)
    assert not any("starts from the warm-up model" in x for x in lines)
    # Its data order is the new seed's from the start of epoch 0 (nothing evicted here, so it
    # trains the batches in their order), and its checkpoints carry the new seed's data state.
    trained = [p for h in summary["history"] for p in h["prompt_ids"]]
    assert set(trained) == set(epoch_permutation(64, 4, 0)[: 2 * 2])
    ck = small_config(tmp_path).checkpointing
    with open_run(summary["run"], db=ck.db, store=ck.store, writable=False) as run:
        loader = run.load(components=["dataloader"]).state["dataloader"]
    assert loader["_sampler_iter_state"]["sampler_state"]["seed"] == 4
    again, lines = train(
        small_config(tmp_path, seed=4, checkpointing__fork=True, grpo__max_num_steps=6)
    )
    assert again["run"] == summary["run"]
    assert again["resumed_from"] == 4
    assert not any("data order starts fresh" in x for x in lines)  # only its first start


def test_a_refused_fork_creates_nothing(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, grpo__max_num_steps=2)
    train(cfg)
    runs = _query(cfg, "SELECT name FROM runs ORDER BY name")
    with pytest.raises(ResumeError, match=r"num_generations_per_prompt=4"):
        train(
            small_config(
                tmp_path, seed=4, checkpointing__fork=True, grpo__num_generations_per_prompt=2
            )
        )
    # Refused before the warm-up: no base-<hash> run for the new seed, no empty fork run.
    assert _query(cfg, "SELECT name FROM runs ORDER BY name") == runs


def _corrupt_the_only_checkpoint(tmp_path: Path) -> TrainerConfig:
    cfg = small_config(tmp_path, grpo__max_num_steps=2)
    train(cfg)
    ((digest,),) = _query(
        cfg,
        "SELECT p.index_digest FROM components p JOIN checkpoints c ON c.id = p.checkpoint_id "
        "JOIN runs r ON r.id = c.run_id WHERE r.name = 't' AND c.step = 2 AND p.name = 'policy'",
    )
    path = Path(cfg.checkpointing.store or "") / blob_key(digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return cfg


def test_a_run_whose_checkpoints_are_all_corrupt_is_never_silently_restarted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _corrupt_the_only_checkpoint(tmp_path)
    args = small_overrides(tmp_path, backend="local")
    errors = []
    for _ in range(2):  # the first re-run marks it corrupt, the second finds no committed one
        assert main(args) == 2
        errors.append([x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")])
    assert errors[0] == errors[1]
    assert len(errors[0]) == 1
    assert "no checkpoint to resume from" in errors[0][0]
    assert "steps [2] are corrupt" in errors[0][0]
    assert "checkpointing.start_fresh=true" in errors[0][0]
    summary, lines = train(small_config(tmp_path, checkpointing__start_fresh=True))
    assert summary["resumed_from"] is None
    assert summary["train_steps"] == 4
    assert any("starting it over from step 0" in x for x in lines), lines
