"""Manifest-database fixtures, loaded for every directory by the root conftest (pytest_plugins).

The same tests run on SQLite and on a real PostgreSQL server.

- ``pg_url`` (session): a fresh database ``ckpt_test_<hex>`` on the server named by
  ``$CKPTSTORE_TEST_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``),
  dropped at the end of the session. Nothing is ever created in the base database itself.
  Unreachable server: the run fails if the variable is set (CI asked for PostgreSQL), else the
  PostgreSQL cases are skipped.
- ``db_url``: a fresh, empty manifest database per test, on each dialect in turn: a SQLite file
  under the test's tmp dir, or a fresh schema inside the session's PostgreSQL database, selected
  through the connection's ``search_path`` (``?options=-csearch_path%3D<schema>``).
- ``store``: a real :class:`~ckptstore.objectstore.LocalStore` under the test's tmp dir.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import OperationalError

from ckptstore.objectstore import LocalStore

PG_URL_ENV = "CKPTSTORE_TEST_PG_URL"
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _base_pg_url() -> URL:
    url = make_url(os.environ.get(PG_URL_ENV) or DEFAULT_PG_URL)
    if url.drivername in ("postgres", "postgresql"):
        url = url.set(drivername="postgresql+psycopg")
    return url


def _admin_engine(url: URL) -> Engine:
    # CREATE/DROP DATABASE and SCHEMA run outside a transaction.
    return create_engine(url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5})


def _render(url: URL) -> str:
    return url.render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """URL of a PostgreSQL database created for this test session (dropped afterwards)."""
    base = _base_pg_url()
    admin = _admin_engine(base)
    try:
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except OperationalError as exc:
        admin.dispose()
        where = base.render_as_string(hide_password=True)
        if os.environ.get(PG_URL_ENV):
            pytest.fail(f"${PG_URL_ENV} is set but PostgreSQL at {where} is unreachable: {exc}")
        pytest.skip(f"PostgreSQL at {where} is unreachable (set ${PG_URL_ENV} to require it)")
    name = f"ckpt_test_{secrets.token_hex(6)}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
            # Test data need not survive a server crash; commits stop waiting for the WAL
            # flush, which is most of a small commit's time. Visibility rules are unchanged.
            conn.execute(text(f'ALTER DATABASE "{name}" SET synchronous_commit = off'))
        yield _render(base.set(database=name))
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def pg_schema_url(pg_url: str) -> Iterator[str]:
    """A fresh schema in the session's database; the URL's connections default to it."""
    schema = f"t_{secrets.token_hex(6)}"
    admin = _admin_engine(make_url(pg_url))
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        url = make_url(pg_url).update_query_dict({"options": f"-csearch_path={schema}"})
        yield _render(url)
    finally:
        with admin.connect() as conn:
            # A test that leaked an open transaction must fail its teardown, not hang it.
            conn.execute(text("SET lock_timeout = '20s'"))
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(
    params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)],
)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty manifest database (tables are created by its first ``Database``)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'manifest.db'}"
    url: str = request.getfixturevalue("pg_schema_url")
    return url


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    """A real local object store, empty, under the test's tmp dir.

    Without fsync: these tests kill processes, never the machine, and the page cache survives
    a killed process; fsyncs would only slow the suite down.
    """
    local = LocalStore(tmp_path / "store", fsync=False)
    yield local
    local.close()
