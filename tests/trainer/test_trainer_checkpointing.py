"""The trainer-side checkpointer (trainer/checkpointing.py), in-process (backend=local): resume
falls back past a corrupt latest checkpoint, the reference's retention rule, the recorded
timings, the stale-weights guard, and the one-line refusals that come before anything is
trained or stored (DESIGN.md §9.5-§9.6)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from trainer_helpers import LONG_BUDGET, small_config, small_overrides, train

from ckptstore.cas import blob_key
from ckptstore.checkpointer import Run, open_run
from ckptstore.manifest import Database
from trainer.config import TrainerConfig
from trainer.errors import ResumeError
from trainer.grpo import main
from trainer.workers import PolicyWorker


def _query(cfg: TrainerConfig, sql: str, **params: Any) -> list[Any]:
    engine = create_engine(f"sqlite:///{cfg.checkpointing.db}")
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql), params).all())
    finally:
        engine.dispose()


def _checkpoints(cfg: TrainerConfig, run: str = "t") -> list[tuple[int, str, str]]:
    rows = _query(
        cfg,
        "SELECT c.step, c.status, c.trigger FROM checkpoints c JOIN runs r ON r.id = c.run_id "
        "WHERE r.name = :run ORDER BY c.step",
        run=run,
    )
    return [(r.step, r.status, r.trigger) for r in rows]


def _open(root: Path) -> Run:
    ck = small_config(root).checkpointing
    return open_run("t", db=ck.db, store=ck.store, writable=False)


def _runs(cfg: TrainerConfig) -> list[str]:
    return [r.name for r in _query(cfg, "SELECT name FROM runs ORDER BY name")]


def test_resume_falls_back_past_a_corrupt_latest_checkpoint(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, grpo__max_num_steps=4)
    train(cfg)
    # Flip a byte in the policy index of step 4 (no other checkpoint shares it).
    (digest,) = _query(
        cfg,
        "SELECT p.index_digest FROM components p JOIN checkpoints c ON c.id = p.checkpoint_id "
        "JOIN runs r ON r.id = c.run_id WHERE r.name = 't' AND c.step = 4 AND p.name = 'policy'",
    )[0]
    path = Path(cfg.checkpointing.store or "") / blob_key(digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    summary, lines = train(small_config(tmp_path, grpo__max_num_steps=6))
    assert summary["train_steps"] == 6
    warnings = [x for x in lines if x.startswith("warning: checkpoint step 4")]
    assert len(warnings) == 1, lines
    assert "marked corrupt and the run resumes from step 2" in warnings[0]
    assert any(x.startswith("resumed run 't' from step 2") for x in lines), lines
    # The resumed run trained steps 3-4 again, deterministically: its step 4 re-uploaded the
    # damaged index intact (repairing the old checkpoint), then superseded it.
    with _open(tmp_path) as run:
        rows = [(c.step, c.status) for c in run.checkpoints()]
        old_four = [c for c in run.checkpoints() if c.step == 4 and c.status == "deleted"]
    assert rows == [(2, "committed"), (4, "deleted"), (4, "committed"), (6, "committed")]
    assert "repaired" in (old_four[0].error or "")
    assert "superseded" in (old_four[0].error or "")
    assert "(corrupt)" in (old_four[0].error or "")


def _timeout_then_periodic(root: Path, **extra: Any) -> list[Any]:
    """A timeout save at step 1, then period-2 saves to step 8; every row of run 't'."""
    cut, _ = train(
        small_config(root, checkpointing__checkpoint_must_save_by=LONG_BUDGET, **extra),
        budget_stop_at=1,
    )
    assert cut["train_steps"] == 1
    summary, _ = train(small_config(root, grpo__max_num_steps=8, **extra))
    assert summary["saved_steps"] == [2, 4, 6, 8]
    with _open(root) as run:
        rows = run.checkpoints(statuses=["committed", "deleted"])
    assert {c.step: c.trigger for c in rows} == {
        1: "timeout",
        2: "period",
        4: "period",
        6: "period",
        8: "period",
    }
    return rows


def test_retention_ranks_only_periodic_saves(tmp_path: Path) -> None:
    # keep_top_k=3 by reward, keep_latest_k=1: the three best periodic saves and the latest
    # stay; the timeout save never competes, even when its reward would rank it.
    rows = _timeout_then_periodic(
        tmp_path, checkpointing__keep_top_k=3, checkpointing__keep_latest_k=1
    )
    rewards = {c.step: (c.metrics or {})["train:reward"] for c in rows}
    periodic = sorted((s for s in rewards if s % 2 == 0), key=lambda s: (-rewards[s], -s))
    top = set(periodic[:3])
    # The case is only telling if ranking the timeout save would have changed the outcome.
    assert rewards[1] > min(rewards[s] for s in top), f"rewards {rewards}: pick another seed"
    kept = {c.step for c in rows if c.status == "committed"}
    assert kept == top | {8}, rows


def test_retention_keeps_every_nth_step(tmp_path: Path) -> None:
    # keep_top_k=0 keeps no periodic save by metric; keep_every_n_steps=4 keeps 4 and 8.
    rows = _timeout_then_periodic(
        tmp_path,
        checkpointing__keep_top_k=0,
        checkpointing__keep_latest_k=1,
        checkpointing__keep_every_n_steps=4,
    )
    assert {c.step for c in rows if c.status == "committed"} == {4, 8}, rows


def test_recorded_timings_cover_the_uploads_and_the_longest_wait(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    train(cfg)
    rows = _query(
        cfg,
        "SELECT c.step, c.save_seconds, c.blocked_seconds FROM checkpoints c "
        "JOIN runs r ON r.id = c.run_id WHERE r.name = 't' ORDER BY c.step",
    )
    assert [r.step for r in rows] == [2, 4]
    for row in rows:
        # Blocked is the longest snapshot of any participant: positive, and never longer than
        # the save, which runs from the first snapshot to the commit (uploads included).
        assert row.blocked_seconds > 0
        assert row.save_seconds >= row.blocked_seconds


def test_unchanged_weights_between_saves_are_flagged_as_stale(tmp_path: Path) -> None:
    # lr=0: the train steps change nothing, so step 4 stores the same policy as step 2.
    summary, lines = train(small_config(tmp_path, policy__lr=0.0))
    assert summary["saved_steps"] == [2, 4]
    stale = [x for x in lines if x.startswith("WARNING: step 4 stored the same policy")]
    assert len(stale) == 1, lines
    assert not any(x.startswith("WARNING: step 2") for x in lines)
    with _open(tmp_path) as run:
        infos = {c.step: c.training_info or {} for c in run.checkpoints()}
    assert infos[4]["stale_components"] == ["policy"]
    assert "stale_components" not in infos[2]


def test_changed_group_size_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train(small_config(tmp_path, grpo__max_num_steps=2))
    with pytest.raises(ResumeError, match=r"grpo\.num_generations_per_prompt=4"):
        train(small_config(tmp_path, grpo__num_generations_per_prompt=8))
    overrides = small_overrides(tmp_path, backend="local", **{"grpo.num_generations_per_prompt": 8})
    assert main(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ")
    assert "num_generations_per_prompt=4" in err[0]


def test_a_checkpoint_without_optimizer_state_warns(tmp_path: Path) -> None:
    train(small_config(tmp_path, grpo__max_num_steps=2, checkpointing__save_optimizer=False))
    summary, lines = train(small_config(tmp_path, grpo__max_num_steps=4))
    assert summary["train_steps"] == 4
    assert any("has no optimizer state: the optimizer starts fresh" in x for x in lines), lines


def test_a_refused_config_change_trains_and_stores_nothing(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, grpo__max_num_steps=2)
    train(cfg)
    runs = _runs(cfg)
    assert len(runs) == 2  # the run and its base (warm-up) run
    assert "t" in runs
    # A different warm-up is a different base model: refused before it is trained or stored.
    with pytest.raises(ResumeError, match=r"changed: warmup.steps"):
        train(small_config(tmp_path, warmup__steps=6))
    assert _runs(cfg) == runs
    assert _checkpoints(cfg) == [(2, "committed", "period")]


def test_metric_name_stores_that_metric_of_the_step(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, checkpointing__metric_name="train:kl")
    summary, _ = train(cfg)
    by_step = {h["step"]: h["metrics"] for h in summary["history"]}
    with _open(tmp_path) as run:
        saved = {c.step: c for c in run.checkpoints()}
    assert sorted(saved) == [2, 4]
    for step, info in saved.items():
        metrics = info.metrics or {}
        # Every metric of the step is stored as train:<key>; the named one is also what
        # training_info records and what keep_top_k ranks by.
        assert metrics == {f"train:{k}": v for k, v in by_step[step].items()}
        assert (info.training_info or {})["train:kl"] == by_step[step]["kl"]
        assert metrics["train:kl"] != metrics["train:reward"]


@pytest.mark.parametrize("name", ["val:accuracy", "reward", "train:not_a_metric"])
def test_an_unknown_metric_name_is_one_line_and_exit_2_before_anything_is_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    args = small_overrides(tmp_path, backend="local", **{"checkpointing.metric_name": name})
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"checkpointing.metric_name={name!r}" in err[0]
    assert "train:reward" in err[0]
    assert "train:kl" in err[0]
    assert not (tmp_path / "manifest.db").exists()


def test_total_steps_records_the_steps_taken(tmp_path: Path) -> None:
    train(small_config(tmp_path, grpo__max_num_steps=6))
    with _open(tmp_path) as run:
        infos = {c.step: c.training_info or {} for c in run.checkpoints(["committed", "deleted"])}
    assert {step: info["total_steps"] for step, info in infos.items()} == {2: 2, 4: 4, 6: 6}


#: How long the test below makes the policy worker's uploads take.
UPLOAD_DELAY = 0.5


def test_a_synchronous_save_counts_its_wait_for_the_uploads_as_blocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    receipts = PolicyWorker.shard_receipts

    def slow(self: PolicyWorker, wait: bool) -> Any:
        if wait:  # the uploads take a while; a synchronous save waits for them
            time.sleep(UPLOAD_DELAY)
        return receipts(self, wait)

    monkeypatch.setattr(PolicyWorker, "shard_receipts", slow)
    cfg = small_config(tmp_path, grpo__max_num_steps=2, checkpointing__async_save=False)
    _, lines = train(cfg)
    (row,) = _query(
        cfg,
        "SELECT c.blocked_seconds, c.save_seconds FROM checkpoints c JOIN runs r "
        "ON r.id = c.run_id WHERE r.name = 't'",
    )
    # Training stood still for the uploads: that is blocked time (not only the snapshot).
    assert row.blocked_seconds >= UPLOAD_DELAY
    assert row.save_seconds >= row.blocked_seconds
    (step,) = [x for x in lines if x.startswith("step    2")]
    assert float(step.split("blocked ")[1].rstrip("s")) >= UPLOAD_DELAY


def test_retention_ranks_saves_by_the_trigger_recorded_when_they_were_saved(
    tmp_path: Path,
) -> None:
    # A deliberate difference from the reference, which re-ranks by step % save_period under
    # the current period: a save_period change does not turn earlier periodic saves into
    # off-period ones (which would delete the best checkpoint because of a config change).
    keep = {"checkpointing__keep_top_k": 1, "checkpointing__keep_latest_k": 0}
    train(small_config(tmp_path, grpo__max_num_steps=4, **keep))
    train(small_config(tmp_path, grpo__max_num_steps=6, checkpointing__save_period=3, **keep))
    with _open(tmp_path) as run:
        rows = run.checkpoints(statuses=["committed", "deleted"])
    assert {c.step: c.trigger for c in rows} == {2: "period", 4: "period", 6: "period"}
    rewards = {c.step: (c.metrics or {})["train:reward"] for c in rows}
    best = max(rewards, key=lambda s: (rewards[s], s))
    assert best != 6, f"rewards {rewards}: the case needs step 2 or 4 to rank best"
    # The reference would keep [6] (only 6 % 3 == 0 competes); this keeps the best and the latest.
    assert {c.step for c in rows if c.status == "committed"} == {best, 6}


def test_a_failed_last_save_is_one_error_line_without_a_traceback(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    snapshot = PolicyWorker.snapshot_shards
    calls = {"n": 0}

    def then_break_the_store(self: PolicyWorker, save_optimizer: bool) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the last save (step 4): its uploads find a broken store
            cas = tmp_path / "store" / "cas"
            cas.rename(tmp_path / "cas-moved")
            cas.write_text("not a directory")
        snapshot(self, save_optimizer)

    monkeypatch.setattr(PolicyWorker, "snapshot_shards", then_break_the_store)
    args = small_overrides(tmp_path, backend="local", **{"checkpointing.async_save": False})
    assert main(args) == 1  # a failure at run time, not a configuration error (2)
    # Outside pytest a logged exception prints its traceback on stderr; here caplog holds it.
    logged = [r.getMessage() for r in caplog.records if r.exc_info is not None]
    assert not logged, logged
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, err
    assert "Not a directory" in errors[0]


def test_the_last_lines_say_what_was_saved_what_is_kept_and_where_to_look(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keep = {"checkpointing.keep_top_k": 1, "checkpointing.keep_latest_k": 0}
    args = small_overrides(tmp_path, backend="local", **{"grpo.max_num_steps": 6}, **keep)
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    cfg = small_config(tmp_path)
    kept = [step for step, status, _ in _checkpoints(cfg) if status == "committed"]
    assert len(kept) < 3  # retention deleted a save: the line must not claim all three
    db, store = cfg.checkpointing.db, cfg.checkpointing.store
    assert out[-6] == "finished: run 't' at step 6 (12 prompts, 48 samples)"
    assert out[-5].startswith("this process saved steps [2, 4, 6]; ")
    assert f"the run keeps steps {kept}" in out[-5]
    assert (
        out[-4] == f"the run is in the store {store} and the manifest database {db}; to look at it:"
    )
    assert out[-3].endswith(f"ckptstore --db {db} --store {store} runs")
    assert out[-2].endswith(f"ckptstore --db {db} --store {store} ls t")
    assert f"ckptstore --db {db} --store {store} serve" in out[-1]


def test_a_start_opens_the_manifest_database_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up model's run, a fork's parent and the run share one Database (and store)."""
    opened: list[str] = []
    real_init = Database.__init__

    def counting_init(self: Database, *args: Any, **kwargs: Any) -> None:
        opened.append(str(args[0] if args else kwargs.get("url")))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(Database, "__init__", counting_init)
    db = str(tmp_path / "manifest.db")
    for extra in ({}, {"grpo__max_num_steps": 6}, {"seed": 4, "checkpointing__fork": True}):
        opened.clear()
        summary, _ = train(small_config(tmp_path, **extra))  # new, resumed, forked
        assert opened == [db], (extra, opened)
    assert summary["run"].startswith("t-fork-")
