"""``ckptstore db upgrade`` and ``ckptstore db current``: the manifest's schema revision."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK, EXIT_PROBLEMS
from ckptstore.cli.output import emit
from ckptstore.cli.protocol import Subparsers
from ckptstore.manifest.db import head_revision, known_revisions, redact
from ckptstore.names import printable


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``db`` with its actions ``upgrade`` and ``current``."""
    parser = sub.add_parser("db")
    actions = parser.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    up = actions.add_parser(
        "upgrade", parents=parents, help="migrate the database to the newest schema"
    )
    up.add_argument(
        "revision", nargs="?", default="head", type=_revision, help="target revision (default head)"
    )
    actions.add_parser(
        "current", parents=parents, help="show the schema revision (exit 1 if not at head)"
    )
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Run the chosen action."""
    return upgrade(args, ctx) if args.db_command == "upgrade" else current(args, ctx)


def upgrade(args: argparse.Namespace, ctx: CliContext) -> int:
    """Migrate the database to ``args.revision``, creating it if need be."""
    database = ctx.schema_db(create=True)  # the one command that creates a database
    before, after = database.upgrade(args.revision)
    url = printable(redact(database.url))
    emit(
        args,
        {"db": redact(database.url), "from": before, "to": after, "changed": before != after},
        text=f"{url}: {before or 'empty'} -> {after}"
        if before != after
        else f"{url}: already at {after}",
    )
    return EXIT_OK


def current(args: argparse.Namespace, ctx: CliContext) -> int:
    """Show the database's revision against this ckptstore's head; exit 1 if they differ."""
    database = ctx.schema_db()
    revision, head = database.current_revision(), head_revision()
    hint = ""
    if revision == head:
        state = "up to date"
    elif revision is None:
        state = "empty"
    elif revision in known_revisions():
        state, hint = "out of date", "; run `ckptstore db upgrade`"
    else:
        state, hint = "newer", " than this ckptstore; upgrade ckptstore"
    emit(
        args,
        {"db": redact(database.url), "current": revision, "head": head, "state": state},
        text=f"{printable(redact(database.url))}: revision {revision or '-'} "
        f"(head {head}, {state}{hint})",
    )
    return EXIT_OK if revision == head else EXIT_PROBLEMS


def _revision(text: str) -> str:
    """``head`` or a schema revision this ckptstore knows (alembic's relative and branch
    forms are no part of the command line)."""
    if text == "head" or text in known_revisions():
        return text
    raise argparse.ArgumentTypeError(
        f"unknown schema revision '{printable(text)}': use head or one of "
        f"{', '.join(sorted(known_revisions()))}"
    )
