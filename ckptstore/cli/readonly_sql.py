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
        cursor = conn.execute(query)  # refuses more than one statement
        columns = [d[0] for d in cursor.description or []]
        return columns, cursor.fetchall()
    finally:
        conn.close()


def _postgres(url: str, query: str) -> tuple[list[str], list[Sequence[Any]]]:
    engine = create_engine(url, connect_args={"options": "-c default_transaction_read_only=on"})
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
