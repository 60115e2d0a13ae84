"""The calls layer of `ckptstore sql` (PostgreSQL): what may take locks, sleep, signal or change
state is refused before the query runs, however it is spelled or wherever it sits in the query,
so a reader never stalls a writer; and the layers below it hold on their own.

Every refusal is checked through the CLI as the module's reader login (exit 2, one line naming the
function, nothing changed); the targets and fixtures are in readonly_targets.py and conftest.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from readonly_targets import Target, assert_refused, schema_of
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from ckptstore.cli import main
from ckptstore.manifest._orm.runs import GC_LOCK_TABLE, hold_gc_lock_exclusive
from ckptstore.manifest.readonly import READER_ROLE
from ckptstore.manifest.readonly.pg_calls import UsedObject, object_ids, refusal

pytestmark = pytest.mark.integration

LOCK = "function pg_advisory_lock(bigint) is volatile"

# -- every family, as the reader login --------------------------------------------------------


@pytest.mark.parametrize(
    ("statement", "needle"),
    [
        # advisory locks, session and transaction level, waiting or not, and their release
        ("SELECT pg_advisory_lock(1)", LOCK),
        ("SELECT pg_advisory_lock(1, 2)", "pg_advisory_lock(integer,integer) is volatile"),
        ("SELECT pg_advisory_lock_shared(1)", "pg_advisory_lock_shared(bigint)"),
        ("SELECT pg_advisory_xact_lock(1)", "pg_advisory_xact_lock(bigint)"),
        ("SELECT pg_advisory_xact_lock_shared(1)", "pg_advisory_xact_lock_shared(bigint)"),
        ("SELECT pg_try_advisory_lock(1)", "pg_try_advisory_lock(bigint)"),
        ("SELECT pg_try_advisory_lock_shared(1)", "pg_try_advisory_lock_shared(bigint)"),
        ("SELECT pg_try_advisory_xact_lock(1)", "pg_try_advisory_xact_lock(bigint)"),
        ("SELECT pg_try_advisory_xact_lock_shared(1)", "pg_try_advisory_xact_lock_shared"),
        ("SELECT pg_advisory_unlock_all()", "pg_advisory_unlock_all()"),
        # sleeping (while holding a snapshot and whatever it has read)
        ("SELECT pg_sleep(0)", "pg_sleep(double precision) is volatile"),
        ("SELECT pg_sleep_for('0 s')", "pg_sleep_for(interval)"),
        ("SELECT pg_sleep_until(now())", "pg_sleep_until(timestamp with time zone)"),
        # large objects, notifications, signals, settings, sequences
        ("SELECT lo_create(0)", "lo_create(oid)"),
        ("SELECT lo_unlink(1)", "lo_unlink(oid)"),
        ("SELECT lo_export(1, '/tmp/ckpt-lo-export')", "lo_export(oid,text)"),
        ("SELECT pg_notify('ckptstore', 'hello')", "pg_notify(text,text)"),
        ("SELECT pg_cancel_backend(pg_backend_pid())", "pg_cancel_backend(integer)"),
        ("SELECT pg_terminate_backend(pg_backend_pid())", "pg_terminate_backend(integer,bigint)"),
        ("SELECT set_config('statement_timeout', '0', false)", "set_config(text,text,boolean)"),
        ("SELECT setval('runs_id_seq', 1)", "setval(regclass,bigint)"),
        ("SELECT currval('runs_id_seq')", "currval(regclass)"),
        # files
        ("SELECT pg_read_binary_file('/etc/hostname')", "pg_read_binary_file(text)"),
        ("SELECT pg_stat_file('/etc/hostname')", "pg_stat_file(text)"),
        # queries that run queries of their own
        ("SELECT query_to_xml('SELECT pg_advisory_lock(1)', true, false, '')", "query_to_xml"),
        ("SELECT table_to_xml('runs', true, false, '')", "table_to_xml(regclass,boolean"),
        ("SELECT schema_to_xml(current_schema(), true, false, '')", "runs queries of its own"),
        # spellings: quoted, schema-qualified, upper case, Unicode escapes
        ('SELECT "pg_catalog"."pg_advisory_lock"(1)', LOCK),
        ("SELECT PG_CATALOG.PG_ADVISORY_LOCK(1)", LOCK),
        ('SELECT U&"pg\\005Fadvisory\\005Flock"(1)', LOCK),
        ("SELECT pg_advisory_lock(CAST('1' AS bigint))", LOCK),
        # places: FROM, ROWS FROM, WHERE, ORDER BY, CTE, subquery, LATERAL, aggregate argument,
        # VALUES, EXPLAIN, a path never executed, text that closes the wrapping parenthesis
        ("SELECT * FROM pg_sleep(0)", "pg_sleep(double precision)"),
        ("SELECT * FROM ROWS FROM (pg_sleep(0)) AS s", "pg_sleep(double precision)"),
        ("SELECT id FROM runs WHERE pg_try_advisory_lock(id)", "pg_try_advisory_lock(bigint)"),
        ("SELECT id FROM runs ORDER BY pg_try_advisory_lock(id)", "pg_try_advisory_lock"),
        ("WITH l AS (SELECT pg_advisory_lock(1) AS l) SELECT 1 FROM l", LOCK),
        ("SELECT (SELECT pg_advisory_lock(1) LIMIT 1)", LOCK),
        ("SELECT * FROM runs, LATERAL (SELECT pg_advisory_xact_lock(runs.id)) AS l", "xact_lock"),
        ("SELECT count(pg_advisory_lock(id)) FROM runs", LOCK),
        ("VALUES (pg_advisory_lock(1))", LOCK),
        ("EXPLAIN SELECT pg_advisory_lock(1)", LOCK),
        ("SELECT CASE WHEN false THEN pg_advisory_lock(1) END", LOCK),
        ("SELECT 1 AS x) AS q, pg_sleep(0) AS s, (SELECT 1", "pg_sleep(double precision)"),
    ],
)
def test_postgresql_refuses_what_locks_sleeps_signals_or_changes_state(
    pg_target: Target, capsys: pytest.CaptureFixture[str], statement: str, needle: str
) -> None:
    assert_refused(pg_target, capsys, statement, 2, needle)


@pytest.fixture
def writer(pg_admin_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A session of the manifest's owner, as a ckptstore writer would hold one."""
    dsn = make_url(pg_admin_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def gc_engine(pg_admin_url: str) -> Iterator[Engine]:
    """The manifest owner's engine, for GC's own lock call."""
    engine = create_engine(pg_admin_url)
    yield engine
    engine.dispose()


def test_postgresql_a_reader_never_holds_the_gc_lock_a_writer_needs(
    pg_target: Target, gc_engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reported stall: a reader took an advisory lock and slept on it. `ckptstore sql`
    refuses the call, and while the reader's query is being handled GC's exclusive lock is
    free every time it is tried."""
    outcome: dict[str, int] = {}
    query = "SELECT pg_advisory_lock(1) AS l, pg_sleep(2) AS s"

    def read() -> None:
        outcome["code"] = main(["--db", pg_target.url, "sql", query, "--timeout", "5"])

    reader = threading.Thread(target=read)
    reader.start()
    attempts: list[bool] = []
    while reader.is_alive() or not attempts:
        attempts.append(_gc_lock_free(gc_engine))
        time.sleep(0.01)
    reader.join()
    assert outcome["code"] == 2
    assert all(attempts), attempts
    assert "pg_advisory_lock(bigint) is volatile" in capsys.readouterr().err


def _gc_lock_free(engine: Engine) -> bool:
    """Whether GC's exclusive lock (the library's own call) is had within 50 ms."""
    with Session(engine) as session:
        session.execute(text("SET LOCAL lock_timeout = '50ms'"))
        try:
            hold_gc_lock_exclusive(session)
        except OperationalError as exc:
            if isinstance(exc.orig, psycopg.errors.LockNotAvailable):
                return False
            raise
        finally:
            session.rollback()
    return True


def test_postgresql_a_reader_login_outside_ckptstore_sql_cannot_hold_off_gc_or_commits(
    pg_target: Target, gc_engine: Engine
) -> None:
    """By construction, not by the query check alone: the reader login, connected directly,
    holds every advisory lock it likes and reads every table in an open transaction, and GC's
    lock is still free; the lock modes that would conflict with GC's or the commits' need
    privileges the role lacks."""
    dsn = make_url(pg_target.url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(dsn) as reader:
        reader.execute("SELECT pg_advisory_lock(k) FROM generate_series(0, 64) AS k")
        reader.execute("SELECT pg_advisory_lock(x'636B7067'::bigint)")  # the old GC key
        for table in ("runs", "checkpoints", "blobs", "checkpoint_blobs", GC_LOCK_TABLE):
            reader.execute(f"SELECT * FROM {table}").fetchall()
        assert _gc_lock_free(gc_engine)
        reader.rollback()
        for statement in (
            f"LOCK TABLE {GC_LOCK_TABLE} IN ROW SHARE MODE",
            f"LOCK TABLE {GC_LOCK_TABLE} IN ACCESS EXCLUSIVE MODE",
            f"SELECT * FROM {GC_LOCK_TABLE} FOR SHARE",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                reader.execute(statement)
            reader.rollback()


@pytest.fixture
def user_objects(pg_admin_url: str) -> Iterator[None]:
    """Objects a database may hold beside the manifest, each one a way to pg_advisory_lock: a
    function that claims to be stable, an operator over one, a view and a domain that call it.
    The reader may use each of them (EXECUTE is PUBLIC's, the view is granted to it)."""
    statements = [
        "CREATE FUNCTION sneaky(a int DEFAULT 1, b int DEFAULT 1) RETURNS int STABLE "
        "LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_advisory_lock(1); RETURN a + b; END $$",
        "CREATE OPERATOR ### (LEFTARG = int, RIGHTARG = int, FUNCTION = sneaky)",
        "CREATE VIEW locking AS SELECT pg_try_advisory_lock(1) AS l",
        f"GRANT SELECT ON locking TO {READER_ROLE}",
        "CREATE DOMAIN locked_int AS int CHECK (sneaky(VALUE, 0) > 0)",
    ]
    admin = create_engine(pg_admin_url)
    try:
        with admin.begin() as conn:
            for statement in statements:
                conn.execute(text(statement))
        yield
        with admin.begin() as conn:
            conn.execute(text("DROP DOMAIN locked_int"))
            conn.execute(text("DROP VIEW locking"))
            conn.execute(text("DROP FUNCTION sneaky CASCADE"))
    finally:
        admin.dispose()


@pytest.mark.usefixtures("user_objects")
@pytest.mark.parametrize(
    ("statement", "needle"),
    [
        ("SELECT sneaky()", "function sneaky(integer,integer) is not built into PostgreSQL"),
        (
            "SELECT 1 ### 2",
            "sneaky(integer,integer) (behind operator ###(integer,integer)) is not built",
        ),
        ("SELECT * FROM locking", "view locking is not one of ckptstore's tables and views"),
        ("SELECT CAST(1 AS locked_int)", "type locked_int is not built in"),
    ],
)
def test_postgresql_refuses_functions_views_and_types_that_are_not_built_in(
    pg_target: Target,
    writer: psycopg.Connection[Any],
    capsys: pytest.CaptureFixture[str],
    statement: str,
    needle: str,
) -> None:
    assert_refused(pg_target, capsys, statement, 2, needle)
    assert writer.execute("SELECT pg_try_advisory_lock(1)").fetchone() == (True,)
    writer.execute("SELECT pg_advisory_unlock_all()")


def test_postgresql_refuses_an_extensions_functions(
    pg_target: Target, pg_admin_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """dblink could open a second, writable session: an extension's function is not built in."""
    admin = create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            if (
                conn.execute(
                    text("SELECT 1 FROM pg_available_extensions WHERE name = 'dblink'")
                ).first()
                is None
            ):
                pytest.skip("the dblink extension is not installed on this server")
            conn.execute(text(f'CREATE EXTENSION dblink SCHEMA "{schema_of(pg_admin_url)}"'))
        try:
            assert_refused(
                pg_target,
                capsys,
                "SELECT dblink_connect('dbname=postgres')",
                2,
                "function dblink_connect(text) is not built into PostgreSQL",
            )
        finally:
            with admin.connect() as conn:
                conn.execute(text("DROP EXTENSION dblink"))
    finally:
        admin.dispose()


def test_postgresql_reader_without_temporary_views_is_told_the_grant(
    pg_target: Target, pg_admin_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    admin = create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    database = make_url(pg_admin_url).database
    try:
        with admin.connect() as conn:
            conn.execute(text(f'REVOKE TEMPORARY ON DATABASE "{database}" FROM PUBLIC'))
        try:
            assert_refused(
                pg_target,
                capsys,
                "SELECT 1",
                2,
                f"GRANT TEMPORARY ON DATABASE {database} TO {READER_ROLE};",
            )
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'GRANT TEMPORARY ON DATABASE "{database}" TO PUBLIC'))
    finally:
        admin.dispose()


# -- the layers below, each on its own --------------------------------------------------------


def test_postgresql_privileges_and_the_read_only_transaction_alone(
    pg_target: Target, writer: psycopg.Connection[Any]
) -> None:
    """Without the calls layer (the query sent as is): ckptstore_reader's privileges still
    refuse files, admin functions, other roles and row locks, and what a read-only
    transaction allows (lo_create) is rolled back."""
    dsn = make_url(pg_target.url).set(drivername="postgresql").render_as_string(False)
    other = writer.info.backend_pid
    count = "SELECT count(*) FROM pg_largeobject_metadata"
    before = writer.execute(count).fetchone()
    refused = (psycopg.errors.InsufficientPrivilege, psycopg.errors.ReadOnlySqlTransaction)
    with psycopg.connect(dsn) as conn:
        conn.read_only = True
        for statement in (
            "SELECT pg_read_file('/etc/hostname')",
            "SELECT * FROM pg_ls_dir('.')",
            "SELECT pg_stat_reset()",
            "SELECT lo_import('/etc/hostname')",
            "SELECT set_config('role', 'postgres', true)",
            f"SELECT pg_terminate_backend({other})",
            "SELECT * FROM runs FOR KEY SHARE",
        ):
            with conn.transaction(force_rollback=True):
                conn.execute(f"SET LOCAL ROLE {READER_ROLE}")
                with pytest.raises(refused), conn.transaction():
                    conn.execute(statement, prepare=True)
        with conn.transaction(force_rollback=True):
            conn.execute(f"SET LOCAL ROLE {READER_ROLE}")
            assert conn.execute("SELECT lo_create(0) > 0").fetchone() == (True,)
    assert writer.execute(count).fetchone() == before
    assert writer.execute("SELECT 1").fetchone() == (1,)


# -- reading the parse tree -------------------------------------------------------------------


def test_object_ids_take_every_number_but_positions_lengths_and_column_numbers() -> None:
    tree = (
        "({QUERY :commandType 1 :rtable ({RANGETBLENTRY :relid 16714 :relkind v}) "
        ":targetList ({TARGETENTRY :expr {FUNCEXPR :funcid 2880 :args ({CONST :consttype 23 "
        ":consttypmod -1 :constlen 4 :location 108 :constvalue 4 [ 1 0 0 0 ]}) :location 91} "
        ":resno 7 :resname a\\ :funcid\\ 2886 :ressortgroupref 3} {TARGETENTRY :expr {VAR "
        ":varno 2 :varattno 900 :vartype 25} :resname \\(o\\ 2887\\)}) :coltypes (o 23 1043) "
        ":coltypmods (i 2882) :frameOptions 1058 :stmt_len 2886 :someFutureField 3400})"
    )
    assert object_ids(tree) == {1, 16714, 2880, 23, 25, 1043, 3400}


@pytest.mark.parametrize(
    ("used", "refused"),
    [
        (UsedObject("function", "function now()", "now", True, True, False), None),
        (UsedObject("function", "function random()", "random", True, True, True), None),
        (UsedObject("function", "function bthandler", "bthandler", True, False, True), None),
        (UsedObject("function", "function f()", "f", False, True, False), "is not built into"),
        (UsedObject("function", "function f()", "f", False, False, False), "is not built into"),
        (UsedObject("function", "function x", "table_to_xml", True, True, False), "runs queries"),
        (UsedObject("function", "function pg_sleep", "pg_sleep", True, True, True), "is volatile"),
        (UsedObject("relation", "table pg_class", "pg_class", True, False, False), None),
        (UsedObject("relation", "table runs", "runs", False, True, False), None),
        (UsedObject("relation", "view v", "v", False, False, False), "not one of ckptstore's"),
        (UsedObject("type", "type runs", "runs", False, True, False), None),
        (UsedObject("type", "type d", "d", False, False, False), "is not built in"),
    ],
)  # fmt: skip
def test_refusal_policy(used: UsedObject, refused: str | None) -> None:
    reason = refusal(used)
    assert (reason is None) == (refused is None)
    assert refused is None or (reason is not None and refused in reason)
