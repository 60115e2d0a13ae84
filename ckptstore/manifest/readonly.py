"""Running a user's SQL (`ckptstore sql`) so that it can only read the manifest.

A read-only transaction alone is not enough on PostgreSQL: as a superuser, ``COPY ... TO
PROGRAM``, ``pg_read_file`` or ``pg_terminate_backend`` all run inside one. So the query must
pass every layer below, and each layer holds on its own:

1. Statement kind, checked here before connecting (:class:`ConfigError`): one query only,
   ``SELECT``, ``WITH ... SELECT``, ``VALUES``, ``TABLE`` (PostgreSQL) or ``EXPLAIN`` of one of
   them without ``ANALYZE`` (SQLite: ``EXPLAIN [QUERY PLAN]``). A top-level ``;`` with anything
   after it is refused.
2. Grammar (PostgreSQL): the text is sent as ``SELECT * FROM (<query>) AS ckptstore_query``
   through the extended protocol, which takes exactly one statement. Whatever the text does
   (closing the parenthesis itself, comments, dollar quotes), the server parses one ``SELECT``
   or fails: ``COPY``, ``DO``, ``SET`` and data-modifying ``WITH`` cannot appear in a subquery.
   An ``EXPLAIN`` is rebuilt from the options we understand, around the same wrapped query.
3. Privileges: PostgreSQL runs the query as ``ckptstore_reader`` (``SET LOCAL ROLE``), a role
   with ``SELECT`` on the manifest and nothing else (migration 0004 creates it). A superuser
   session is refused unless the caller opts in: it could leave the role with
   ``set_config('role', ...)``. SQLite opens the file without creating it (``mode=rw``), with
   ``query_only`` and an authorizer that allows reads and functions only (never
   ``load_extension``).
4. A read-only transaction (PostgreSQL), rolled back afterwards.
5. A deadline: ``statement_timeout`` (PostgreSQL), a progress handler (SQLite).
"""

from __future__ import annotations

import logging
import math
import re
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from ckptstore.errors import ConfigError, DatabaseError

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger(__name__)

#: The PostgreSQL role every query runs as (created by migration 0004, cluster-wide).
READER_ROLE = "ckptstore_reader"
#: What ckptstore_reader may read: the manifest's tables and views, in the manifest's schema.
MANIFEST_RELATIONS = (
    "runs",
    "checkpoints",
    "components",
    "blobs",
    "checkpoint_blobs",
    "gc_lease",
    "alembic_version",
    "checkpoint_summary",
    "run_summary",
)

_PG_QUERY_KEYWORDS = ("SELECT", "WITH", "VALUES", "TABLE")
_SQLITE_QUERY_KEYWORDS = ("SELECT", "WITH", "VALUES")
_PG_ACCEPTED = "SELECT, WITH ... SELECT, VALUES, TABLE, or EXPLAIN of one of them (no ANALYZE)"
_SQLITE_ACCEPTED = "SELECT, WITH ... SELECT, VALUES, or EXPLAIN [QUERY PLAN] of one of them"
#: EXPLAIN options that only describe the plan. ANALYZE (which runs the query) is not one.
_EXPLAIN_OPTIONS = frozenset(
    {
        "verbose",
        "costs",
        "settings",
        "buffers",
        "wal",
        "timing",
        "summary",
        "format",
        "generic_plan",
        "memory",
        "serialize",
    }
)
_ANALYZE = frozenset({"ANALYZE", "ANALYSE"})
_OPTION_VALUE = re.compile(r"[a-z0-9_]+")


def run_readonly(
    url: str, query: str, *, timeout: float = 30.0, allow_superuser: bool = False
) -> tuple[list[str], list[Sequence[Any]]]:
    """Run one read-only query; returns (columns, rows).

    Raises :class:`ConfigError` for a statement kind that is not a query, and on PostgreSQL for
    a superuser login (unless ``allow_superuser``) or a login that cannot become
    ``ckptstore_reader``; :class:`DatabaseError` when the database refuses the query or it runs
    longer than ``timeout`` seconds.
    """
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ConfigError(f"invalid --timeout {timeout!r}: use seconds > 0")
    if "\x00" in query:
        raise ConfigError("the query contains a NUL character")
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        check_sqlite_query(query)
        return _sqlite(parsed.database or "", query, timeout)
    statement = postgres_statement(query)
    return _postgres(url, statement, timeout, allow_superuser)


def _refuse_kind(keyword: str, accepted: str) -> ConfigError:
    if keyword.upper() in _ANALYZE:
        return ConfigError(
            f"`ckptstore sql` is read-only and does not run EXPLAIN ANALYZE; it accepts {accepted}"
        )
    if not keyword:
        got = "got no statement"
    elif re.fullmatch(r"[A-Za-z_]+", keyword):
        got = f"got {keyword.upper()}"
    else:
        got = f"got {keyword[:20]!r}"
    return ConfigError(f"`ckptstore sql` runs one read-only query: {accepted}; {got}")


def _one_statement_only(accepted: str) -> ConfigError:
    return ConfigError(
        f"`ckptstore sql` runs one read-only statement; remove what follows the ';' (it accepts "
        f"{accepted})"
    )


# -- PostgreSQL: statement kind and grammar -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # word, string, ident, dollar, param, number, op
    text: str
    start: int


_PG_LEXEME = re.compile(
    r"""
    (?P<space>[ \t\n\r\f\v]+)
  | (?P<comment>--[^\n\r]*)
  | (?P<block>/\*)
  | (?P<string>[eE]'(?:[^'\\]|\\.|'')*'
              | (?:[bBxXnN]|[uU]&)?'(?:[^']|'')*')
  | (?P<ident>(?:[uU]&)?"(?:[^"]|"")*")
  | (?P<dollar>\$(?:[A-Za-z_\x80-\U0010ffff][A-Za-z0-9_\x80-\U0010ffff]*)?\$)
  | (?P<param>\$[0-9]+)
  | (?P<word>[A-Za-z_\x80-\U0010ffff][A-Za-z0-9_$\x80-\U0010ffff]*)
  | (?P<number>[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)
  | (?P<op>.)
    """,
    re.VERBOSE | re.DOTALL,
)


def _pg_tokens(text: str) -> tuple[list[_Token], bool]:
    """PostgreSQL's lexical structure, enough to find keywords and top-level semicolons.

    Returns (tokens without whitespace and comments, complete); ``complete`` is False when the
    text ends inside a string, quoted name or comment.
    """
    tokens: list[_Token] = []
    pos = 0
    while pos < len(text):
        match = _PG_LEXEME.match(text, pos)
        assert match is not None  # `op` matches any character
        kind = match.lastgroup or "op"
        if kind == "block":
            end = _block_comment_end(text, pos)
            if end < 0:
                return tokens, False
            pos = end
            continue
        if kind == "dollar":
            close = text.find(match.group(), match.end())
            if close < 0:
                return tokens, False
            tokens.append(_Token("string", text[pos : close + len(match.group())], pos))
            pos = close + len(match.group())
            continue
        if kind == "op" and match.group() in "'\"":
            return tokens, False  # a quote the string/ident patterns could not close
        if kind not in ("space", "comment"):
            tokens.append(_Token(kind, match.group(), pos))
        pos = match.end()
    return tokens, True


def _block_comment_end(text: str, start: int) -> int:
    """End of the (nested, as PostgreSQL nests them) block comment at ``start``; -1 if open."""
    depth, pos = 0, start
    while pos < len(text):
        if text.startswith("/*", pos):
            depth, pos = depth + 1, pos + 2
        elif text.startswith("*/", pos):
            depth, pos = depth - 1, pos + 2
            if depth == 0:
                return pos
        else:
            pos += 1
    return -1


def _keyword(token: _Token | None) -> str:
    if token is None or token.kind != "word" or not token.text.isascii():
        return "" if token is None else token.text
    return token.text.upper()


def wrap_as_select(query: str) -> str:
    """The grammar layer: ``query`` as a subquery of one ``SELECT``.

    The newlines keep a trailing ``--`` comment in ``query`` from swallowing the parenthesis.
    """
    return f"SELECT * FROM (\n{query}\n) AS ckptstore_query"


def postgres_statement(query: str) -> str:
    """The statement actually sent for ``query``: checked (layer 1) and wrapped (layer 2)."""
    tokens, complete = _pg_tokens(query)
    if not complete:
        raise ConfigError(
            "the query ends inside a string, quoted name or comment; close it (`ckptstore sql` "
            "runs one complete query)"
        )
    tokens, end = _without_trailing_semicolons(tokens, len(query))
    query = query[:end]
    first = tokens[0] if tokens else None
    keyword = _keyword(first)
    if keyword == "EXPLAIN":
        prefix, index = _explain_prefix(tokens)
        body = tokens[index] if index < len(tokens) else None
        if _keyword(body) not in _PG_QUERY_KEYWORDS:
            raise _refuse_kind(_keyword(body), _PG_ACCEPTED)
        assert body is not None
        return f"{prefix} {wrap_as_select(query[body.start :])}"
    if keyword not in _PG_QUERY_KEYWORDS:
        raise _refuse_kind(keyword, _PG_ACCEPTED)
    return wrap_as_select(query)


def _without_trailing_semicolons(tokens: list[_Token], length: int) -> tuple[list[_Token], int]:
    """Drop trailing ``;`` (a habit, harmless); refuse one with a statement after it."""
    end = len(tokens)
    while end and tokens[end - 1].text == ";" and tokens[end - 1].kind == "op":
        end -= 1
    if any(t.kind == "op" and t.text == ";" for t in tokens[:end]):
        raise _one_statement_only(_PG_ACCEPTED)
    return tokens[:end], tokens[end].start if end < len(tokens) else length


def _explain_prefix(tokens: list[_Token]) -> tuple[str, int]:
    """Parse ``EXPLAIN [VERBOSE]`` or ``EXPLAIN (option [value], ...)``; rebuild it from the
    options we know. Returns (prefix, index of the explained query's first token)."""
    index = 1
    nxt = _keyword(tokens[index]) if index < len(tokens) else ""
    if nxt in _ANALYZE:
        raise _refuse_kind(nxt, _PG_ACCEPTED)
    if nxt == "VERBOSE":
        return "EXPLAIN VERBOSE", index + 1
    if index >= len(tokens) or tokens[index].text != "(":
        return "EXPLAIN", index
    options: list[str] = []
    index += 1
    while True:
        name, value, index = _explain_option(tokens, index)
        options.append(f"{name} {value}".strip())
        closing = tokens[index].text if index < len(tokens) else ""
        index += 1
        if closing == ")":
            return f"EXPLAIN ({', '.join(options)})", index
        if closing != ",":
            raise ConfigError("cannot read the EXPLAIN options: write EXPLAIN (option value, ...)")


def _explain_option(tokens: list[_Token], index: int) -> tuple[str, str, int]:
    token = tokens[index] if index < len(tokens) else _Token("op", "", -1)
    name = _keyword(token)
    if name in _ANALYZE:
        raise _refuse_kind(name, _PG_ACCEPTED)
    if token.kind != "word" or name.lower() not in _EXPLAIN_OPTIONS:
        raise ConfigError(
            f"unsupported EXPLAIN option {token.text!r}; `ckptstore sql` accepts "
            f"{', '.join(sorted(_EXPLAIN_OPTIONS))}"
        )
    index += 1
    if index < len(tokens) and tokens[index].kind in ("word", "number", "string"):
        value = tokens[index].text.strip("'").lower()
        if not _OPTION_VALUE.fullmatch(value):
            raise ConfigError(f"unsupported value {tokens[index].text!r} for EXPLAIN {name}")
        return name, value, index + 1
    return name, "", index


# -- PostgreSQL: privileges and execution -------------------------------------------------------

_WHO_AM_I = f"""
SELECT quote_ident(session_user::text),
       (SELECT rolsuper FROM pg_roles WHERE rolname = session_user),
       r.oid IS NOT NULL,
       CASE WHEN r.oid IS NOT NULL THEN pg_has_role(session_user, r.oid, 'MEMBER') END,
       quote_ident(current_schema()),
       (SELECT has_schema_privilege(r.oid, n.oid, 'USAGE')
               AND has_table_privilege(r.oid, c.oid, 'SELECT')
          FROM pg_namespace n JOIN pg_class c ON c.relnamespace = n.oid
         WHERE n.nspname = current_schema() AND c.relname = 'runs')
FROM (SELECT 1) AS one LEFT JOIN pg_roles r ON r.rolname = '{READER_ROLE}'
"""


def grants_sql(schema: str) -> str:
    """What lets ckptstore_reader read the manifest in ``schema`` (a quoted name)."""
    relations = ", ".join(f"{schema}.{name}" for name in MANIFEST_RELATIONS)
    return (
        f"GRANT USAGE ON SCHEMA {schema} TO {READER_ROLE}; "
        f"GRANT SELECT ON {relations} TO {READER_ROLE};"
    )


def _become_reader(cursor: psycopg.Cursor[Any], allow_superuser: bool) -> None:
    import psycopg  # PostgreSQL only: SQLite queries never load the driver

    cursor.execute(_WHO_AM_I)
    row = cursor.fetchone()
    assert row is not None
    login, superuser, role_exists, member, schema, can_read = row
    schema = schema or "<schema>"
    if superuser and not allow_superuser:
        raise ConfigError(
            f"refusing to run as {login}, a PostgreSQL superuser: a superuser can leave any role "
            f"(set_config('role', ...)) and read files or run programs on the server; connect "
            f"as a login that is a member of {READER_ROLE} (GRANT {READER_ROLE} TO <login>;), "
            "or pass --allow-superuser if you are a trusted operator"
        )
    if not role_exists:
        raise ConfigError(
            f"the PostgreSQL role {READER_ROLE}, which `ckptstore sql` runs as, does not exist; "
            "run `ckptstore db upgrade` as a user that may create roles, or have an "
            f"administrator run: CREATE ROLE {READER_ROLE} NOLOGIN; {grants_sql(schema)} "
            f"GRANT {READER_ROLE} TO {login};"
        )
    if not member:
        raise ConfigError(
            f"the PostgreSQL login {login} is not a member of {READER_ROLE}, the read-only role "
            f"`ckptstore sql` runs as; have an administrator run: GRANT {READER_ROLE} TO {login};"
        )
    if can_read is False:
        raise ConfigError(
            f"{READER_ROLE} may not read the manifest in schema {schema}; run `ckptstore db "
            f"upgrade` as the owner of its tables, or have the owner run: {grants_sql(schema)}"
        )
    if superuser:
        log.warning(
            "running `ckptstore sql` as the superuser %s (--allow-superuser): the query runs as "
            "%s, but a superuser can leave that role",
            login,
            READER_ROLE,
        )
    try:
        cursor.execute(f"SET LOCAL ROLE {READER_ROLE}")
    except psycopg.errors.InsufficientPrivilege as exc:
        raise ConfigError(
            f"the PostgreSQL login {login} may not SET ROLE {READER_ROLE} "
            f"({_pg_message(exc)}); have an administrator run: "
            f"GRANT {READER_ROLE} TO {login} WITH SET TRUE;"
        ) from exc


def _postgres(
    url: str, statement: str, timeout: float, allow_superuser: bool
) -> tuple[list[str], list[Sequence[Any]]]:
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
            dbapi.read_only = True
            try:
                with dbapi.cursor() as cursor:
                    _become_reader(cursor, allow_superuser)
                    milliseconds = min(max(1, round(timeout * 1000)), 2**31 - 1)
                    cursor.execute(f"SET LOCAL statement_timeout = {milliseconds}")
                    # prepare=True: the extended protocol, which refuses a second statement.
                    cursor.execute(statement, prepare=True)
                    columns = [d.name for d in cursor.description or []]
                    rows: list[Sequence[Any]] = list(cursor.fetchall()) if columns else []
            finally:
                dbapi.rollback()
            return columns, rows
        finally:
            raw.close()
    except psycopg.errors.QueryCanceled as exc:
        raise _timed_out(timeout) from exc
    except (DBAPIError, psycopg.Error) as exc:
        original = getattr(exc, "orig", None) or exc
        raise DatabaseError(
            f"query failed: {_pg_message(original)} (`ckptstore sql` is read-only)"
        ) from exc
    finally:
        engine.dispose()


def _pg_message(exc: BaseException) -> str:
    """The server's one-line message, without LINE/DETAIL/HINT or driver context."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None)
    if primary:
        return " ".join(str(primary).split())
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _timed_out(timeout: float) -> DatabaseError:
    return DatabaseError(
        f"query timed out after {timeout:g} s and was cancelled; allow longer with "
        "--timeout SECONDS"
    )


# -- SQLite ----------------------------------------------------------------------------------


_SQLITE_WORD = re.compile(r"[A-Za-z_]+")


def _sqlite_words(text: str, count: int) -> list[str]:
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
            match = _SQLITE_WORD.match(text, pos)
            if match is None:
                words.append(text[pos])
                break
            words.append(match.group().upper())
            pos = match.end()
    return words + [""] * (count - len(words))


def check_sqlite_query(query: str) -> None:
    """Layer 1 on SQLite (sqlite3 itself refuses a second statement)."""
    first, second, third, fourth = _sqlite_words(query, 4)
    if first == "EXPLAIN":
        first = fourth if (second, third) == ("QUERY", "PLAN") else second
    if first not in _SQLITE_QUERY_KEYWORDS:
        raise _refuse_kind(first, _SQLITE_ACCEPTED)


def _sqlite(path: str, query: str, timeout: float) -> tuple[list[str], list[Sequence[Any]]]:
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
            conn.set_authorizer(_sqlite_reads_only)
            conn.set_progress_handler(past_deadline, 1000)
            cursor = conn.execute(query)  # refuses more than one statement
            columns = [d[0] for d in cursor.description or []]
            return columns, cursor.fetchall()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        if expired:
            raise _timed_out(timeout) from exc
        raise DatabaseError(
            f"query failed: {str(exc).strip()} (`ckptstore sql` is read-only)"
        ) from exc


_SQLITE_ALLOWED = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
}
#: Functions no query may call: loading code, or (fts3_tokenizer) handing SQLite a pointer.
_SQLITE_DENIED_FUNCTIONS = {"load_extension", "fts3_tokenizer"}


def _sqlite_reads_only(action: int, _arg1: str | None, arg2: str | None, *_rest: object) -> int:
    """SQLite authorizer: reads only (no ATTACH, which would create files, no PRAGMA, ...)."""
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _SQLITE_DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK if action in _SQLITE_ALLOWED else sqlite3.SQLITE_DENY
