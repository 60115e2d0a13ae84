"""What the ``ckptstore sql`` tests share: the databases they attack, and how they check a refusal.

Each case goes through the CLI in-process (``main([...])``: exit code, one-line error) or through
``run_readonly``, and afterwards checks that nothing changed: the row count of every manifest
table, and that the tables still exist (:func:`snapshot`). The fixtures that build the targets
are in this directory's conftest.py.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import JSON, Engine, bindparam, text
from sqlalchemy.engine import make_url

from ckptstore.cli import main

TABLES = ("runs", "checkpoints", "components", "blobs", "checkpoint_blobs", "gc_lease")
RELATIONS = (*TABLES, "alembic_version", "checkpoint_summary", "run_summary")
ACCEPTED = "SELECT, WITH ... SELECT, VALUES"


@dataclass(frozen=True)
class Target:
    dialect: str
    #: What `ckptstore sql` connects with (on PostgreSQL: the reader login).
    url: str
    #: The owner's engine, for setting up and for checking that nothing changed.
    admin: Engine
    #: Where files an attack might create are looked for (fresh names per use).
    scratch: Path

    def fresh_path(self, stem: str) -> Path:
        return self.scratch / f"ckpt-sql-{stem}-{secrets.token_hex(6)}"


# -- databases --------------------------------------------------------------------------------


def insert_sample(engine: Engine) -> None:
    """Two runs; run-a (lower loss is better) has two committed checkpoints and a failed one."""
    metrics = bindparam("metrics", type_=JSON)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO runs (id, name, writer_epoch, metric_name, higher_is_better) "
                "VALUES (1, 'run-a', 0, 'loss', :f), (2, 'run-b', 0, NULL, :t)"
            ),
            {"f": False, "t": True},
        )
        conn.execute(
            text(
                'INSERT INTO checkpoints (id, run_id, step, status, writer_epoch, "trigger", '
                "metrics, logical_bytes, stored_bytes) "
                "VALUES (:id, 1, :step, :status, 0, 'period', :metrics, 10, 5)"
            ).bindparams(metrics),
            [
                {"id": 1, "step": 100, "status": "committed", "metrics": {"loss": 0.5}},
                {"id": 2, "step": 200, "status": "committed", "metrics": {"loss": 0.25}},
                {"id": 3, "step": 300, "status": "failed", "metrics": {"loss": 0.1}},
            ],
        )


def snapshot(target: Target) -> dict[str, Any]:
    """Row counts of every manifest table, and which tables and views exist."""
    with target.admin.connect() as conn:
        if target.dialect == "sqlite":
            names = "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')"
        else:
            names = (
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = current_schema()"
            )
        state: dict[str, Any] = {"relations": sorted(conn.execute(text(names)).scalars())}
        for table in TABLES:
            state[table] = conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
    return state


def schema_of(url: str) -> str:
    """The schema a test URL selects through its search_path option."""
    return str(make_url(url).query["options"]).removeprefix("-csearch_path=")


def sql(
    url: str, capsys: pytest.CaptureFixture[str], *args: str, global_args: tuple[str, ...] = ()
) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["--db", url, *global_args, "sql", *args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckptstore: error: "), err
    for needle in needles:
        assert needle in lines[0], err


def assert_refused(
    target: Target,
    capsys: pytest.CaptureFixture[str],
    statement: str,
    code: int,
    needle: str,
    *args: str,
) -> None:
    """``statement`` exits with ``code`` and one line containing ``needle``; nothing changed."""
    before = snapshot(target)
    got, out, err = sql(target.url, capsys, statement, *args)
    assert (got, out) == (code, ""), (statement, err)
    assert_one_line_error(err, needle)
    assert snapshot(target) == before, statement
    assert "runs" in before["relations"]
