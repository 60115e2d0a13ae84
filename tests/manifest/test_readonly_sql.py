"""`ckptstore sql` can only read, on SQLite and on a real PostgreSQL server.

The targets, fixtures and refusal checks are in readonly_targets.py and conftest.py. The superuser
and a login outside ``ckptstore_reader`` are tried separately. The layers of
``ckptstore/manifest/readonly/`` are also checked one at a time: the statement-kind check, the
grammar (the wrapped text run as superuser in a writable transaction) and the role (superuser with
``--allow-superuser``); the calls layer, and each layer below it on its own, in
test_readonly_calls.py.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from alembic import command
from readonly_targets import (
    ACCEPTED,
    RELATIONS,
    Target,
    assert_one_line_error,
    assert_refused,
    snapshot,
    sql,
)
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from ckptstore.errors import ConfigError, DatabaseError
from ckptstore.manifest import Database
from ckptstore.manifest.db import _alembic_config
from ckptstore.manifest.readonly import READER_ROLE, run_readonly, wrap_as_select

# -- what works -------------------------------------------------------------------------------


def test_select_over_the_summary_views_with_json(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    loss = (
        "metrics ->> 'loss'"
        if target.dialect == "postgresql"
        else "json_extract(metrics, '$.loss')"
    )
    query = (
        f"SELECT run, step, status, CAST({loss} AS REAL) AS loss FROM checkpoint_summary "
        "WHERE run = 'run-a' ORDER BY step"
    )
    code, out, err = sql(target.url, capsys, query, global_args=("--json",))
    assert (code, err) == (0, "")
    assert json.loads(out) == [
        {"run": "run-a", "step": 100, "status": "committed", "loss": 0.5},
        {"run": "run-a", "step": 200, "status": "committed", "loss": 0.25},
        {"run": "run-a", "step": 300, "status": "failed", "loss": pytest.approx(0.1)},
    ]
    code, out, err = sql(
        target.url,
        capsys,
        "SELECT run, committed, best_metric FROM run_summary ORDER BY run",
        "--format",
        "csv",
    )
    assert (code, err) == (0, "")
    assert out.splitlines() == ["run,committed,best_metric", "run-a,2,0.25", "run-b,0,"]


def test_queries_of_every_accepted_kind(target: Target) -> None:
    assert run_readonly(target.url, "VALUES (1, 'a'), (2, 'b')") == (
        ["column1", "column2"],
        [(1, "a"), (2, "b")],
    )
    columns, rows = run_readonly(
        target.url,
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3) "
        "SELECT i FROM n",
    )
    assert [tuple(r) for r in rows] == [(1,), (2,), (3,)]
    if target.dialect == "sqlite":
        _, plan = run_readonly(target.url, "EXPLAIN QUERY PLAN SELECT * FROM runs")
        assert any("runs" in str(row) for row in plan)
        columns, _ = run_readonly(target.url, "EXPLAIN SELECT 1")
        assert "opcode" in columns
        return
    columns, rows = run_readonly(target.url, "TABLE runs")
    assert "name" in columns
    assert len(rows) == 2
    for explain in (
        "EXPLAIN SELECT * FROM runs",
        "explain verbose SELECT * FROM runs",
        "EXPLAIN (COSTS off, FORMAT text) SELECT * FROM runs",
    ):
        columns, rows = run_readonly(target.url, explain)
        assert columns == ["QUERY PLAN"], explain
        assert "runs" in "\n".join(row[0] for row in rows), explain
    _, rows = run_readonly(target.url, "EXPLAIN (FORMAT JSON, VERBOSE true) VALUES (1)")
    assert rows[0][0][0]["Plan"]
    # What the calls layer lets through: operators, casts, aggregates over rows of a manifest
    # table, window functions, stable functions, harmless volatile ones, the system catalogs
    # and information_schema, columns that share a name.
    for query, expected in (
        ("SELECT count(*) FILTER (WHERE metrics ->> 'loss' IS NOT NULL) FROM checkpoints", 3),
        ("SELECT CAST(max(step) AS text) || '!' FROM checkpoints", "300!"),
        ("SELECT cardinality(array_agg(r)) FROM runs r", 2),
        ("SELECT rank() OVER (ORDER BY step DESC) FROM checkpoints ORDER BY step LIMIT 1", 3),
        ("SELECT count(*) FROM runs WHERE created_at <= now() + interval '1 day'", 2),
        ("SELECT count(*) FROM (SELECT * FROM runs ORDER BY random()) AS r", 2),
        ("SELECT count(*) > 0 FROM pg_stat_activity", True),
        ("SELECT count(*) FROM information_schema.tables WHERE table_name = 'runs'", 1),
        ("SELECT a.id, b.id FROM runs a JOIN runs b ON a.id = b.id ORDER BY 1 LIMIT 1", 1),
        ('SELECT 1 AS ":funcid 2880 :opno 1 (o 2880)"', 1),
    ):
        assert run_readonly(target.url, query)[1][0][0] == expected, query


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("SELECT 1 AS one -- a comment where the query ends", [(1,)]),
        ("/* leading */ -- and another\nSELECT 2 AS two", [(2,)]),
        ("SELECT ';' AS s;", [(";",)]),
        ("SELECT 3 AS three;  -- a trailing semicolon", [(3,)]),
    ],
)
def test_comments_and_semicolons_that_are_harmless(
    target: Target, query: str, expected: list[tuple[Any, ...]]
) -> None:
    assert [tuple(r) for r in run_readonly(target.url, query)[1]] == expected


@pytest.mark.integration
def test_postgresql_text_that_closes_the_parenthesis_is_still_one_select(
    pg_target: Target,
) -> None:
    before = snapshot(pg_target)
    # A dollar-quoted string holds the semicolons and the comment: a value, not statements.
    _, rows = run_readonly(pg_target.url, "SELECT $a$ ); DELETE FROM runs; -- $a$ AS s")
    assert rows == [(" ); DELETE FROM runs; -- ",)]
    # The text may close the wrapping subquery itself; the result is still one SELECT.
    _, rows = run_readonly(
        pg_target.url, "SELECT 1 AS n) AS q UNION ALL SELECT count(*) FROM (SELECT * FROM runs"
    )
    assert sorted(row[0] for row in rows) == [1, 2]
    assert snapshot(pg_target) == before


# -- refused: statement kinds, writes, several statements -------------------------------------

BOTH_REFUSED_KIND = [
    "INSERT INTO runs (name, writer_epoch, higher_is_better) VALUES ('evil', 0, TRUE)",
    "UPDATE checkpoints SET status = 'deleted'",
    "DELETE FROM runs",
    "DROP TABLE runs",
    "DROP VIEW run_summary",
    "CREATE TABLE evil (a INTEGER)",
    "COMMIT; DELETE FROM runs",
    "ROLLBACK; DELETE FROM runs",
    "/* SELECT */ DELETE FROM runs",
    "-- SELECT\nDELETE FROM runs",
    "EXPLAIN DELETE FROM runs",
    "(SELECT 1)",
    "",
]


@pytest.mark.parametrize("statement", BOTH_REFUSED_KIND)
def test_statements_that_are_not_queries_are_refused(
    target: Target, capsys: pytest.CaptureFixture[str], statement: str
) -> None:
    assert_refused(target, capsys, statement, 2, ACCEPTED)


@pytest.mark.parametrize(
    "statement",
    [
        "EXPLAIN ANALYZE DELETE FROM runs",
        "EXPLAIN ANALYZE SELECT * FROM runs",
        "explain analyse SELECT 1",
    ],
)
def test_explain_analyze_is_refused(
    target: Target, capsys: pytest.CaptureFixture[str], statement: str
) -> None:
    assert_refused(target, capsys, statement, 2, "EXPLAIN ANALYZE")


@pytest.mark.integration
@pytest.mark.parametrize(
    ("statement", "needle"),
    [
        ("EXPLAIN (ANALYZE) DELETE FROM runs", "EXPLAIN ANALYZE"),
        ("EXPLAIN (ANALYZE true) SELECT * FROM runs", "EXPLAIN ANALYZE"),
        ("EXPLAIN (analyse) SELECT 1", "EXPLAIN ANALYZE"),
        ("EXPLAIN (COSTS off, ANALYZE on) SELECT 1", "EXPLAIN ANALYZE"),
        ('EXPLAIN ("analyze") SELECT 1', "unsupported EXPLAIN option"),
        ("EXPLAIN (FORMAT json, analyze) SELECT 1", "EXPLAIN ANALYZE"),
        ("EXPLAIN VERBOSE ANALYZE SELECT 1", "EXPLAIN ANALYZE"),
        ("EXPLAIN (COSTS 'off; DELETE') SELECT 1", "unsupported value"),
    ],
)
def test_postgresql_explain_analyze_in_any_spelling_is_refused(
    pg_target: Target, capsys: pytest.CaptureFixture[str], statement: str, needle: str
) -> None:
    assert_refused(pg_target, capsys, statement, 2, needle)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("statement", "code", "needle"),
    [
        ("SELECT 1; DELETE FROM runs", 2, "one read-only statement"),
        ("SELECT 1) AS q; DELETE FROM runs; SELECT * FROM (SELECT 1", 2, "one read-only statement"),
        ("SELECT $$ $$; DELETE FROM runs; SELECT $$ $$", 2, "one read-only statement"),
        ("SELECT 1 /* an open comment", 2, "ends inside a string, quoted name or comment"),
        ("SELECT 'an open string", 2, "ends inside"),
        ("SET ROLE postgres", 2, "got SET"),
        ("TRUNCATE runs", 2, "got TRUNCATE"),
        (
            "WITH d AS (DELETE FROM runs RETURNING *) SELECT * FROM d",
            3,
            "data-modifying statement must be at the top level",
        ),
        ("SELECT 1 AS x) AS q, LATERAL (DELETE FROM runs RETURNING 1) AS d(y", 3, "syntax error"),
        ("SELECT * FROM runs FOR UPDATE", 3, "read-only"),
        ("SELECT * FROM runs FOR NO KEY UPDATE", 3, "read-only"),
        ("SELECT * FROM runs FOR SHARE", 3, "read-only"),
        ("SELECT * FROM runs FOR KEY SHARE", 3, "read-only"),
        ("SELECT * FROM (SELECT * FROM runs FOR SHARE) AS r", 3, "read-only"),
        ("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE", 2, "got LOCK"),
        ("SELECT nextval(pg_get_serial_sequence('runs', 'id'))", 2, "nextval(regclass)"),
    ],
)
def test_postgresql_refuses_writes_and_second_statements(
    pg_target: Target, capsys: pytest.CaptureFixture[str], statement: str, code: int, needle: str
) -> None:
    assert_refused(pg_target, capsys, statement, code, needle)


@pytest.mark.parametrize(
    ("statement", "code", "needle"),
    [
        ("SELECT 1; DELETE FROM runs", 3, "one statement at a time"),
        ("WITH d AS (DELETE FROM runs RETURNING *) SELECT * FROM d", 3, "syntax error"),
        ("WITH x AS (SELECT 1) DELETE FROM runs", 3, "not authorized"),
        ("PRAGMA writable_schema=ON", 2, "got PRAGMA"),
        ("SELECT load_extension('/nonexistent/evil')", 3, "not authorized to use function"),
        ("SELECT LOAD_EXTENSION('/nonexistent/evil', 'entry')", 3, "LOAD_EXTENSION"),
        ("TABLE runs", 2, "got TABLE"),
    ],
)
def test_sqlite_refuses_writes_and_extensions(
    sqlite_target: Target,
    capsys: pytest.CaptureFixture[str],
    statement: str,
    code: int,
    needle: str,
) -> None:
    assert_refused(sqlite_target, capsys, statement, code, needle)


def test_sqlite_attach_and_vacuum_into_create_no_file(
    sqlite_target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    for template in ("ATTACH DATABASE '{}' AS evil", "VACUUM INTO '{}'"):
        path = sqlite_target.fresh_path("created-by-sql")
        statement = template.format(path)
        assert_refused(sqlite_target, capsys, statement, 2, ACCEPTED)
        assert not path.exists(), statement


# -- refused on PostgreSQL: files, programs, other sessions -----------------------------------


def _dangerous(target: Target) -> list[tuple[str, int, str, Path | None]]:
    """(statement, exit code, message, a file it would create) for the server-side attacks."""
    marker = target.fresh_path("program-ran")
    copied = target.fresh_path("copied")
    marker2 = target.fresh_path("program-ran-in-do")
    return [
        (f"COPY (SELECT 1) TO PROGRAM 'touch {marker}'", 2, "got COPY", marker),
        (f"COPY runs TO '{copied}'", 2, "got COPY", copied),
        (
            f"DO $$ BEGIN EXECUTE 'COPY (SELECT 1) TO PROGRAM ''touch {marker2}'''; END $$",
            2,
            "got DO",
            marker2,
        ),
        ("SELECT pg_read_file('/etc/hostname')", 2, "pg_read_file(text) is volatile", None),
        ("SELECT * FROM pg_ls_dir('.')", 2, "function pg_ls_dir(text) is volatile", None),
        ("SELECT pg_stat_reset()", 2, "function pg_stat_reset() is volatile", None),
        ("SELECT lo_import('/etc/hostname')", 2, "function lo_import(text) is volatile", None),
        ("SELECT pg_advisory_lock(1)", 2, "function pg_advisory_lock(bigint) is volatile", None),
    ]


@pytest.mark.integration
def test_postgresql_control_the_superuser_can_run_a_program(
    pg_target: Target, pg_admin_url: str
) -> None:
    """Without ckptstore in the way the server does create the marker: its absence elsewhere
    in this file means an attack did not run."""
    marker = pg_target.fresh_path("control")
    dsn = make_url(pg_admin_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"COPY (SELECT 1) TO PROGRAM 'touch {marker}'")
    if not marker.exists():
        pytest.skip("the PostgreSQL server does not share this machine's /tmp")
    marker.unlink()


@pytest.mark.integration
def test_postgresql_refuses_files_programs_and_admin_functions(
    pg_target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    for statement, code, needle, creates in _dangerous(pg_target):
        assert_refused(pg_target, capsys, statement, code, needle)
        assert creates is None or not creates.exists(), statement
    # The login may not take another role back either, alone or around a file read.
    for statement in (
        "SELECT set_config('role', 'postgres', true)",
        "SELECT set_config('role', 'postgres', true) AS r, pg_read_file('/etc/hostname') AS f",
        "SELECT set_config('role', 'postgres', true) AS r, "
        "query_to_xml('SELECT pg_read_file(''/etc/hostname'')', true, false, '') AS x",
    ):
        assert_refused(pg_target, capsys, statement, 2, "set_config(text,text,boolean)")


@pytest.mark.integration
def test_postgresql_large_objects_are_neither_created_nor_read(
    pg_target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    # lo_create is allowed in a read-only transaction (PostgreSQL 15): the calls layer refuses
    # it (test_readonly_calls.py shows the rollback would undo it on its own).
    count = "SELECT count(*) FROM pg_largeobject_metadata"
    with pg_target.admin.connect() as conn:
        before = conn.execute(text(count)).scalar_one()
    for statement, name in (
        ("SELECT lo_create(0) > 0 AS made", "lo_create(oid)"),
        ("SELECT lo_from_bytea(0, 'x') AS made", "lo_from_bytea(oid,bytea)"),
        ("SELECT lo_get(oid) FROM pg_largeobject_metadata", "lo_get(oid)"),
    ):
        assert_refused(pg_target, capsys, statement, 2, f"function {name} is volatile")
    with pg_target.admin.connect() as conn:
        assert conn.execute(text(count)).scalar_one() == before


@pytest.mark.integration
def test_postgresql_cannot_terminate_another_session(
    pg_target: Target, pg_admin_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Another session of the superuser, and one of the very login that runs the query.
    victims = [
        psycopg.connect(make_url(url).set(drivername="postgresql").render_as_string(False))
        for url in (pg_admin_url, pg_target.url)
    ]
    try:
        for victim in victims:
            pid = victim.info.backend_pid
            for statement in (
                f"SELECT pg_terminate_backend({pid})",
                f"SELECT pg_cancel_backend({pid})",
            ):
                assert_refused(pg_target, capsys, statement, 2, "is volatile")
            assert victim.execute("SELECT 1").fetchone() == (1,)
    finally:
        for victim in victims:
            victim.close()


@pytest.mark.integration
def test_postgresql_grammar_alone_refuses_what_is_not_one_select(
    pg_target: Target, pg_admin_url: str
) -> None:
    """Layer 2 on its own: the wrapped text, as the superuser in a writable transaction."""
    marker = pg_target.fresh_path("program-ran")
    escapes = [
        f"COPY (SELECT 1) TO PROGRAM 'touch {marker}'",
        f"DO $$ BEGIN EXECUTE 'COPY (SELECT 1) TO PROGRAM ''touch {marker}'''; END $$",
        f"SELECT 1) AS q; COPY (SELECT 1) TO PROGRAM 'touch {marker}'; SELECT * FROM (SELECT 1",
        "SELECT 1) AS q; DELETE FROM runs; --",
        "DELETE FROM runs RETURNING *",
        "WITH d AS (DELETE FROM runs RETURNING *) SELECT * FROM d",
        "SET ROLE postgres",
        "SELECT 1) AS q INTO evil FROM (SELECT 1",
    ]
    before = snapshot(pg_target)
    dsn = make_url(pg_admin_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(dsn) as conn:
        assert conn.execute(
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
        ).fetchone() == (True,)
        for escape in escapes:
            with pytest.raises(psycopg.Error), conn.transaction():
                conn.execute(wrap_as_select(escape), prepare=True)
    assert not marker.exists()
    assert snapshot(pg_target) == before


def test_timeout(target: Target, capsys: pytest.CaptureFixture[str]) -> None:
    # Counting, not pg_sleep: the calls layer refuses pg_sleep (volatile) before it runs.
    count = (
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000000000) "
        "SELECT count(*) FROM n"
    )
    started = time.monotonic()
    code, out, err = sql(target.url, capsys, count, "--timeout", "0.5")
    assert time.monotonic() - started < 3
    assert (code, out) == (3, "")
    assert_one_line_error(err, "timed out after 0.5 s", "--timeout")


# -- who may run queries on PostgreSQL --------------------------------------------------------


@pytest.mark.integration
def test_postgresql_superuser_is_refused_without_the_flag(
    pg_target: Target, pg_admin_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = sql(pg_admin_url, capsys, "SELECT count(*) FROM runs")
    assert (code, out) == (2, "")
    assert_one_line_error(err, "superuser", "--allow-superuser", f"member of {READER_ROLE}")


@pytest.mark.integration
def test_postgresql_superuser_with_the_flag_still_cannot_escape(
    pg_target: Target,
    pg_admin_url: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    superuser = Target(pg_target.dialect, pg_admin_url, pg_target.admin, pg_target.scratch)
    with caplog.at_level(logging.WARNING):
        code, out, err = sql(
            pg_admin_url,
            capsys,
            "SELECT current_user AS u, count(*) AS n FROM runs",
            "--allow-superuser",
            "--format",
            "csv",
        )
    assert (code, err) == (0, "")
    assert out.splitlines() == ["u,n", f"{READER_ROLE},2"]
    assert "--allow-superuser" in caplog.text
    for statement, code, needle, creates in _dangerous(superuser):
        assert_refused(superuser, capsys, statement, code, needle, "--allow-superuser")
        assert creates is None or not creates.exists(), statement
    for statement in BOTH_REFUSED_KIND[:4]:
        assert_refused(superuser, capsys, statement, 2, ACCEPTED, "--allow-superuser")


@pytest.mark.integration
def test_postgresql_login_outside_the_role_is_told_the_grant(
    pg_admin_url: str, make_login: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    login, url = make_login(pg_admin_url, reader=False)
    code, out, err = sql(url, capsys, "SELECT 1")
    assert (code, out) == (2, "")
    assert_one_line_error(err, f"GRANT {READER_ROLE} TO {login};")
    with pytest.raises(ConfigError, match=f"not a member of {READER_ROLE}"):
        run_readonly(url, "SELECT 1")


# -- migration 0004 ---------------------------------------------------------------------------

_PRIVILEGES = """
SELECT has_schema_privilege(:role, current_schema(), 'USAGE'),
       bool_and(has_table_privilege(:role, quote_ident(current_schema()) || '.' || rel, 'SELECT')),
       bool_or(has_table_privilege(:role, quote_ident(current_schema()) || '.' || rel,
                                   'INSERT, UPDATE, DELETE, TRUNCATE'))
FROM unnest(CAST(:relations AS text[])) AS rel
"""


def _reader_privileges(engine: Engine) -> tuple[bool, bool, bool]:
    with engine.connect() as conn:
        row = conn.execute(
            text(_PRIVILEGES), {"role": READER_ROLE, "relations": list(RELATIONS)}
        ).one()
    return row[0], row[1], row[2]


@pytest.mark.integration
def test_postgresql_migration_grants_select_and_downgrade_revokes_it(
    pg_schema_url: str,
) -> None:
    database = Database(pg_schema_url)
    try:
        assert _reader_privileges(database.engine) == (True, True, False)
        with database.engine.begin() as conn:
            command.downgrade(_alembic_config(conn), "0003")
        assert _reader_privileges(database.engine) == (False, False, False)
        database.upgrade()
        assert _reader_privileges(database.engine) == (True, True, False)
    finally:
        database.close()


@pytest.mark.integration
def test_postgresql_migration_by_a_login_that_may_not_create_roles(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    owner = f"ckpt_owner_{secrets.token_hex(6)}"
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE ROLE {owner} LOGIN NOCREATEROLE"))
            conn.execute(text(f"CREATE SCHEMA {owner} AUTHORIZATION {owner}"))
        url = make_url(pg_url).set(username=owner, password=None)
        url = url.update_query_dict({"options": f"-csearch_path={owner}"})
        with caplog.at_level(logging.WARNING, logger="ckptstore.migrations"):
            database = Database(url.render_as_string(hide_password=False))
        try:
            # The role exists (cluster-wide); the owner of the tables grants on them.
            assert _reader_privileges(database.engine) == (True, True, False)
        finally:
            database.close()
        assert f"GRANT {READER_ROLE} TO {owner};" in caplog.text
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {owner} CASCADE"))
            conn.execute(text(f"DROP OWNED BY {owner}"))
            conn.execute(text(f"DROP ROLE IF EXISTS {owner}"))
        admin.dispose()


def test_odd_text_is_refused_on_one_line(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    # A string where a keyword belongs: named in the message, its newline escaped.
    assert_refused(target, capsys, "'a\nstring' AS s", 2, ACCEPTED)
    with pytest.raises(ConfigError, match="NUL"):
        run_readonly(target.url, "SELECT 1 -- \x00")


def test_error_messages_have_no_driver_noise(target: Target) -> None:
    with pytest.raises(DatabaseError) as caught:
        run_readonly(target.url, "SELECT no_such_column FROM runs")
    message = str(caught.value)
    assert "\n" not in message
    assert re.search(r"no_such_column|no such column", message)
    assert "ckptstore_query" not in message
