"""The reference's two-run test, through the real command on Ray (DESIGN.md §11).

Run 1 stops after one step (``checkpointing.stop_after_steps=1``: the reference's 1-second
``checkpoint_must_save_by`` counted from the first iteration; ours counts from process start
and is never overrun, so a budget start-up has spent trains nothing, see test_trainer_budget):
it saves at the first step boundary, says why it stops and exits 0, with its start-up phases
on stderr (``--progress``). Run 2, the same command without the stop, resumes from step 1 and
reaches max_num_steps=4; without a terminal or ``--progress`` it prints no progress lines.
Once on SQLite + a local directory, once on PostgreSQL + SeaweedFS.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from trainer_helpers import checkout_env, small_overrides

from ckptstore.testing.factories import S3Endpoint

pytestmark = pytest.mark.timeout(600)


def _trainer(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer.grpo", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return checkout_env(
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="disabled",
        HOME=str(tmp_path / "home"),  # Ray's per-user files stay in the test's tmp dir
        PYTHONUNBUFFERED="1",
        **extra,
    )


def _two_runs(tmp_path: Path, db: str, store: str, env: dict[str, str]) -> None:
    args = small_overrides(tmp_path, **{"checkpointing.db": db, "checkpointing.store": store})
    first = _trainer(["--progress", *args, "checkpointing.stop_after_steps=1"], env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "checkpointing.stop_after_steps=1: this start trained 1 step;" in first.stdout
    assert "saved step 1 of run 't' and stopping early" in first.stdout
    phases = [line for line in first.stderr.splitlines() if line.startswith("[")]
    for what in ("starting Ray", "warm-up model", "waiting for the first rollouts", "trained"):
        assert any(what in line for line in phases), first.stderr
    assert "stopped early: run 't' at step 1" in first.stdout
    assert "step    2" not in first.stdout

    second = _trainer(args, env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "starting Ray" not in second.stderr
    assert "resumed run 't' from step 1" in second.stdout
    assert "finished: run 't' at step 4" in second.stdout
    assert "step    1 " not in second.stdout
    for step in (2, 3, 4):
        assert f"step    {step} | reward" in second.stdout

    engine = create_engine(db)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT c.step, c.status, c.trigger FROM checkpoints c "
                    "JOIN runs r ON r.id = c.run_id WHERE r.name = 't' ORDER BY c.step"
                )
            ).all()
            pending = conn.execute(
                text("SELECT count(*) FROM checkpoints WHERE status = 'pending'")
            ).scalar_one()
    finally:
        engine.dispose()
    assert pending == 0
    assert [(r.step, r.status, r.trigger) for r in rows] == [
        # The reference's retention: only periodic saves compete for keep_top_k, and a
        # non-periodic one that is not among the keep_latest_k=2 newest goes.
        (1, "deleted", "timeout"),
        (2, "committed", "period"),
        (4, "committed", "period"),
    ]


def test_two_runs_sqlite_and_local_store(tmp_path: Path) -> None:
    _two_runs(
        tmp_path,
        f"sqlite:///{tmp_path / 'manifest.db'}",
        str(tmp_path / "store"),
        _env(tmp_path),
    )


@pytest.mark.integration
def test_two_runs_postgresql_and_seaweedfs(
    tmp_path: Path, pg_schema_url: str, seaweed_endpoint: S3Endpoint, seaweed_bucket: str
) -> None:
    assert seaweed_endpoint.endpoint_url is not None
    store = f"s3://{seaweed_bucket}/trainer-{secrets.token_hex(4)}"
    env = _env(tmp_path, AWS_ENDPOINT_URL=seaweed_endpoint.endpoint_url)
    _two_runs(tmp_path, pg_schema_url, store, env)
