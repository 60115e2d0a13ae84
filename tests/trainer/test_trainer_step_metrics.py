"""The trainer logs every step's statistics per step (``step_metrics``, issue 42 item 8): the
curve between checkpoints, the same names as the checkpoints' metrics, in batches."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, text
from trainer_helpers import small_config, train


def test_every_step_is_on_the_curve_with_the_checkpoints_names(tmp_path: Path) -> None:
    summary, _ = train(small_config(tmp_path))
    by_step = {h["step"]: h["metrics"] for h in summary["history"]}
    engine = create_engine(f"sqlite:///{tmp_path / 'manifest.db'}")
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT m.step, m.name, m.value FROM step_metrics m "
                    "JOIN runs r ON r.id = m.run_id WHERE r.name = 't' ORDER BY m.step, m.name"
                )
            ).all()
            saved = conn.execute(text("SELECT step, metrics FROM checkpoints")).all()
    finally:
        engine.dispose()
    logged: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        logged.setdefault(step, {})[name] = value
    assert sorted(logged) == sorted(by_step) == [1, 2, 3, 4]
    for step, metrics in by_step.items():
        assert logged[step] == {f"train:{k}": v for k, v in metrics.items()}
    assert {step for step, _ in saved} <= set(logged)
