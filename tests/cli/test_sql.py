"""``ckptstore sql QUERY``: read-only queries in text, JSON or CSV; every write is refused.

The tests use ``sql_store`` (over ``plain_db_url``: a fresh SQLite file or a fresh PostgreSQL
*database*); one test checks that a URL with its own ``options`` (a search_path) works too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from populated import ALPHA_STATUS, Populated, assert_one_line_error, cli, randn, superuser_flag
from sqlalchemy import text

from ckptstore.checkpointer import open_run
from ckptstore.cli import main
from ckptstore.manifest import Database


def test_sql_formats(sql_store: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    query = (
        "SELECT r.name AS run, c.step AS step, c.status AS status FROM checkpoints c"
        " JOIN runs r ON r.id = c.run_id WHERE r.name = 'alpha' ORDER BY c.step"
    )
    expected = [("alpha", s, st) for s, st in ALPHA_STATUS.items()]
    flags = superuser_flag(sql_store.db_url)

    code, out, err = cli(sql_store, capsys, "sql", query, *flags)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == ["run", "step", "status"]
    assert [tuple(line.split()) for line in lines[2:]] == [(r, str(s), st) for r, s, st in expected]

    code, out, err = cli(sql_store, capsys, "sql", query, "--format", "json", *flags)
    assert (code, err) == (0, "")
    assert json.loads(out) == [{"run": r, "step": s, "status": st} for r, s, st in expected]
    assert json.loads(cli(sql_store, capsys, "--json", "sql", query, *flags)[1]) == json.loads(out)

    # The views for people; csv for scripts.
    code, out, err = cli(
        sql_store,
        capsys,
        "sql",
        "SELECT run, checkpoints, failed FROM run_summary ORDER BY run",
        "--format",
        "csv",
        *flags,
    )
    assert (code, err) == (0, "")
    assert out.splitlines() == ["run,checkpoints,failed", "alpha,7,1", "beta,2,0"]

    code, out, err = cli(sql_store, capsys, "sql", "SELECT 1 AS one WHERE 1 = 0", *flags)
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == "one"


#: Not a query: refused by the statement-kind check before anything connects (exit 2).
NOT_A_QUERY = [
    "INSERT INTO runs (name, writer_epoch, higher_is_better) VALUES ('evil', 0, TRUE)",
    "UPDATE checkpoints SET status = 'deleted'",
    "DELETE FROM checkpoint_blobs",
    "DELETE FROM runs",
    "CREATE TABLE evil (a INTEGER)",
    "DROP VIEW run_summary",
    "DROP TABLE blobs",
    "COMMIT; DELETE FROM runs",
    "ROLLBACK; DELETE FROM runs",
]


#: A query that would write: it passes the kind check, and the database refuses it (exit 3).
WRITING_QUERY = "WITH gone AS (DELETE FROM runs RETURNING id) SELECT count(*) FROM gone"


#: What the database says: SQLite has no DELETE inside WITH; PostgreSQL allows none in the
#: subquery that `ckptstore sql` wraps every query in.
SQLITE_REFUSAL = re.compile(r'near "DELETE": syntax error')


POSTGRES_REFUSAL = re.compile(r"data-modifying statement must be at the top level")


def table_contents(db_url: str) -> dict[str, Any]:
    db = Database(db_url)
    try:
        with db.read() as session:
            contents: dict[str, Any] = {
                table: session.execute(text(f"SELECT * FROM {table} ORDER BY 1")).all()
                for table in ("runs", "checkpoints", "components", "blobs", "checkpoint_blobs")
            }
            contents["run_summary"] = session.execute(
                text("SELECT * FROM run_summary ORDER BY 1")
            ).all()
            contents["tables"] = sorted(
                session.execute(
                    text("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")
                    if db.is_sqlite
                    else text(
                        "SELECT table_name FROM information_schema.tables"
                        " WHERE table_schema = current_schema()"
                    )
                ).scalars()
            )
        return contents
    finally:
        db.close()


def test_sql_refuses_every_write(sql_store: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    before = table_contents(sql_store.db_url)
    assert len(before["runs"]) == 2
    assert "evil" not in before["tables"]
    flags = superuser_flag(sql_store.db_url)
    for statement in NOT_A_QUERY:
        code, out, err = cli(sql_store, capsys, "sql", statement, *flags)
        assert (code, out) == (2, ""), statement
        assert_one_line_error(err, "read-only")
        assert table_contents(sql_store.db_url) == before, statement
    code, out, err = cli(sql_store, capsys, "sql", WRITING_QUERY, *flags)
    assert (code, out) == (3, "")
    assert_one_line_error(err)
    refusal = SQLITE_REFUSAL if sql_store.db_url.startswith("sqlite") else POSTGRES_REFUSAL
    assert refusal.search(err), err
    assert table_contents(sql_store.db_url) == before
    # Still a working manifest afterwards.
    assert cli(sql_store, capsys, "latest", "alpha") == (0, "7\n", "")


@pytest.mark.integration
def test_sql_honours_options_in_the_postgresql_url(
    pg_schema_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with open_run("alpha", db=pg_schema_url, store=tmp_path / "store") as run:
        run.save(1, {"policy": {"w": randn(1, 8)}}).wait()
    base = ["--db", pg_schema_url, "--store", str(tmp_path / "store")]
    capsys.readouterr()
    # The test server's login is its superuser.
    code = main([*base, "--json", "sql", "SELECT name FROM runs", "--allow-superuser"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out) == [{"name": "alpha"}]


def test_sql_attach_creates_no_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db_url = f"sqlite:///{tmp_path / 'manifest.db'}"
    with open_run("alpha", db=db_url, store=tmp_path / "store") as run:
        run.save(1, {"policy": {"w": randn(1, 8)}}).wait()
    target = tmp_path / "created-by-sql.db"
    capsys.readouterr()
    main(["--db", db_url, "sql", f"ATTACH DATABASE '{target}' AS evil"])
    assert not target.exists()


def test_an_unknown_table_or_column_lists_what_exists(
    sql_store: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = superuser_flag(sql_store.db_url)
    code, out, err = cli(sql_store, capsys, "sql", "SELECT * FROM checkpoint", *flags)
    assert (code, out) == (3, "")
    assert_one_line_error(err, "the tables and views it can read: runs, checkpoints, ")
    assert "run_summary" in err

    query = "SELECT c.stepp FROM checkpoints c JOIN runs r ON r.id = c.run_id"
    code, out, err = cli(sql_store, capsys, "sql", query, *flags)
    assert (code, out) == (3, "")
    assert_one_line_error(err, "the columns: runs(id, name, ", "checkpoints(id, run_id, step, ")
    assert "blobs(" not in err  # only the relations the query names

    # Any other failure is reported as it was.
    code, out, err = cli(sql_store, capsys, "sql", "SELECT 1 +", *flags)
    assert code != 0
    assert "the columns" not in err
    assert "the tables" not in err
