"""``ckptstore sql`` on PostgreSQL: one connection, one transaction, every layer in turn.

The transaction begins read-write only so that the calls layer can parse the query into a
temporary view; the query itself runs after ``SET TRANSACTION READ ONLY`` (which nothing can
undo once a statement has run) and everything is rolled back. The connection's default is
read-only too (``default_transaction_read_only``), for anything outside that transaction.

Deadline: ``statement_timeout`` cancels each statement after ``timeout`` seconds, and
``idle_in_transaction_session_timeout`` ends the session if this process stops between two of
them, so a reader never holds its locks on the manifest (``ACCESS SHARE``, which no ckptstore
write waits for; only DDL does) longer than that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from ckptstore.errors import DatabaseError
from ckptstore.manifest.readonly.pg_calls import check_calls
from ckptstore.manifest.readonly.pg_role import become_reader, pg_message
from ckptstore.manifest.readonly.pg_text import PgStatement
from ckptstore.manifest.readonly.refusals import timed_out

if TYPE_CHECKING:
    import psycopg

_DEADLINE = (
    "SELECT pg_catalog.set_config('statement_timeout', %(ms)s, true), "
    "pg_catalog.set_config('idle_in_transaction_session_timeout', %(ms)s, true)"
)


def run_postgres(
    url: str, statement: PgStatement, timeout: float, allow_superuser: bool
) -> tuple[list[str], list[Sequence[Any]]]:
    """Run ``statement`` (layers 1 and 2 passed) as ckptstore_reader; returns (columns, rows)."""
    import psycopg  # PostgreSQL only: SQLite queries never load the driver

    parsed = make_url(url)
    # Keep the URL's own options (a search_path, say) and add read-only on top.
    own = str(parsed.query.get("options", ""))
    options = f"{own} -c default_transaction_read_only=on".strip()
    engine = create_engine(
        parsed.difference_update_query(["options"]),
        poolclass=NullPool,
        connect_args={"options": options},
    )
    try:
        raw = engine.raw_connection()
        try:
            dbapi: psycopg.Connection[Any] = raw.driver_connection  # type: ignore[assignment]
            return _in_one_transaction(dbapi, statement, timeout, allow_superuser)
        finally:
            raw.close()
    except psycopg.errors.QueryCanceled as exc:
        raise timed_out(timeout) from exc
    except (DBAPIError, psycopg.Error) as exc:
        original = getattr(exc, "orig", None) or exc
        raise DatabaseError(
            f"query failed: {pg_message(original)} (`ckptstore sql` is read-only)"
        ) from exc
    finally:
        engine.dispose()


def _in_one_transaction(
    dbapi: psycopg.Connection[Any], statement: PgStatement, timeout: float, allow_superuser: bool
) -> tuple[list[str], list[Sequence[Any]]]:
    dbapi.read_only = False  # BEGIN READ WRITE, for the check view only (see the module)
    try:
        with dbapi.cursor() as cursor:
            become_reader(cursor, allow_superuser)
            milliseconds = min(max(1, round(timeout * 1000)), 2**31 - 1)
            cursor.execute(_DEADLINE, {"ms": str(milliseconds)})
            check_calls(cursor, statement.query)
            cursor.execute("SET TRANSACTION READ ONLY")
            # prepare=True: the extended protocol, which refuses a second statement.
            cursor.execute(statement.text, prepare=True)
            columns = [d.name for d in cursor.description or []]
            rows: list[Sequence[Any]] = list(cursor.fetchall()) if columns else []
            return columns, rows
    finally:
        dbapi.rollback()
