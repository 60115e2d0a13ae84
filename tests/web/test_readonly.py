"""The server's database cannot write, whatever a handler asks of it: SQLite connections are
``query_only`` with a reads-only authorizer, PostgreSQL connections run as ``ckptstore_reader``
in read-only transactions (a superuser login is refused unless allowed)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from ckptstore.checkpointer import open_run
from ckptstore.errors import ConfigError, DatabaseError
from ckptstore.manifest import reading as reads
from ckptstore.manifest import reporting as reports
from ckptstore.manifest._orm import checkpoints as queries
from ckptstore.manifest.readonly import READER_ROLE
from ckptstore.manifest.serving import open_readonly
from ckptstore.manifest.statuses import Status
from ckptstore.web import data
from ckptstore.web.comparison import compare_view
from ckptstore.web.data import Site
from ckptstore.web.routes import App, Request

WRITES = (
    "INSERT INTO runs (name, writer_epoch, higher_is_better) VALUES ('intruder', 0, TRUE)",
    "UPDATE checkpoints SET status = 'deleted'",
    "DELETE FROM blobs",
    "CREATE TABLE intruder (x INTEGER)",
    "DROP VIEW run_summary",
)
SQLITE_ONLY = ("PRAGMA journal_mode = DELETE", "PRAGMA query_only = OFF", "VACUUM")


def saved(db: str, store: Path) -> int:
    """Run ``r`` (two checkpoints) and ``fork`` (from ``r@2``); the id of ``r@1``."""
    with open_run("r", db=db, store=store, async_save=False) as run:
        first = run.save(1, {"m": torch.ones(4)}, metrics={"loss": 1.0}).wait().id
        run.save(2, {"m": torch.zeros(4)}, metrics={"loss": 0.5}).wait()
    with open_run("fork", db=db, store=store, fork_from="r@2", async_save=False) as run:
        run.save(3, {"m": torch.zeros(4)}, metrics={"loss": 0.25}).wait()
    return first


def run_all(engine: Engine, statements: tuple[str, ...]) -> None:
    """Run the statements in one transaction and commit it."""
    with engine.connect() as conn:
        for statement in statements:
            conn.exec_driver_sql(statement)
        conn.commit()


def refused(engine: Engine, *statements: str) -> None:
    """The statements, run in one transaction, fail."""
    with pytest.raises((DBAPIError, DatabaseError)):
        run_all(engine, statements)


def test_sqlite_reads_work_and_every_write_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    ident = saved(str(path), tmp_path / "store")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    db = open_readonly(str(path))
    try:
        assert reads.checkpoint(db, ident) is not None
        assert [s.run for s in reports.run_summaries(db)] == ["fork", "r"]
        for statement in (*WRITES, *SQLITE_ONLY):
            refused(db.engine, statement)
        attached = tmp_path / "attached.db"
        refused(db.engine, f"ATTACH DATABASE '{attached}' AS other")
        assert not attached.exists()
        # The ORM write path of the library itself fails too.
        with pytest.raises((DBAPIError, DatabaseError)):
            db.write(lambda s: queries.set_status(s, ident, Status.FAILED, "intruder"))
        after = reads.checkpoint(db, ident)
        assert after is not None
        assert after.status == Status.COMMITTED
    finally:
        db.close()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_a_missing_or_empty_database_is_not_created(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no manifest database"):
        open_readonly(str(tmp_path / "absent.db"))
    assert not (tmp_path / "absent.db").exists()
    (tmp_path / "empty.db").touch()
    with pytest.raises(ConfigError):
        open_readonly(str(tmp_path / "empty.db"))


@pytest.fixture
def pg_login(pg_schema_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(owner URL, a reader login's URL) of a migrated schema with one checkpoint."""
    saved(pg_schema_url, tmp_path / "store")
    name = f"ckpt_web_{secrets.token_hex(6)}"
    admin = create_engine(pg_schema_url, isolation_level="AUTOCOMMIT")
    schema = str(make_url(pg_schema_url).query["options"]).removeprefix("-csearch_path=")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE ROLE {name} LOGIN"))
        conn.execute(text(f'GRANT USAGE ON SCHEMA "{schema}" TO {name}'))
        conn.execute(text(f"GRANT {READER_ROLE} TO {name}"))
    url = make_url(pg_schema_url).set(username=name, password=None)
    try:
        yield pg_schema_url, url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP OWNED BY {name}"))
            conn.execute(text(f"DROP ROLE {name}"))
        admin.dispose()


@pytest.mark.integration
def test_postgresql_reads_as_the_reader_role_and_cannot_write(pg_login: tuple[str, str]) -> None:
    owner, login = pg_login
    with pytest.raises(ConfigError, match="superuser"):
        open_readonly(owner)
    for url, allow in ((login, False), (owner, True)):
        db = open_readonly(url, allow_superuser=allow)
        try:
            assert [s.run for s in reports.run_summaries(db)] == ["fork", "r"]
            with db.engine.connect() as conn:
                assert conn.exec_driver_sql("SELECT current_user").scalar() == READER_ROLE
            for statement in WRITES:
                refused(db.engine, statement)
            # Leaving the role does not help: transactions stay read-only.
            refused(db.engine, "RESET ROLE", WRITES[0])
        finally:
            db.close()
    check = create_engine(owner)
    with check.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 2
    check.dispose()


@pytest.mark.integration
def test_postgresql_every_page_renders(pg_login: tuple[str, str], tmp_path: Path) -> None:
    _, login = pg_login
    site = Site(open_readonly(login), str(tmp_path / "store"), db_label=login)
    app = App(site)
    try:
        ids = [row.checkpoint.info.id for row in data.run_view(site, "r").checkpoints]
        for path, query in (
            ((), {}),
            (("lineage",), {}),
            (("runs", "r"), {}),
            (("checkpoints", str(ids[0])), {}),
            (("compare",), {"a": str(ids[1]), "b": str(ids[0])}),
            (("storage",), {}),
            (("api", "runs", "r", "history"), {}),
        ):
            assert app.handle(Request(path, query)).status == 200, path
        history = data.run_history(site, "r")
        assert [h.point.metrics for h in history] == [{"loss": 1.0}, {"loss": 0.5}]
        assert data.lineage_view(site)[0].parent_run == "r"
        view = compare_view(site, ids[1], ids[0])
        # One packed tensor in a changed pack: its bytes are read and compared.
        assert [(d.verdict, d.why) for d in view.diffs] == [("differs", "the bytes differ")]
    finally:
        site.close()
