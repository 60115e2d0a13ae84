"""``ckptstore sql QUERY``: one read-only query over the manifest (see manifest/readonly.py)."""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections.abc import Sequence

from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import csv_value, emit, table
from ckptstore.cli.protocol import Subparsers
from ckptstore.manifest.readonly import run_readonly
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
    columns, rows = run_readonly(
        ctx.db_url, args.query, timeout=args.timeout, allow_superuser=args.allow_superuser
    )
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


def _seconds(text: str) -> float:
    """``--timeout``: seconds, more than 0 and at most a day."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 86400:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: use seconds, 0 < s <= 86400")
    return value
