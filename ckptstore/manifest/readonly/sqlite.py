"""``ckptstore sql`` on SQLite: the statement kind, and a connection that can only read.

The file is opened without creating it, with ``query_only`` and an authorizer that allows reads
and function calls only. SQLite's authorizer is asked about every function the parser resolves,
by name, so ``load_extension`` (loading code) and ``fts3_tokenizer`` (handing SQLite a pointer)
are refused however they are spelled; SQLite has no SQL function that sleeps, signals another
connection or takes a lock of its own. A progress handler cancels the query at its deadline.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptstore.errors import ConfigError, DatabaseError
from ckptstore.manifest.readonly.refusals import SQLITE_ACCEPTED, refuse_kind, timed_out

_QUERY_KEYWORDS = ("SELECT", "WITH", "VALUES")
_WORD = re.compile(r"[A-Za-z_]+")


def _words(text: str, count: int) -> list[str]:
    """The first ``count`` words of ``text``, upper-cased, skipping SQLite comments."""
    words: list[str] = []
    pos = 0
    while len(words) < count and pos < len(text):
        if text[pos] in " \t\n\r\f":
            pos += 1
        elif text.startswith("--", pos):
            newline = text.find("\n", pos)
            pos = len(text) if newline < 0 else newline + 1
        elif text.startswith("/*", pos):  # not nested in SQLite; an open one runs to the end
            close = text.find("*/", pos + 2)
            pos = len(text) if close < 0 else close + 2
        else:
            match = _WORD.match(text, pos)
            if match is None:
                words.append(text[pos])
                break
            words.append(match.group().upper())
            pos = match.end()
    return words + [""] * (count - len(words))


def check_sqlite_query(query: str) -> None:
    """Layer 1 on SQLite (sqlite3 itself refuses a second statement)."""
    first, second, third, fourth = _words(query, 4)
    if first == "EXPLAIN":
        first = fourth if (second, third) == ("QUERY", "PLAN") else second
    if first not in _QUERY_KEYWORDS:
        raise refuse_kind(first, SQLITE_ACCEPTED)


def run_sqlite(path: str, query: str, timeout: float) -> tuple[list[str], list[Sequence[Any]]]:
    """Run ``query`` (already checked) on the SQLite file ``path``; returns (columns, rows)."""
    if not path or not Path(path).exists():
        raise ConfigError(f"no SQLite database at {path!r}")
    deadline = time.monotonic() + timeout
    expired = False

    def past_deadline() -> int:
        nonlocal expired
        expired = time.monotonic() > deadline
        return int(expired)  # non-zero interrupts the statement

    try:
        # mode=rw, not ro: it never creates the file either, and as the last connection it can
        # remove the WAL's -wal/-shm files on close (a read-only one leaves them behind). The
        # authorizer and query_only are what keep it from writing.
        conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=rw", uri=True)
        try:
            conn.execute("PRAGMA query_only = ON")
            conn.set_authorizer(_reads_only)
            conn.set_progress_handler(past_deadline, 1000)
            cursor = conn.execute(query)  # refuses more than one statement
            columns = [d[0] for d in cursor.description or []]
            return columns, cursor.fetchall()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        if expired:
            raise timed_out(timeout) from exc
        raise DatabaseError(
            f"query failed: {str(exc).strip()} (`ckptstore sql` is read-only)"
        ) from exc


_ALLOWED = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
}
#: Functions no query may call: loading code, or (fts3_tokenizer) handing SQLite a pointer.
_DENIED_FUNCTIONS = {"load_extension", "fts3_tokenizer"}


def _reads_only(action: int, _arg1: str | None, arg2: str | None, *_rest: object) -> int:
    """SQLite authorizer: reads only (no ATTACH, which would create files, no PRAGMA, ...)."""
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY
