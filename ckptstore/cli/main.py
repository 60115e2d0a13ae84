"""``ckptstore``: look after a checkpoint store from the shell.

Exit codes: 0 success, 1 a check found problems, 2 usage or configuration error, 3 a store,
database or integrity error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from ckptstore.checkpointer.run import default_db
from ckptstore.cli.commands import add_commands
from ckptstore.errors import CkptStoreError, ConfigError
from ckptstore.manifest.db import Database, head_revision, known_revisions, redact

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3


def _db(args: argparse.Namespace, *, check_schema: bool = True) -> Database:
    return Database(args.db or default_db(), check_schema=check_schema)


def _emit(args: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    print(json.dumps(payload, default=str) if args.json else text)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    database = _db(args, check_schema=False)
    try:
        before, after = database.upgrade(args.revision)
    finally:
        database.close()
    changed = before != after
    _emit(
        args,
        {"db": redact(database.url), "from": before, "to": after, "changed": changed},
        f"{redact(database.url)}: {before or 'empty'} -> {after}"
        if changed
        else f"{redact(database.url)}: already at {after}",
    )
    return EXIT_OK


def cmd_db_current(args: argparse.Namespace) -> int:
    database = _db(args, check_schema=False)
    try:
        current = database.current_revision()
    finally:
        database.close()
    head = head_revision()
    hint = ""
    if current == head:
        state = "up to date"
    elif current is None:
        state = "empty"
    elif current in known_revisions():
        state, hint = "out of date", "; run `ckptstore db upgrade`"
    else:
        state, hint = "newer", " than this ckptstore; upgrade ckptstore"
    _emit(
        args,
        {"db": redact(database.url), "current": current, "head": head, "state": state},
        f"{redact(database.url)}: revision {current or '-'} (head {head}, {state}{hint})",
    )
    return EXIT_OK if current == head else EXIT_PROBLEMS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptstore",
        description="Inspect and maintain a ckptstore checkpoint store.",
        epilog="The database and store default to $CKPTSTORE_DB / $CKPTSTORE_STORE, else "
        "./.ckptstore/manifest.db and ./.ckptstore/store.",
    )
    parser.add_argument("--db", help="manifest database URL or SQLite path")
    parser.add_argument("--store", help="object store URL or directory")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # --json is accepted before or after the subcommand.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    parents = [common]

    db = sub.add_parser("db", help="manage the manifest database schema")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    up = db_sub.add_parser(
        "upgrade", parents=parents, help="migrate the database to the newest schema"
    )
    up.add_argument("revision", nargs="?", default="head", help="target revision (default head)")
    up.set_defaults(func=cmd_db_upgrade)
    cur = db_sub.add_parser(
        "current", parents=parents, help="show the schema revision (exit 1 if not at head)"
    )
    cur.set_defaults(func=cmd_db_current)
    add_commands(sub, parents)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"ckptstore: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CkptStoreError, KeyError) as exc:
        print(f"ckptstore: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # e.g. piped into head
        return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
