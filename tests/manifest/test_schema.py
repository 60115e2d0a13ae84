"""The manifest database schema and its migrations (DESIGN.md §6), on SQLite and PostgreSQL.

Real databases only: a SQLite file under the test's tmp dir, and a fresh PostgreSQL database
per test on ``$CKPTSTORE_TEST_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/
test``), dropped afterwards. An unreachable server skips the PostgreSQL cases, or fails them when
the variable is set.

Schema snapshots: ``schema_snapshots/<dialect>.json`` is the reflected schema at head. A missing
file is written and the test fails once (review and commit it); set
``CKPTSTORE_UPDATE_SCHEMA_SNAPSHOTS=1`` to rewrite them after adding a migration.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import secrets
import sqlite3
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import JSON, Engine, bindparam, create_engine, inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError as SQLIntegrityError
from sqlalchemy.exc import OperationalError

from ckptstore.cli.main import main as cli_main
from ckptstore.errors import ConfigError, SchemaError
from ckptstore.manifest.db import (
    SCHEMA_HEAD,
    Database,
    _alembic_config,
    head_revision,
    redact,
    resolve_url,
)
from ckptstore.manifest.models import Base

#: Every migration, oldest first. A new migration is appended here (and the snapshots rewritten).
REVISIONS = ("0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008")
HEAD = REVISIONS[-1]
PREVIOUS_HEAD = REVISIONS[-2]
FIRST = REVISIONS[0]

TABLES = {
    "runs",
    "checkpoints",
    "components",
    "blobs",
    "checkpoint_blobs",
    "blob_copies",
    "step_metrics",
    "gc_lease",
}
#: The tables revision 0001 made (every later one is gone after a downgrade to it).
FIRST_TABLES = TABLES - {"blob_copies", "step_metrics"}
VIEWS = {"checkpoint_summary", "run_summary"}

PG_ENV = "CKPTSTORE_TEST_PG_URL"
PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SNAPSHOTS = Path(__file__).parent / "schema_snapshots"
CLI = Path(sys.executable).parent / "ckptstore"


# -- databases --------------------------------------------------------------------------------


def _pg_driver_url(url: str) -> str:
    # Normalised here rather than with resolve_url, which is under test below.
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


@pytest.fixture(scope="module")
def pg_admin() -> Iterator[Engine]:
    """An autocommit engine on the PostgreSQL server's base database."""
    configured = os.environ.get(PG_ENV)
    url = _pg_driver_url(configured or PG_DEFAULT)
    engine = create_engine(url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except OperationalError as exc:
        engine.dispose()
        message = f"PostgreSQL at {redact(url)} is unreachable: {exc.orig}"
        if configured:
            pytest.fail(f"{PG_ENV} is set but {message}")
        pytest.skip(f"{message} (set {PG_ENV} to require it)")
    yield engine
    engine.dispose()


@pytest.fixture
def pg_database(pg_admin: Engine) -> Iterator[Callable[[], str]]:
    """Makes brand-new PostgreSQL databases; each is dropped (WITH (FORCE)) at teardown."""
    created: list[str] = []

    def make() -> str:
        name = f"ckpt_schema_{secrets.token_hex(6)}"
        with pg_admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        created.append(name)
        return pg_admin.url.set(database=name).render_as_string(hide_password=False)

    yield make
    with pg_admin.connect() as conn:
        for name in created:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def fresh_db(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], str]:
    """Makes URLs of brand-new, empty databases of the parametrized dialect."""
    if request.param == "postgresql":
        return request.getfixturevalue("pg_database")  # type: ignore[no-any-return]
    counter = iter(range(1_000))
    return lambda: f"sqlite:///{tmp_path / f'manifest-{next(counter)}.db'}"


@pytest.fixture
def opened() -> Iterator[Callable[..., Database]]:
    """``Database(...)`` whose engines are disposed at teardown."""
    databases: list[Database] = []

    def open_(url: str, **kwargs: Any) -> Database:
        database = Database(url, **kwargs)
        databases.append(database)
        return database

    yield open_
    for database in databases:
        database.close()


def migrate(url: str, revision: str) -> None:
    database = Database(url, check_schema=False)
    try:
        database.upgrade(revision)
    finally:
        database.close()


def refused(url: str) -> str:
    """Open ``url`` expecting SchemaError; its message."""
    try:
        database = Database(url)
    except SchemaError as exc:
        return str(exc)
    revision = database.current_revision()
    database.close()
    pytest.fail(f"Database({redact(url)}) opened the database at {revision}")


def table_and_view_names(conn: Connection) -> tuple[set[str], set[str]]:
    inspector = inspect(conn)
    return set(inspector.get_table_names()), set(inspector.get_view_names())


def versions(conn: Connection) -> list[str]:
    return [row[0] for row in conn.execute(text("SELECT version_num FROM alembic_version"))]


_metrics = bindparam("metrics", type_=JSON)


def insert_sample_data(conn: Connection) -> None:
    """A run (lower loss is better) with two committed checkpoints and a failed one."""
    conn.execute(
        text(
            "INSERT INTO runs (id, name, config, config_fingerprint, writer_epoch, metric_name, "
            "higher_is_better) VALUES (7, 'run-a', :config, 'f00d', 2, 'loss', :hib)"
        ).bindparams(bindparam("config", type_=JSON)),
        {"config": {"lr": 0.001}, "hib": False},
    )
    committed = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    conn.execute(
        text(
            'INSERT INTO checkpoints (id, run_id, step, status, writer_epoch, "trigger", '
            "committed_at, metrics, logical_bytes, stored_bytes, uploaded_bytes) "
            "VALUES (:id, 7, :step, :status, 2, 'period', :committed, :metrics, :logical, "
            ":stored, :stored)"
        ).bindparams(_metrics),
        [
            {"id": 1, "step": 100, "status": "committed", "committed": committed,
             "metrics": {"loss": 0.5}, "logical": 1000, "stored": 600},
            {"id": 2, "step": 200, "status": "committed", "committed": committed,
             "metrics": {"loss": 0.25}, "logical": 1000, "stored": 100},
            {"id": 3, "step": 300, "status": "failed", "committed": None,
             "metrics": {"loss": 0.1}, "logical": 0, "stored": 0},
        ],
    )  # fmt: skip
    conn.execute(
        text(
            "INSERT INTO blobs (digest, kind, logical_bytes, stored_bytes, codec, "
            "last_claimed_at, state) VALUES (:digest, 'chunk', 1000, :stored, 'zstd', :at, "
            "'live')"
        ),
        [{"digest": "b3:aa", "stored": 600, "at": committed},
         {"digest": "b3:bb", "stored": 100, "at": committed}],
    )  # fmt: skip
    conn.execute(
        text("INSERT INTO checkpoint_blobs (checkpoint_id, digest) VALUES (:c, :d)"),
        [{"c": 1, "d": "b3:aa"}, {"c": 2, "d": "b3:aa"}, {"c": 2, "d": "b3:bb"}],
    )
    conn.execute(
        text(
            "INSERT INTO components (checkpoint_id, name, kind, index_digest, logical_bytes, "
            "stored_bytes, entries) VALUES (:c, 'policy', 'state', :d, 1000, 600, 3)"
        ),
        [{"c": 1, "d": "b3:aa"}, {"c": 2, "d": "b3:bb"}],
    )


def check_sample_data(conn: Connection) -> None:
    runs = conn.execute(
        text("SELECT id, name, config_fingerprint, writer_epoch, metric_name FROM runs")
    ).all()
    assert [tuple(row) for row in runs] == [(7, "run-a", "f00d", 2, "loss")]
    checkpoints = conn.execute(
        text("SELECT id, run_id, step, status, logical_bytes FROM checkpoints ORDER BY id")
    ).all()
    assert [tuple(row) for row in checkpoints] == [
        (1, 7, 100, "committed", 1000),
        (2, 7, 200, "committed", 1000),
        (3, 7, 300, "failed", 0),
    ]
    assert conn.execute(text("SELECT COUNT(*) FROM checkpoint_blobs")).scalar() == 3


def check_views_see_sample_data(conn: Connection) -> None:
    rows = conn.execute(
        text(
            "SELECT checkpoint_id, run, step, status, components FROM checkpoint_summary "
            "ORDER BY checkpoint_id"
        )
    ).all()
    assert [tuple(row) for row in rows] == [
        (1, "run-a", 100, "committed", 1),
        (2, "run-a", 200, "committed", 1),
        (3, "run-a", 300, "failed", 0),
    ]
    summary = (
        conn.execute(
            text(
                "SELECT run_id, run, checkpoints, committed, failed, latest_step, metric_name, "
                "best_metric, logical_bytes, stored_bytes, dedup_ratio FROM run_summary"
            )
        )
        .mappings()
        .one()
    )
    assert dict(summary) == {
        "run_id": 7,
        "run": "run-a",
        "checkpoints": 3,
        "committed": 2,
        "failed": 1,
        "latest_step": 200,
        "metric_name": "loss",
        # Lower is better, and the failed checkpoint's 0.1 does not count.
        "best_metric": pytest.approx(0.25),
        "logical_bytes": 2000,
        # Blob b3:aa is shared by both committed checkpoints and counted once.
        "stored_bytes": 700,
        "dedup_ratio": pytest.approx(2000 / 700),
    }


def run_cli(*invocations: list[str], cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    """Run the ``ckptstore`` console script once per argument list, all at the same time.

    Concurrent because each start imports the whole package (torch included), seconds apiece.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTSTORE_DB", "CKPTSTORE_STORE")}
    procs = [
        subprocess.Popen(
            [str(CLI), *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in invocations
    ]
    results = []
    for args, proc in zip(invocations, procs, strict=True):
        out, err = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return results


# -- the migration scripts --------------------------------------------------------------------


def test_migrations_form_one_linear_history_ending_at_head() -> None:
    scripts = ScriptDirectory.from_config(_alembic_config())
    assert scripts.get_heads() == [HEAD], (
        "a new migration: append it to REVISIONS here and rewrite the schema snapshots"
    )
    assert head_revision() == HEAD
    # Opening a database compares with this constant (no Alembic import): bump it too.
    assert SCHEMA_HEAD == HEAD, "set ckptstore.manifest.db.SCHEMA_HEAD to the new head"
    chain = [rev.revision for rev in scripts.walk_revisions("base", "heads")]
    assert chain == list(reversed(REVISIONS))
    assert scripts.get_revision(HEAD).down_revision == PREVIOUS_HEAD


# -- 1. fresh create --------------------------------------------------------------------------


def test_fresh_database_is_created_at_head(
    fresh_db: Callable[[], str], opened: Callable[..., Database]
) -> None:
    url = fresh_db()
    database = opened(url)
    assert database.current_revision() == head_revision() == HEAD
    with database.engine.connect() as conn:
        tables, views = table_and_view_names(conn)
        assert tables == TABLES | {"alembic_version"}
        assert set(Base.metadata.tables) == TABLES
        assert views == VIEWS
        assert versions(conn) == [HEAD]
        for name in sorted(TABLES | VIEWS):
            assert conn.execute(text(f"SELECT COUNT(*) FROM {name}")).scalar() == 0, name
    # A second open of a database at head changes nothing.
    assert opened(url).current_revision() == HEAD


# -- 2. refused schemas -----------------------------------------------------------------------


def test_out_of_date_schema_is_refused(
    fresh_db: Callable[[], str], opened: Callable[..., Database]
) -> None:
    url = fresh_db()
    # Before 0003, whose change (a column) is visible on every dialect.
    older = "0002"
    migrate(url, older)
    message = refused(url)
    assert "ckptstore db upgrade" in message
    assert older in message
    assert HEAD in message
    # Refused, not migrated behind the user's back.
    database = opened(url, check_schema=False)
    assert database.current_revision() == older
    with database.engine.connect() as conn:
        columns = {c["name"] for c in inspect(conn).get_columns("blobs")}
    assert "condemned_at" not in columns  # the 0003 change was not applied


def test_newer_schema_is_refused(
    fresh_db: Callable[[], str], opened: Callable[..., Database]
) -> None:
    url = fresh_db()
    database = opened(url)
    with database.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    message = refused(url)
    assert "9999" in message
    assert "upgrade ckptstore" in message
    assert "ckptstore db upgrade" not in message
    assert database.current_revision() == "9999"


def test_foreign_database_is_refused_not_migrated(
    fresh_db: Callable[[], str], opened: Callable[..., Database]
) -> None:
    url = fresh_db()
    database = opened(url, check_schema=False)
    with database.engine.begin() as conn:
        conn.execute(text("CREATE TABLE experiments (id INTEGER PRIMARY KEY, note VARCHAR(20))"))
        conn.execute(text("INSERT INTO experiments VALUES (1, 'keep me')"))
    message = refused(url)
    assert "no ckptstore schema version" in message
    with database.engine.connect() as conn:
        assert table_and_view_names(conn) == ({"experiments"}, set())
        assert conn.execute(text("SELECT note FROM experiments")).scalar() == "keep me"


@pytest.mark.integration
def test_refused_open_leaves_no_connection_behind(pg_database: Callable[[], str]) -> None:
    """A refused Database() disposes its engine: no open psycopg connection is left to the GC."""
    url = pg_database()
    migrate(url, PREVIOUS_HEAD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(SchemaError):
            Database(url)
        gc.collect()
    leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaked == []


def test_cli_upgrade_of_newer_database_is_a_clean_error(
    fresh_db: Callable[[], str], opened: Callable[..., Database], capsys: pytest.CaptureFixture[str]
) -> None:
    url = fresh_db()
    with opened(url).engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    # A clean error (exit 3, "a database error"), not alembic's CommandError traceback.
    assert cli_main(["--db", url, "db", "upgrade"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("ckptstore: error: ")
    assert "9999" in err
    assert "upgrade ckptstore" in err
    assert opened(url, check_schema=False).current_revision() == "9999"


# -- 3. `ckptstore db upgrade` / `db current` through the console script ----------------------


def test_cli_db_upgrade_from_previous_head(
    fresh_db: Callable[[], str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, other = fresh_db(), fresh_db()
    migrate(url, PREVIOUS_HEAD)
    migrate(other, PREVIOUS_HEAD)
    out_of_date = {"current": PREVIOUS_HEAD, "head": HEAD, "state": "out of date"}
    database = Database(url, check_schema=False)
    try:
        with database.engine.begin() as conn:
            insert_sample_data(conn)

        # The real console script. Each start imports the whole package (seconds), so the exit
        # status of `db current` goes through it once, beside the upgrade, on SQLite only: the
        # status comes from main()'s return value whatever the dialect (checked in-process).
        invocations = [["--db", url, "db", "upgrade"]]
        if database.is_sqlite:
            invocations.append(["--db", other, "--json", "db", "current"])
        else:
            assert cli_main(["--db", other, "--json", "db", "current"]) == 1
            assert json.loads(capsys.readouterr().out) == {"db": redact(other), **out_of_date}
        upgrade, *current_old = run_cli(*invocations, cwd=tmp_path)
        assert upgrade.returncode == 0, upgrade.stderr
        assert upgrade.stdout == f"{redact(url)}: {PREVIOUS_HEAD} -> {HEAD}\n"
        for result in current_old:
            assert result.returncode == 1, result.stderr
            assert json.loads(result.stdout) == {"db": redact(other), **out_of_date}

        assert database.current_revision() == HEAD
        with database.engine.connect() as conn:
            assert versions(conn) == [HEAD]
            check_sample_data(conn)
            check_views_see_sample_data(conn)
    finally:
        database.close()

    assert cli_main(["--db", url, "--json", "db", "current"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "db": redact(url),
        "current": HEAD,
        "head": HEAD,
        "state": "up to date",
    }
    assert cli_main(["--db", url, "db", "current"]) == 0
    assert capsys.readouterr().out == f"{redact(url)}: revision {HEAD} (head {HEAD}, up to date)\n"
    assert cli_main(["--db", other, "db", "current"]) == 1
    assert capsys.readouterr().out == (
        f"{redact(other)}: revision {PREVIOUS_HEAD} "
        f"(head {HEAD}, out of date; run `ckptstore db upgrade`)\n"
    )
    assert cli_main(["--db", url, "db", "upgrade"]) == 0
    assert capsys.readouterr().out == f"{redact(url)}: already at {HEAD}\n"


# -- 4. schema snapshot per dialect, and migrations == models ---------------------------------


def dump_schema(conn: Connection) -> dict[str, Any]:
    """The reflected schema as plain, deterministically ordered data."""
    inspector = inspect(conn)
    tables: dict[str, Any] = {}
    for name in sorted(inspector.get_table_names()):
        pk = inspector.get_pk_constraint(name)
        indexes = []
        for ix in inspector.get_indexes(name):
            entry = {
                "name": ix["name"],
                "columns": ix["column_names"],
                "unique": bool(ix["unique"]),
            }
            if ix.get("expressions"):
                entry["expressions"] = ix["expressions"]
            if "duplicates_constraint" in ix:
                entry["duplicates_constraint"] = ix["duplicates_constraint"]
            indexes.append(entry)
        tables[name] = {
            "columns": [
                {
                    "name": col["name"],
                    # Compiled for the dialect: str() alone says TIMESTAMP for timestamptz.
                    "type": col["type"].compile(dialect=conn.dialect),
                    "nullable": col["nullable"],
                    "default": None if col.get("default") is None else str(col["default"]),
                }
                for col in inspector.get_columns(name)
            ],
            "primary_key": {"name": pk.get("name"), "columns": pk["constrained_columns"]},
            "foreign_keys": sorted(
                (
                    {
                        "name": fk["name"],
                        "columns": fk["constrained_columns"],
                        "referred_table": fk["referred_table"],
                        "referred_columns": fk["referred_columns"],
                        "ondelete": fk.get("options", {}).get("ondelete"),
                        "onupdate": fk.get("options", {}).get("onupdate"),
                    }
                    for fk in inspector.get_foreign_keys(name)
                ),
                key=lambda fk: (str(fk["name"]), fk["columns"]),
            ),
            "unique_constraints": sorted(
                (
                    {"name": uq["name"], "columns": uq["column_names"]}
                    for uq in inspector.get_unique_constraints(name)
                ),
                key=lambda uq: (str(uq["name"]), uq["columns"]),
            ),
            "check_constraints": sorted(
                (
                    {"name": ck["name"], "sqltext": " ".join(ck["sqltext"].split())}
                    for ck in inspector.get_check_constraints(name)
                ),
                key=lambda ck: (str(ck["name"]), ck["sqltext"]),
            ),
            "indexes": sorted(indexes, key=lambda ix: (str(ix["name"]), ix["columns"])),
        }
    views = {
        name: [col["name"] for col in inspector.get_columns(name)]
        for name in sorted(inspector.get_view_names())
    }
    return {
        "dialect": conn.dialect.name,
        "revision": HEAD,
        "tables": tables,
        "views": views,
        "without_rowid": without_rowid(conn),
    }


def without_rowid(conn: Connection) -> list[str]:
    """SQLite: the tables stored in their primary key's order (WITHOUT ROWID)."""
    if conn.dialect.name != "sqlite":
        return []
    listed = conn.exec_driver_sql("PRAGMA main.table_list").all()
    return sorted(name for _, name, kind, _, wr, _ in listed if kind == "table" and wr)


def test_schema_matches_snapshot(
    fresh_db: Callable[[], str], opened: Callable[..., Database]
) -> None:
    database = opened(fresh_db())
    with database.engine.connect() as conn:
        schema = dump_schema(conn)
    assert set(schema["views"]) == VIEWS
    assert set(schema["tables"]) == TABLES | {"alembic_version"}

    path = SNAPSHOTS / f"{database.dialect}.json"
    rendered = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    if not path.exists() or os.environ.get("CKPTSTORE_UPDATE_SCHEMA_SNAPSHOTS") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rendered)
        pytest.fail(f"schema snapshot {path} was created; review it, commit it and re-run")
    expected = json.loads(path.read_text())
    assert schema == expected, (
        f"the migrated schema differs from {path}; if the change is intended, rewrite it with "
        "CKPTSTORE_UPDATE_SCHEMA_SNAPSHOTS=1"
    )


def test_migrations_match_models(
    fresh_db: Callable[[], str], opened: Callable[..., Database]
) -> None:
    database = opened(fresh_db())
    with database.engine.connect() as conn:
        # compare_type is on (alembic's default). No view noise to filter: autogenerate
        # reflects get_table_names(), which leaves views out, and skips alembic_version.
        # Server defaults are not compared (alembic's default): models say func.now(), the
        # migration says CURRENT_TIMESTAMP, which PostgreSQL reports as a (harmless) textual
        # difference.
        diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diffs == []


# -- 5. concurrent first use ------------------------------------------------------------------

_FIRST_USE = r"""
import importlib.util, logging, sys
# The package without its __init__, which imports torch: seconds per process on a small
# machine, and nothing to do with the database. Database, the models and migrations are real.
sys.modules["ckptstore"] = importlib.util.module_from_spec(importlib.util.find_spec("ckptstore"))
from ckptstore.manifest.db import Database
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
print("ready", flush=True)
sys.stdin.readline()  # all start together, after the import
database = Database(sys.argv[1])
print(database.current_revision(), flush=True)
database.close()
"""


def test_concurrent_first_use_creates_schema_once(tmp_path: Path) -> None:
    path = tmp_path / "shared" / "manifest.db"
    path.parent.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _FIRST_USE, str(path)],
            cwd=tmp_path,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = []
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ready\n", proc.communicate(timeout=60)[1]
        assert not path.exists()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            assert out.strip() == HEAD
            outputs.append(err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    logs = "\n".join(outputs)
    for before, after in zip(("", *REVISIONS), REVISIONS, strict=False):
        assert logs.count(f"Running upgrade {before} -> {after}") == 1, logs

    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD,)]
        names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        assert names >= TABLES | VIEWS
    finally:
        conn.close()


def test_first_open_waits_out_a_writer_on_a_brand_new_file(
    tmp_path: Path, opened: Callable[..., Database]
) -> None:
    # The race behind a 4-process first use failing now and then with "database is locked":
    # switching a new file to WAL upgrades a read lock, where SQLite skips its busy handler.
    path = tmp_path / "manifest.db"
    # Another process half-way through creating the file: it holds the write lock briefly.
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        holder.execute("BEGIN IMMEDIATE")
        release = threading.Timer(0.5, holder.execute, ["ROLLBACK"])
        release.start()
        try:
            started = time.monotonic()
            database = opened(path)
        finally:
            release.join()
    finally:
        holder.close()
    assert time.monotonic() - started >= 0.4  # it waited for the writer
    assert database.current_revision() == HEAD


# -- 6. downgrade ------------------------------------------------------------------------------


def test_downgrade_to_base_and_upgrade_again(
    fresh_db: Callable[[], str], opened: Callable[..., Database]
) -> None:
    database = opened(fresh_db())
    with database.engine.begin() as conn:
        before = dump_schema(conn)
        insert_sample_data(conn)

    with database.engine.begin() as conn:
        command.downgrade(_alembic_config(conn), FIRST)
    assert database.current_revision() == FIRST
    with database.engine.connect() as conn:
        assert table_and_view_names(conn) == (FIRST_TABLES | {"alembic_version"}, set())
        check_sample_data(conn)

    with database.engine.begin() as conn:
        conn.execute(text("DELETE FROM runs"))  # cascades to checkpoints and their rows
        conn.execute(text("DELETE FROM blobs"))
        command.downgrade(_alembic_config(conn), "base")
    assert database.current_revision() is None
    with database.engine.connect() as conn:
        assert table_and_view_names(conn) == ({"alembic_version"}, set())

    with database.engine.begin() as conn:
        command.upgrade(_alembic_config(conn), "head")
    assert database.current_revision() == HEAD
    with database.engine.connect() as conn:
        assert dump_schema(conn) == before
    assert opened(database.url).current_revision() == HEAD


# -- 7. SQLite settings -----------------------------------------------------------------------


def test_sqlite_connection_settings(tmp_path: Path, opened: Callable[..., Database]) -> None:
    path = tmp_path / "manifest.db"
    database = opened(path)
    with database.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() > 0
    with pytest.raises(SQLIntegrityError), database.engine.begin() as conn:
        conn.execute(
            text(
                'INSERT INTO checkpoints (run_id, step, status, writer_epoch, "trigger") '
                "VALUES (404, 1, 'pending', 0, 'manual')"
            )
        )

    def probe(session: Any) -> str | None:
        # Writes begin IMMEDIATE: after only a read, another writer is already locked out.
        session.execute(text("SELECT COUNT(*) FROM runs"))
        other = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            return str(exc)
        else:
            other.execute("ROLLBACK")
            return None
        finally:
            other.close()

    assert database.write(probe) == "database is locked"
    # WAL is a property of the file: a plain connection sees it too.
    plain = sqlite3.connect(path)
    try:
        assert plain.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        plain.close()


# -- 8. URLs ----------------------------------------------------------------------------------


def test_resolve_url_turns_paths_into_absolute_sqlite_urls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_url("sub/dir/m.db") == f"sqlite:///{tmp_path}/sub/dir/m.db"
    assert (tmp_path / "sub" / "dir").is_dir()
    assert resolve_url(str(tmp_path / "abs.db")) == f"sqlite:///{tmp_path}/abs.db"
    assert resolve_url(None) == f"sqlite:///{tmp_path}/.ckptstore/manifest.db"
    monkeypatch.setenv("CKPTSTORE_DB", str(tmp_path / "env.db"))
    assert resolve_url(None) == f"sqlite:///{tmp_path}/env.db"
    # An explicit empty value is a mistake, not a request for the default.
    with pytest.raises(ConfigError, match="empty string"):
        resolve_url("  ")
    # A reader's URL touches nothing: a missing file is an error, no directory is made.
    with pytest.raises(ConfigError, match="no manifest database"):
        resolve_url("other/m.db", create=False)
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgres://u:pw@db.example:5433/ckpt", "postgresql+psycopg://u:pw@db.example:5433/ckpt"),
        ("postgresql://u@db.example/ckpt", "postgresql+psycopg://u@db.example/ckpt"),
        ("postgresql+psycopg://u@db.example/ckpt", "postgresql+psycopg://u@db.example/ckpt"),
    ],
)
def test_resolve_url_uses_psycopg_3_for_postgresql(given: str, expected: str) -> None:
    assert resolve_url(given) == expected


@pytest.mark.parametrize("url", ["mysql://u@db.example/ckpt", "mysql+pymysql://u@h/ckpt"])
def test_resolve_url_refuses_other_databases(url: str) -> None:
    with pytest.raises(ConfigError, match="unsupported database 'mysql'"):
        resolve_url(url)


def test_redact_hides_the_password() -> None:
    shown = redact("postgresql+psycopg://ckpt:s3cr3t-pw@db.example:5432/ckpt")
    assert "s3cr3t-pw" not in shown
    assert shown == "postgresql+psycopg://ckpt:***@db.example:5432/ckpt"
    database = Database("postgresql://ckpt:s3cr3t@h/db", check_schema=False)  # connects lazily
    try:
        assert "s3cr3t" not in repr(database)
    finally:
        database.close()


# -- 7. revision 0007: tiers ------------------------------------------------------------------


def test_revision_0007_keeps_every_row_in_the_store_and_refuses_to_lose_a_local_checkpoint(
    fresh_db: Callable[[], str], opened: Callable[..., Database]
) -> None:
    url = fresh_db()
    migrate(url, "0006")
    database = opened(url, check_schema=False)
    with database.engine.begin() as conn:
        insert_sample_data(conn)
    migrate(url, "0007")
    with database.engine.begin() as conn:
        # Every blob row older than tiers is in the store; a local checkpoint and a local
        # trigger can be recorded now, with a copy of a blob on a node.
        assert conn.execute(text("SELECT COUNT(*) FROM blobs WHERE in_store")).scalar() == 2
        conn.execute(
            text(
                'INSERT INTO checkpoints (id, run_id, step, status, writer_epoch, "trigger") '
                "VALUES (4, 7, 400, 'local', 2, 'local')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO blobs (digest, kind, logical_bytes, stored_bytes, last_claimed_at, "
                "state, in_store) VALUES ('b3:cc', 'chunk', 10, 10, :at, 'live', :no)"
            ),
            {"at": dt.datetime.now(dt.UTC), "no": False},
        )
        conn.execute(
            text("INSERT INTO blob_copies (digest, node, created_at) VALUES ('b3:cc', 'n1', :at)"),
            {"at": dt.datetime.now(dt.UTC)},
        )
        # Still checked: no other status gets in.
        with pytest.raises(SQLIntegrityError), conn.begin_nested():
            conn.execute(text("UPDATE checkpoints SET status = 'lost' WHERE id = 4"))
    with pytest.raises(RuntimeError, match=r"1 checkpoint.*local-durable only; drain them"):
        migrate_down(url, "0006")
    with database.engine.begin() as conn:
        conn.execute(text("UPDATE checkpoints SET status = 'deleted' WHERE id = 4"))
    migrate_down(url, "0006")
    with database.engine.begin() as conn:
        # The blob the store may not hold is condemned (an older writer checks the store before
        # it trusts a condemned row); the local trigger became a manual one.
        state = conn.execute(text("SELECT state FROM blobs WHERE digest = 'b3:cc'")).scalar()
        assert state == "condemned"
        trigger = conn.execute(text('SELECT "trigger" FROM checkpoints WHERE id = 4')).scalar()
        assert trigger == "manual"
        statuses = conn.execute(text("SELECT id, status FROM checkpoints ORDER BY id")).all()
        assert [tuple(r) for r in statuses] == [
            (1, "committed"),
            (2, "committed"),
            (3, "failed"),
            (4, "deleted"),
        ]
        with pytest.raises(SQLIntegrityError), conn.begin_nested():
            conn.execute(text("UPDATE checkpoints SET status = 'local' WHERE id = 4"))


def migrate_down(url: str, revision: str) -> None:
    database = Database(url, check_schema=False)
    try:
        with database.engine.begin() as conn:
            command.downgrade(_alembic_config(conn), revision)
    finally:
        database.close()
