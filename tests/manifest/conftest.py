"""Fixtures of the ``ckptstore sql`` tests (test_readonly_*.py): a SQLite file and a migrated
PostgreSQL schema, both with sample rows, and non-superuser PostgreSQL logins.

PostgreSQL: one migrated schema per module, owned by the server's superuser (whose migration
creates ``ckptstore_reader`` and its grants). Queries run as a non-superuser login made for the
module, a member of ``ckptstore_reader``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from readonly_targets import Target, insert_sample, schema_of
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from ckptstore.manifest import Database
from ckptstore.manifest.readonly import READER_ROLE


@pytest.fixture(scope="module")
def sqlite_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    scratch = tmp_path_factory.mktemp("sqlite-ro")
    url = f"sqlite:///{scratch / 'manifest.db'}"
    database = Database(url)
    insert_sample(database.engine)
    yield Target("sqlite", url, database.engine, scratch)
    database.close()


@pytest.fixture(scope="module")
def pg_admin_url(pg_url: str) -> Iterator[str]:
    """A migrated schema of its own (owner: the server's superuser); its URL as the owner."""
    schema = f"ro_{secrets.token_hex(6)}"
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(pg_url).update_query_dict({"options": f"-csearch_path={schema}"})
    rendered = url.render_as_string(hide_password=False)
    database = Database(rendered)  # migrates to head as the superuser
    insert_sample(database.engine)
    database.close()
    yield rendered
    with admin.connect() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture(scope="module")
def make_login(pg_url: str) -> Iterator[Any]:
    """Makes non-superuser logins (trust auth: no password); drops them at teardown."""
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    made: list[str] = []

    def make(admin_url: str, *, reader: bool) -> tuple[str, str]:
        name = f"ckpt_login_{secrets.token_hex(6)}"
        with admin.connect() as conn:
            conn.execute(text(f"CREATE ROLE {name} LOGIN"))
            made.append(name)
            conn.execute(text(f'GRANT USAGE ON SCHEMA "{schema_of(admin_url)}" TO {name}'))
            if reader:
                conn.execute(text(f"GRANT {READER_ROLE} TO {name}"))
        url = make_url(admin_url).set(username=name, password=None)
        return name, url.render_as_string(hide_password=False)

    yield make
    with admin.connect() as conn:
        for name in made:
            conn.execute(text(f"DROP OWNED BY {name}"))
            conn.execute(text(f"DROP ROLE {name}"))
    admin.dispose()


@pytest.fixture(scope="module")
def pg_target(pg_admin_url: str, make_login: Any) -> Iterator[Target]:
    _, url = make_login(pg_admin_url, reader=True)
    admin = create_engine(pg_admin_url)
    # The server writes as its own OS user, which can reach /tmp (not pytest's 0700 tmp dirs):
    # a file missing afterwards then means the attack did not run, not that it failed to write.
    yield Target("postgresql", url, admin, Path("/tmp"))
    admin.dispose()


@pytest.fixture(
    scope="module",
    params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)],
)
def target(request: pytest.FixtureRequest) -> Target:
    name = "sqlite_target" if request.param == "sqlite" else "pg_target"
    found: Target = request.getfixturevalue(name)
    return found


# -- helpers ----------------------------------------------------------------------------------
