"""Running a user's SQL so that the database itself refuses any write."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from ckptstore.errors import ConfigError, DatabaseError


def run_readonly(url: str, query: str) -> tuple[list[str], list[Sequence[Any]]]:
    """Execute one statement read-only; returns (columns, rows).

    SQLite: the file is opened with ``mode=ro`` and ``query_only``. PostgreSQL: the session is
    read-only and the statement is sent through the extended protocol, which takes exactly one
    statement, so ``COMMIT; DELETE ...`` cannot escape the read-only transaction.
    """
    parsed = make_url(url)
    try:
        if parsed.get_backend_name() == "sqlite":
            return _sqlite(parsed.database or "", query)
        return _postgres(url, query)
    except (sqlite3.Error, DBAPIError, psycopg.Error) as exc:
        original = getattr(exc, "orig", exc)
        raise DatabaseError(
            f"query failed: {str(original).strip()} (`ckptstore sql` is read-only)"
        ) from exc


def _sqlite(path: str, query: str) -> tuple[list[str], list[Sequence[Any]]]:
    if not path or not Path(path).exists():
        raise ConfigError(f"no SQLite database at {path!r}")
    conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
    try:
        conn.execute("PRAGMA query_only = ON")
        conn.set_authorizer(_sqlite_reads_only)
        cursor = conn.execute(query)  # refuses more than one statement
        columns = [d[0] for d in cursor.description or []]
        return columns, cursor.fetchall()
    finally:
        conn.close()


_SQLITE_ALLOWED = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
}


def _sqlite_reads_only(action: int, *_args: object) -> int:
    """SQLite authorizer: reads only (no ATTACH, which would create files, no PRAGMA, ...)."""
    return sqlite3.SQLITE_OK if action in _SQLITE_ALLOWED else sqlite3.SQLITE_DENY


def _postgres(url: str, query: str) -> tuple[list[str], list[Sequence[Any]]]:
    parsed = make_url(url)
    # Keep the URL's own options (a search_path, say) and add read-only on top.
    own = str(parsed.query.get("options", ""))
    options = f"{own} -c default_transaction_read_only=on".strip()
    engine = create_engine(
        parsed.difference_update_query(["options"]), connect_args={"options": options}
    )
    try:
        raw = engine.raw_connection()
        try:
            dbapi: Any = raw.driver_connection
            dbapi.read_only = True
            with dbapi.cursor() as cursor:
                cursor.execute(query, prepare=True)
                columns = [d.name for d in cursor.description or []]
                rows = cursor.fetchall() if cursor.description else []
            dbapi.rollback()
            return columns, rows
        finally:
            raw.close()
    finally:
        engine.dispose()
