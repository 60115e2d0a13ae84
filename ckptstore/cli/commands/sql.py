"""``ckptstore sql QUERY``: one read-only query over the manifest (see manifest/readonly.py)."""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from collections.abc import Sequence

from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import csv_value, emit, table
from ckptstore.cli.protocol import Subparsers
from ckptstore.errors import CkptStoreError, DatabaseError
from ckptstore.manifest.readonly import MANIFEST_RELATIONS, run_readonly
from ckptstore.names import printable


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``sql SQL [--format table|csv|json] [--timeout S] [--allow-superuser]``."""
    parser = sub.add_parser("sql", parents=parents)
    parser.add_argument("query", metavar="SQL")
    parser.add_argument("--format", choices=["table", "csv", "json"], default="table")
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="cancel the query after this long (default 30)",
    )
    parser.add_argument(
        "--allow-superuser",
        action="store_true",
        help="PostgreSQL: run even when connected as a superuser (a superuser can leave the "
        "read-only role; never use this for a dashboard)",
    )
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Run the query and print its rows (``--json`` wins over ``--format``)."""
    try:
        columns, rows = run_readonly(
            ctx.db_url, args.query, timeout=args.timeout, allow_superuser=args.allow_superuser
        )
    except DatabaseError as exc:
        hint = _unknown_name_hint(ctx.db_url, args.query, str(exc), args)
        if hint is None:
            raise
        raise DatabaseError(f"{exc}; {hint}") from exc
    if args.format == "csv" and not args.json:
        out = io.StringIO()
        writer = csv.writer(out)
        # Text is escaped as in a table: a name in the manifest must not drive the terminal.
        writer.writerow([printable(c) for c in columns])
        writer.writerows([csv_value(v) for v in row] for row in rows)
        sys.stdout.write(out.getvalue())
        return EXIT_OK
    emit(
        args,
        [dict(zip(columns, row, strict=True)) for row in rows],
        text=table(columns, rows) if columns else "(no result)",
        as_json=args.format == "json",
    )
    return EXIT_OK


#: A query naming a relation or column that does not exist (SQLite's words, PostgreSQL's).
_UNKNOWN_TABLE = re.compile(r"no such table|relation .* does not exist", re.IGNORECASE)
_UNKNOWN_COLUMN = re.compile(r"no such column|column .* does not exist", re.IGNORECASE)


def _unknown_name_hint(url: str, query: str, message: str, args: argparse.Namespace) -> str | None:
    """What the read-only view exposes, for a query that named a table or column it lacks:
    the tables, or the columns of the tables the query names (None for any other error)."""
    if _UNKNOWN_TABLE.search(message):
        found = _relations(url, args)
        return f"the tables and views it can read: {', '.join(found)}" if found else None
    if not _UNKNOWN_COLUMN.search(message):
        return None
    words = set(re.findall(r"[a-z_]+", query.lower()))
    named = [r for r in MANIFEST_RELATIONS if r in words] or ["checkpoints", "runs"]
    columns = {r: _columns(url, r, args) for r in named}
    listed = [f"{r}({', '.join(cols)})" for r, cols in columns.items() if cols]
    return f"the columns: {'; '.join(listed)}" if listed else None


def _relations(url: str, args: argparse.Namespace) -> list[str]:
    """The manifest relations this database has (an older schema lacks the newer ones)."""
    return [r for r in MANIFEST_RELATIONS if _columns(url, r, args)]


def _columns(url: str, relation: str, args: argparse.Namespace) -> list[str]:
    """``relation``'s columns, asked through the same read-only runner ([] if it has none)."""
    try:
        columns, _ = run_readonly(
            url,
            f"SELECT * FROM {relation} LIMIT 0",
            timeout=args.timeout,
            allow_superuser=args.allow_superuser,
        )
    except CkptStoreError:
        return []
    return [printable(c) for c in columns]


def _seconds(text: str) -> float:
    """``--timeout``: seconds, more than 0 and at most a day."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 86400:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: use seconds, 0 < s <= 86400")
    return value
