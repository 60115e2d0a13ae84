"""Per-step metrics (``step_metrics``, migration 0008): written in batches by
``Run.log_metrics``, read back as plain SQL, on SQLite and PostgreSQL."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sqlalchemy import event, inspect, text

from ckptstore.checkpointer import open_run
from ckptstore.checkpointer.step_log import StepLog
from ckptstore.errors import ConfigError, RunStateError
from ckptstore.manifest import Database
from ckptstore.manifest import step_metrics as steps
from ckptstore.objectstore import LocalStore


class Commits:
    """Counts the transactions an engine commits."""

    def __init__(self, database: Database) -> None:
        self.count = 0
        self._engine = database.engine
        event.listen(self._engine, "commit", self._commit)

    def _commit(self, _conn: Any) -> None:
        self.count += 1

    def close(self) -> None:
        event.remove(self._engine, "commit", self._commit)


@pytest.fixture
def commits(db_url: str) -> Iterator[tuple[Database, Commits]]:
    database = Database(db_url)
    counter = Commits(database)
    yield database, counter
    counter.close()
    database.close()


def curve(database: Database, run: str, name: str) -> list[tuple[int, float | None]]:
    """One metric's curve, as a user of ``ckptstore sql`` would ask for it."""
    with database.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT m.step, m.value FROM step_metrics m JOIN runs r ON r.id = m.run_id "
                "WHERE r.name = :run AND m.name = :name ORDER BY m.step"
            ),
            {"run": run, "name": name},
        )
        return [(int(step), value) for step, value in rows]


def test_a_thousand_steps_are_a_handful_of_writes(
    commits: tuple[Database, Commits], store: LocalStore
) -> None:
    database, counter = commits
    with open_run("r", db=database, store=store, async_save=False) as run:
        before = counter.count
        for step in range(1, 1001):
            run.log_metrics(step, {"loss": 1 / step, "reward": step * 0.5})
        logged = counter.count - before
        assert logged == 10  # one transaction per 100 steps: 2,000 values
        run.log_metrics(1001, {"loss": 0.0})
        assert counter.count - before == 10  # buffered until the next batch, save or close
        assert curve(database, "r", "loss")[-1][0] == 1000
    assert len(curve(database, "r", "loss")) == 1001  # close wrote the last one
    assert curve(database, "r", "reward")[:2] == [(1, 0.5), (2, 1.0)]


def test_a_save_writes_the_buffered_steps_first(
    commits: tuple[Database, Commits], store: LocalStore
) -> None:
    database, _ = commits
    with open_run("r", db=database, store=store, async_save=False) as run:
        for step in range(1, 6):
            run.log_metrics(step, {"loss": float(step)})
        assert curve(database, "r", "loss") == []
        run.save(5, {"m": torch.ones(2)}, metrics={"loss": 5.0}).wait()
        assert [s for s, _ in curve(database, "r", "loss")] == [1, 2, 3, 4, 5]


def test_batches_are_due_by_time_too_and_a_step_logged_again_is_replaced(
    commits: tuple[Database, Commits],
) -> None:
    database, counter = commits
    with database.engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name, writer_epoch) VALUES (1, 'r', 1)"))
    now = [0.0]
    log = StepLog(database, 1, every_steps=1000, every_seconds=30, clock=lambda: now[0])
    before = counter.count
    log.log(1, {"loss": 2.0})
    log.log(2, {"loss": math.nan, "lr": math.inf})
    assert counter.count == before
    now[0] = 31.0
    log.log(3, {"loss": 1.5})
    assert (counter.count - before, log.writes, log.pending) == (1, 1, 0)
    log.log(2, {"loss": 1.75})  # a resumed run trains step 2 again
    assert log.flush() == 1
    assert curve(database, "r", "loss") == [(1, 2.0), (2, 1.75), (3, 1.5)]
    assert curve(database, "r", "lr") == [(2, math.inf)]
    log.log(4, {"loss": math.nan})
    log.flush()
    assert curve(database, "r", "loss")[-1] == (4, None)  # NaN is NULL, on both databases
    with database.engine.connect() as conn:
        assert steps.curves(conn, 1, ["loss"], 10)["loss"][-1] == (3, 1.5)  # NULLs left out


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"loss": "low"}, "numbers only"),
        ({"loss": True}, "numbers only"),
        ({"loss": None}, "numbers only"),
        ({"loss": [1.0]}, "numbers only"),
        ({"": 1.0}, "1 to 255 characters"),
        ({"x" * 256: 1.0}, "1 to 255 characters"),
    ],
)
def test_what_log_metrics_refuses(
    commits: tuple[Database, Commits], store: LocalStore, metrics: dict[str, Any], message: str
) -> None:
    database, _ = commits
    with open_run("r", db=database, store=store) as run:
        with pytest.raises(ConfigError, match=message):
            run.log_metrics(1, metrics)
        run.log_metrics(1, {"loss": torch.tensor(0.5), "n": 3})  # a 0-d tensor and an int
    assert curve(database, "r", "loss") == [(1, 0.5)]
    with pytest.raises(RunStateError, match="closed"):
        run.log_metrics(2, {"loss": 1.0})


def test_thin_keeps_the_ends_and_spaces_the_rest() -> None:
    points = [(i, float(i)) for i in range(1001)]
    thinned = steps.thin(points, 11)
    assert [s for s, _ in thinned] == list(range(0, 1001, 100))
    assert steps.thin(points[:5], 11) == points[:5]


def test_migration_0008_up_and_down(db_url: str) -> None:
    database = Database(db_url)
    try:
        with database.engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name, writer_epoch) VALUES (1, 'r', 1)"))
            steps.record(conn, 1, [(1, "loss", 0.5)], dt_now())
        _downgrade(database, "0007")
        with database.engine.connect() as conn:
            assert "step_metrics" not in inspect(conn).get_table_names()
        database.upgrade("0008")
        with database.engine.begin() as conn:
            assert "step_metrics" in inspect(conn).get_table_names()
            steps.record(conn, 1, [(1, "loss", 0.25), (2, "loss", 0.2)], dt_now())
            # Deleting the run deletes its curve.
            conn.execute(text("DELETE FROM runs WHERE id = 1"))
            assert conn.execute(text("SELECT COUNT(*) FROM step_metrics")).scalar() == 0
    finally:
        database.close()


def test_ckptstore_sql_reads_the_curve(
    commits: tuple[Database, Commits], store: LocalStore, db_url: str, capsys: Any
) -> None:
    """As ``ckptstore sql`` (on PostgreSQL as ckptstore_reader, whom migration 0008 grants
    SELECT on the table)."""
    from ckptstore.cli.main import main

    database, _ = commits
    with open_run("r", db=database, store=store) as run:
        for step in (1, 2, 3):
            run.log_metrics(step, {"loss": 1.0 / step})
    query = (
        "SELECT m.step, m.value FROM step_metrics m JOIN runs r ON r.id = m.run_id "
        "WHERE r.name = 'r' AND m.name = 'loss' ORDER BY m.step"
    )
    capsys.readouterr()
    assert main(["--db", db_url, "sql", "--json", "--allow-superuser", query]) == 0
    out = capsys.readouterr().out
    assert "0.5" in out
    assert "0.333" in out


def dt_now() -> Any:
    import datetime as dt

    return dt.datetime.now(dt.UTC)


def _downgrade(database: Database, revision: str) -> None:
    from alembic import command

    from ckptstore.manifest.db import _alembic_config

    with database.engine.begin() as conn:
        command.downgrade(_alembic_config(conn), revision)
