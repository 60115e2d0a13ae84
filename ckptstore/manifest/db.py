"""Engines, sessions and schema checks for the manifest database.

SQLite (the embedded default): WAL, foreign keys on, a busy timeout, and ``BEGIN IMMEDIATE``
for write transactions so two writers never deadlock upgrading a read lock. PostgreSQL: psycopg
3. Write transactions are retried when the database reports contention ("database is locked",
serialization failures, deadlocks), so many processes can commit at once.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError

from ckptstore.errors import ConfigError, DatabaseError, ForeignDatabaseError, SchemaError
from ckptstore.names import printable
from ckptstore.settings import default_db

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")
log = logging.getLogger("ckptstore.manifest")

_PG_MIGRATION_LOCK = 0x636B7074  # "ckpt": advisory lock held while creating a fresh schema
_BUSY_TIMEOUT_MS = 30_000
_RETRIES = 8

#: The schema revision this code is written for: the head of the packaged migrations (a test
#: checks that). Opening a database compares against it with one query, so processes that only
#: read never import Alembic; creating and upgrading do. Bump it with every new migration.
SCHEMA_HEAD = "0008"


def resolve_url(db: str | Path | None, *, create: bool = True) -> str:
    """A SQLAlchemy URL for ``db``: a URL, a SQLite file path, or None for the default.

    With ``create`` a SQLite file's directory is made if missing; without it nothing is
    touched and a missing file is a :class:`ConfigError` naming the path.
    """
    if db is None:
        db = default_db()
    text_url = str(db).strip()
    if not text_url:
        raise ConfigError(
            "the database is an empty string: give a SQLite path or postgresql://user@host/db "
            "(--db / $CKPTSTORE_DB), or leave it unset for ./.ckptstore/manifest.db"
        )
    if "://" not in text_url:
        return f"sqlite:///{_sqlite_path(text_url, create)}"
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
        url = url.set(database=str(_sqlite_path(url.database, create)))
    return url.render_as_string(hide_password=False)


def _sqlite_path(text_path: str, create: bool) -> Path:
    try:
        path = Path(text_path).expanduser().resolve()
        path.exists()  # a name too long for the file system raises here
    except (RuntimeError, OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise ConfigError(f"invalid database path {printable(text_path)!r}: {why}") from None
    if create:
        if path.parent.exists() and not path.parent.is_dir():
            raise ConfigError(
                f"cannot create the database {path}: {path.parent} is not a directory"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
    elif not path.exists():
        raise ConfigError(
            f"no manifest database at {path} (--db / $CKPTSTORE_DB); nothing was created. "
            "Check the path; a database is created by the first save or `ckptstore db upgrade`"
        )
    if path.exists() and not path.is_file():
        raise ConfigError(f"the database path {path} is not a file")
    return path


_SQLITE_MAGIC = b"SQLite format 3\x00"


#: (device, inode) of every database file this process has probed. A file is read raw only
#: the first time: closing any descriptor of a file drops *all* of this process's POSIX locks
#: on it, so a raw read while another Database of this process holds SQLite connections to the
#: file would silently release their locks -- other processes then see stale data, or corrupt
#: the WAL ("disk I/O error", "database disk image is malformed").
_probed: set[tuple[int, int]] = set()
_probed_lock = threading.Lock()


def _probe_sqlite(path: Path, create: bool) -> None:
    """Refuse a file that is not a ckptstore database before anything writes to it (the WAL
    switch on connect would otherwise rewrite a foreign file's header). Once per file and
    process (see ``_probed``)."""
    key = _file_key(path)
    with _probed_lock:
        if key is not None and key in _probed:
            return
    _read_header(path, create)


def _file_key(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _remember_connected(path: Path) -> None:
    """This process now holds SQLite connections to ``path``: never read it raw again."""
    key = _file_key(path)
    if key is not None:
        with _probed_lock:
            _probed.add(key)


def _read_header(path: Path, create: bool) -> None:
    try:
        with path.open("rb") as f:
            header = f.read(100)
    except FileNotFoundError:
        return  # created on connect (create=True: resolve_url made the directory)
    except OSError as exc:
        raise ConfigError(f"cannot read the database {path}: {exc.strerror}") from None
    if not header:
        if create:
            return
        raise ConfigError(
            f"the database {path} is an empty file, not a ckptstore database; check --db"
        )
    if not header.startswith(_SQLITE_MAGIC):
        raise ConfigError(f"{path} is not a SQLite database; check --db / $CKPTSTORE_DB")
    wal = len(header) >= 20 and header[18] == 2
    # A rollback-journal file is read without any chance of change; a WAL file is not
    # switched by opening it, so an ordinary connection is as safe there.
    uri = f"{path.as_uri()}?mode=ro" if not wal else path.as_uri()
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=_BUSY_TIMEOUT_MS / 1000)
        try:
            tables = {
                name
                for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise ConfigError(
            f"{path} is not a readable SQLite database ({_one_line(exc)}); check --db"
        ) from None
    if tables and "alembic_version" not in tables:
        raise ForeignDatabaseError(
            f"the database {path} has tables but no ckptstore schema version; point --db at "
            "an empty or ckptstore database"
        )


def redact(url: str) -> str:
    """``url`` safe to print: the password is masked."""
    return make_url(url).render_as_string(hide_password=True)


def _alembic_config(connection: Connection | None = None) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("ckptstore._migrations")))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest schema revision this ckptstore's migrations define."""
    from alembic.script import ScriptDirectory

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
    from alembic.script import ScriptDirectory

    return {rev.revision for rev in ScriptDirectory.from_config(_alembic_config()).walk_revisions()}


def _read_revision(conn: Connection) -> str | None:
    """The revision in ``alembic_version`` (None: no table or no row), without Alembic."""
    if not inspect(conn).has_table("alembic_version"):
        return None
    versions = list(conn.execute(text("SELECT version_num FROM alembic_version")).scalars())
    if len(versions) > 1:
        raise SchemaError(
            f"the database's alembic_version holds {len(versions)} revisions "
            f"({', '.join(sorted(versions))}); ckptstore's schema has one line of history"
        )
    return versions[0] if versions else None


def _upgrade(conn: Connection, revision: str) -> None:
    from alembic import command

    command.upgrade(_alembic_config(conn), revision)


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

    def __init__(
        self, url: str | Path | None = None, *, check_schema: bool = True, create: bool = True
    ) -> None:
        """Open the manifest database at ``url`` (default ``$CKPTSTORE_DB`` or
        ``./.ckptstore/manifest.db``).

        ``create=False`` is for readers: a missing or empty database is a :class:`ConfigError`
        and nothing is created or switched (no file, directory, journal mode or schema).
        """
        self.url = resolve_url(url, create=create)
        self.create = create
        self.dialect = make_url(self.url).get_backend_name()
        path = make_url(self.url).database
        self._file = (
            Path(path) if self.dialect == "sqlite" and path and path != ":memory:" else None
        )
        if self._file is not None:
            _probe_sqlite(self._file, create)
        self.engine = self._make_engine()
        if check_schema:
            try:
                self.ensure_schema()
            except BaseException:
                self.engine.dispose()
                raise

    @property
    def is_sqlite(self) -> bool:
        """True for SQLite."""
        return self.dialect == "sqlite"

    def __repr__(self) -> str:
        return f"Database({redact(self.url)!r})"

    def _make_engine(self) -> Engine:
        create = self.create
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
            if create:  # readers never change a file's journal mode
                _enable_wal(cursor)
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()
            if self._file is not None:
                _remember_connected(self._file)

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
            conn.exec_driver_sql(f"BEGIN {mode}")

        return engine

    # -- schema -----------------------------------------------------------------------------

    def current_revision(self) -> str | None:
        """The database's schema revision, or None if it has none."""
        try:
            with self.engine.connect() as conn:
                return _read_revision(conn)
        except OperationalError as exc:
            raise DatabaseError(
                f"cannot reach the manifest database {redact(self.url)}: {_one_line(exc.orig)}; "
                "check the URL and that the server is running"
            ) from exc

    def ensure_schema(self) -> None:
        """Create a fresh database at head (unless opened with ``create=False``); refuse an
        out-of-date or unknown one."""
        head = SCHEMA_HEAD
        current = self.current_revision()
        if current == head:
            return
        if current is None:
            if not self.create:
                raise ConfigError(
                    f"the database {redact(self.url)} has no ckptstore schema (empty or not "
                    "created yet); check --db / $CKPTSTORE_DB, or run `ckptstore db upgrade`"
                )
            with self._migration() as conn:
                # Re-checked under the lock: another process may have created it meanwhile.
                if _read_revision(conn) is None:
                    self._refuse_foreign(conn)
                    _upgrade(conn, "head")
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
        from alembic.util.exc import CommandError

        known = known_revisions()
        if revision != "head" and revision not in known:
            raise ConfigError(
                f"unknown schema revision {printable(revision)!r}: use head or one of "
                f"{', '.join(sorted(known))}"
            )
        try:
            with self._migration() as conn:
                before = _read_revision(conn)
                if before is None:
                    self._refuse_foreign(conn)
                elif before not in known_revisions():
                    raise SchemaError(
                        f"the database {redact(self.url)} is at schema revision {before}, newer "
                        f"than this ckptstore knows ({head_revision()}); upgrade ckptstore "
                        "instead"
                    )
                _upgrade(conn, revision)
        except CommandError as exc:
            raise SchemaError(f"cannot upgrade {redact(self.url)} to {revision!r}: {exc}") from exc
        return before, self.current_revision()

    def _refuse_foreign(self, conn: Connection) -> None:
        if inspect(conn).get_table_names():
            raise ForeignDatabaseError(
                f"the database {redact(self.url)} has tables but no ckptstore schema version; "
                "point --db at an empty or ckptstore database"
            )

    @contextlib.contextmanager
    def _migration(self) -> Iterator[Connection]:
        """A transaction that no other migration runs beside: PostgreSQL's advisory lock, or
        SQLite's write lock (``BEGIN IMMEDIATE``; SQLite's DDL is transactional) — no lock
        file is left next to the database."""
        if self.dialect != "postgresql":
            with self.engine.execution_options(sqlite_begin="IMMEDIATE").begin() as conn:
                yield conn
            return
        with self.engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
            conn.commit()
            try:
                with conn.begin():
                    yield conn
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_MIGRATION_LOCK})
                conn.commit()

    # -- sessions ---------------------------------------------------------------------------

    @cached_property
    def _sessions(self) -> sessionmaker[Session]:
        # The ORM is imported on the first session, not with this module: a process that
        # only reads through connect() (the CLI's read commands) never pays for it.
        from sqlalchemy.orm import sessionmaker

        return sessionmaker(self.engine, expire_on_commit=False)

    @cached_property
    def _writes(self) -> sessionmaker[Session]:
        from sqlalchemy.orm import sessionmaker

        return sessionmaker(
            self.engine.execution_options(sqlite_begin="IMMEDIATE"), expire_on_commit=False
        )

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        """A read unit of work; its transaction is rolled back when the block ends.

        Objects loaded inside stay usable afterwards (closed, not expired).
        """
        with self._sessions() as session, self._reading():
            yield session

    @contextlib.contextmanager
    def connect(self) -> Iterator[Connection]:
        """A read on SQLAlchemy Core, without the ORM (see :mod:`ckptstore.manifest._sql`);
        like :meth:`read`, its transaction is rolled back when the block ends."""
        with self._reading(), self.engine.connect() as conn:
            yield conn

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """A lost connection while reading, as :class:`DatabaseError`."""
        try:
            yield
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
        """Release the engine's connections."""
        self.engine.dispose()
