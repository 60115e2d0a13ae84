"""Running a user's SQL (``ckptstore sql``) so that it can only read the manifest, and can
neither write, nor reach the server's files, programs or other sessions, nor stall a writer.

A read-only transaction alone is not enough on PostgreSQL: as a superuser, ``COPY ... TO
PROGRAM``, ``pg_read_file`` or ``pg_terminate_backend`` all run inside one, and any role may
take an advisory lock (GC and commits wait on one) or sleep in one. So the query must pass every
layer below, and each layer holds on its own:

1. Statement kind, checked before connecting (:class:`ConfigError`): one query only
   (:mod:`.pg_text`, :mod:`.sqlite`).
2. Grammar (PostgreSQL, :mod:`.pg_text`): sent as the subquery of one ``SELECT`` through the
   extended protocol, so the server parses one ``SELECT`` or fails.
3. Calls (PostgreSQL, :mod:`.pg_calls`): the server parses the query first, and it runs only if
   every function it calls is a built-in immutable or stable one (no ``pg_advisory_lock``,
   ``pg_sleep``, ``pg_notify``, ``lo_*``, ``set_config``, ``pg_cancel_backend``, dblink ...),
   and it reads only ckptstore's relations and the system catalogs. SQLite (:mod:`.sqlite`):
   the authorizer sees every function by name and refuses ``load_extension``.
4. Privileges: PostgreSQL runs the query as ``ckptstore_reader`` (:mod:`.pg_role`): ``SELECT``
   on the manifest, nothing else, so no row locks and no file or admin functions. SQLite opens
   the file without creating it, with ``query_only`` and an authorizer that allows reads only.
5. A read-only transaction (PostgreSQL), rolled back afterwards (:mod:`.pg_run`).
6. A deadline: ``statement_timeout`` (PostgreSQL), a progress handler (SQLite).

What the query holds while it runs is what any reader holds -- a snapshot and ``ACCESS SHARE``
locks, which no ckptstore write waits for -- and for at most its timeout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import make_url

from ckptstore.errors import ConfigError
from ckptstore.manifest.readonly.pg_role import MANIFEST_RELATIONS, READER_ROLE, grants_sql
from ckptstore.manifest.readonly.pg_text import postgres_statement, wrap_as_select
from ckptstore.manifest.readonly.sqlite import check_sqlite_query, run_sqlite

__all__ = [
    "MANIFEST_RELATIONS",
    "READER_ROLE",
    "check_sqlite_query",
    "grants_sql",
    "postgres_statement",
    "run_readonly",
    "wrap_as_select",
]


def run_readonly(
    url: str, query: str, *, timeout: float = 30.0, allow_superuser: bool = False
) -> tuple[list[str], list[Sequence[Any]]]:
    """Run one read-only query; returns (columns, rows).

    Raises :class:`ConfigError` for a statement kind that is not a query, on PostgreSQL for a
    query that calls or reads what layer 3 refuses, for a superuser login (unless
    ``allow_superuser``) or a login that cannot become ``ckptstore_reader``;
    :class:`~ckptstore.errors.DatabaseError` when the database refuses the query or it runs
    longer than ``timeout`` seconds.
    """
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ConfigError(f"invalid --timeout {timeout!r}: use seconds > 0")
    if "\x00" in query:
        raise ConfigError("the query contains a NUL character")
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        check_sqlite_query(query)
        return run_sqlite(parsed.database or "", query, timeout)
    statement = postgres_statement(query)
    from ckptstore.manifest.readonly.pg_run import run_postgres  # PostgreSQL only

    return run_postgres(url, statement, timeout, allow_superuser)
