"""Fixtures the command tests share (one test module per command, tests/cli/test_<command>.py).

- ``populated``: runs alpha and beta saved into a fresh manifest (``db_url``: SQLite, then
  PostgreSQL) and LocalStore (:mod:`populated`).
- ``sql_store``: the same store over ``plain_db_url``, a manifest whose tables live in the
  connection's default schema (what ``ckptstore sql`` users have).
- ``tiny_site``: two small runs, ``single`` and ``shared`` (:mod:`tiny_runs`).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from populated import Populated, populate
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from tiny_runs import Site, make_site


@pytest.fixture
def populated(db_url: str, tmp_path: Path) -> Populated:
    """Runs alpha and beta in a fresh manifest and store."""
    work = tmp_path / "work"
    work.mkdir()
    return populate(db_url, tmp_path / "store", work)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def plain_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh manifest whose tables live in the connection's default schema: a SQLite file,
    or a new PostgreSQL database (not a schema selected through the URL) on the test server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'plain.db'}"
        return
    base = make_url(request.getfixturevalue("pg_url"))
    name = f"ckpt_cli_{secrets.token_hex(6)}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def sql_store(plain_db_url: str, tmp_path: Path) -> Populated:
    """Runs alpha and beta in a manifest of ``plain_db_url``."""
    work = tmp_path / "work"
    work.mkdir()
    return populate(plain_db_url, tmp_path / "store", work)


@pytest.fixture
def tiny_site(db_url: str, tmp_path: Path) -> Site:
    """Runs ``single`` and ``shared`` in a fresh manifest and store."""
    return make_site(db_url, tmp_path)
