"""Engines, sessions and schema checks for the manifest database.

SQLite (the embedded default): WAL, foreign keys on, a busy timeout, and ``BEGIN IMMEDIATE``
for write transactions so two writers never deadlock upgrading a read lock. PostgreSQL: psycopg
3. Write transactions are retried when the database reports contention ("database is locked",
serialization failures, deadlocks), so many processes can commit at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import random
import sqlite3
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from ckptstore.errors import ConfigError, DatabaseError, SchemaError

T = TypeVar("T")
log = logging.getLogger("ckptstore.manifest")

DEFAULT_DB = ".ckptstore/manifest.db"
_PG_MIGRATION_LOCK = 0x636B7074  # "ckpt": advisory lock held while creating a fresh schema
_BUSY_TIMEOUT_MS = 30_000
_RETRIES = 8


def resolve_url(db: str | Path | None) -> str:
    """A SQLAlchemy URL for ``db``: a URL, a SQLite file path, or None for the default."""
    if db is None or str(db).strip() == "":
        db = DEFAULT_DB
    text_url = str(db).strip()
    if "://" not in text_url:
        path = Path(text_url).expanduser().resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path}"
    if text_url.startswith(("postgres://", "postgresql://")):
        text_url = "postgresql+psycopg://" + text_url.split("://", 1)[1]
    try:
        url = make_url(text_url)
    except ArgumentError as exc:
        raise ConfigError(f"invalid database URL: {exc}") from None
    if url.get_backend_name() not in ("sqlite", "postgresql"):
        raise ConfigError(
            f"unsupported database {url.get_backend_name()!r}: use a SQLite path or "
            "sqlite:///path, or postgresql://user@host/db"
        )
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        Path(url.database).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
    return url.render_as_string(hide_password=False)


def redact(url: str) -> str:
    """``url`` safe to print: the password is masked."""
    return make_url(url).render_as_string(hide_password=True)


def _alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("ckptstore._migrations")))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None, "the packaged migrations have no head"
    return head


def _enable_wal(cursor: Any) -> None:
    """Switch a new database file to WAL. The switch upgrades a read lock, where SQLite skips
    its busy handler, so contention from another process starting up is retried here."""
    deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(random.uniform(0.01, 0.1))


def known_revisions() -> set[str]:
    """Every schema revision this ckptstore's migrations know."""
    return {rev.revision for rev in ScriptDirectory.from_config(_alembic_config()).walk_revisions()}


def _one_line(error: object) -> str:
    """A driver's message on one line (libpq's span several: "...\n\tIs the server running")."""
    return " ".join(str(error).split())


def _is_contention(exc: BaseException) -> bool:
    if not isinstance(exc, DBAPIError):
        return False
    message = str(exc.orig).lower()
    sqlstate = getattr(exc.orig, "sqlstate", None)
    return (
        "database is locked" in message
        or "database is busy" in message
        or sqlstate in {"40001", "40P01", "55P03"}  # serialization, deadlock, lock not available
    )


class Database:
    """One manifest database. Thread-safe; share one per process."""

    def __init__(self, url: str | Path | None = None, *, check_schema: bool = True) -> None:
        self.url = resolve_url(url)
        self.dialect = make_url(self.url).get_backend_name()
        self.engine = self._make_engine()
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._writes = sessionmaker(
            self.engine.execution_options(sqlite_begin="IMMEDIATE"), expire_on_commit=False
        )
        if check_schema:
            try:
                self.ensure_schema()
            except BaseException:
                self.engine.dispose()
                raise

    @property
    def is_sqlite(self) -> bool:
        return self.dialect == "sqlite"

    def __repr__(self) -> str:
        return f"Database({redact(self.url)!r})"

    def _make_engine(self) -> Engine:
        if self.dialect != "sqlite":
            return create_engine(self.url, pool_pre_ping=True, future=True)
        engine = create_engine(self.url, connect_args={"timeout": _BUSY_TIMEOUT_MS / 1000})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            # Let SQLAlchemy's "begin" event issue BEGIN, so writes can ask for IMMEDIATE.
            dbapi_conn.isolation_level = None
            cursor = dbapi_conn.cursor()
            cursor.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA foreign_keys=ON")
            _enable_wal(cursor)
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
            conn.exec_driver_sql(f"BEGIN {mode}")

        return engine

    # -- schema -----------------------------------------------------------------------------

    def current_revision(self) -> str | None:
        try:
            with self.engine.connect() as conn:
                return MigrationContext.configure(conn).get_current_revision()
        except OperationalError as exc:
            raise DatabaseError(
                f"cannot reach the manifest database {redact(self.url)}: {_one_line(exc.orig)}; "
                "check the URL and that the server is running"
            ) from exc

    def ensure_schema(self) -> None:
        """Create a fresh database at head; refuse an out-of-date or unknown one."""
        head = head_revision()
        current = self.current_revision()
        if current == head:
            return
        if current is None:
            with self._migration_lock():
                if self.current_revision() is None:
                    if self._has_tables():
                        raise SchemaError(
                            f"the database {redact(self.url)} has tables but no ckptstore schema "
                            "version; point --db at an empty or ckptstore database"
                        )
                    self._upgrade()
            return
        if current not in known_revisions():
            raise SchemaError(
                f"the database {redact(self.url)} is at schema revision {current}, newer than "
                f"this ckptstore knows ({head}); upgrade ckptstore"
            )
        raise SchemaError(
            f"the database {redact(self.url)} is at schema revision {current}, this ckptstore "
            f"needs {head}; run `ckptstore db upgrade --db {redact(self.url)}` once (not from "
            "every worker)"
        )

    def upgrade(self, revision: str = "head") -> tuple[str | None, str | None]:
        """Migrate to ``revision``; returns (before, after)."""
        before = self.current_revision()
        known = known_revisions()
        if before is None and self._has_tables():
            raise SchemaError(
                f"the database {redact(self.url)} has tables but no ckptstore schema version; "
                "point --db at an empty or ckptstore database"
            )
        if before is not None and before not in known:
            raise SchemaError(
                f"the database {redact(self.url)} is at schema revision {before}, newer than "
                f"this ckptstore knows ({head_revision()}); upgrade ckptstore instead"
            )
        try:
            with self._migration_lock():
                self._upgrade(revision)
        except CommandError as exc:
            raise SchemaError(f"cannot upgrade {redact(self.url)} to {revision!r}: {exc}") from exc
        return before, self.current_revision()

    def _upgrade(self, revision: str = "head") -> None:
        with self.engine.begin() as conn:
            command.upgrade(_alembic_config(conn), revision)

    def _has_tables(self) -> bool:
        with self.engine.connect() as conn:
            return bool(inspect(conn).get_table_names())

    @contextlib.contextmanager
    def _migration_lock(self) -> Iterator[None]:
        if self.dialect == "postgresql":
            with self.engine.connect() as conn:
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
                try:
                    yield
                finally:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_MIGRATION_LOCK})
                    conn.commit()
            return
        database = make_url(self.url).database
        if not database or database == ":memory:":
            yield
            return
        with open(f"{database}.migrate-lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- sessions ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        """A read unit of work; its transaction is rolled back when the block ends.

        Objects loaded inside stay usable afterwards (closed, not expired).
        """
        with self._sessions() as session:
            try:
                yield session
            except DBAPIError as exc:
                if not isinstance(exc, OperationalError | InterfaceError):
                    raise
                raise DatabaseError(
                    f"reading {redact(self.url)} failed: {_one_line(exc.orig)}; check that the "
                    "database is reachable"
                ) from exc

    def write(self, fn: Callable[[Session], T], *, what: str = "database write") -> T:
        """Run ``fn`` in one write transaction, retrying the whole of it on contention."""
        attempt = 1
        while True:
            try:
                with self._writes() as session, session.begin():
                    return fn(session)
            except DBAPIError as exc:
                if not _is_contention(exc) or attempt >= _RETRIES:
                    if isinstance(exc, OperationalError) and not _is_contention(exc):
                        raise DatabaseError(
                            f"{what} on {redact(self.url)} failed: {_one_line(exc.orig)}"
                        ) from exc
                    raise
                pause = random.uniform(0, min(2.0, 0.05 * 2**attempt))
                log.info(
                    "%s: database busy (%s), retry %d in %.2fs", what, exc.orig, attempt, pause
                )
                time.sleep(pause)
                attempt += 1

    def close(self) -> None:
        self.engine.dispose()
