"""``ckptstore``: look after a checkpoint store from the shell.

Exit codes: 0 success, 1 a check found problems, 2 usage or configuration error, 3 a store,
database or integrity error; an error is one line on stderr, names and paths in it escaped.
Only ``db upgrade`` creates a database; every other command opens the database and the store
that exist and creates neither (a mistyped path is an error, exit 2). An exception of any
other kind is a bug and is left to propagate.

The subcommands are the modules listed in :data:`ckptstore.cli.commands.COMMANDS`; only the
one that runs is imported.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn, cast

from ckptstore.cli.commands import COMMANDS, load
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_ERROR, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE
from ckptstore.cli.protocol import Subparsers
from ckptstore.errors import CkptStoreError, ConfigError
from ckptstore.names import printable

__all__ = [
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "build_parser",
    "error_line",
    "main",
]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error never echoes control characters from the command line."""

    def error(self, message: str) -> NoReturn:
        super().error(error_line(message))


def error_line(message: object) -> str:
    """``message`` on one line, control and invisible characters escaped (an error may echo
    a name or path from the command line, the database or a driver)."""
    text = " ".join(str(message).splitlines())
    return text if text.isprintable() else printable(text)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``ckptstore`` parser: the global options and ``command``'s subparser (its module is
    imported), or, without ``command``, every command by name and help line only -- enough to
    list them and to tell which one a command line invokes, without importing any."""
    parser = _Parser(
        prog="ckptstore",
        description="Inspect and maintain a ckptstore checkpoint store.",
        epilog="The database and store default to $CKPTSTORE_DB / $CKPTSTORE_STORE, else "
        "./.ckptstore/manifest.db and ./.ckptstore/store.",
    )
    parser.add_argument("--db", help="manifest database URL or SQLite path")
    parser.add_argument("--store", help="object store URL or directory")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    # Its parsers are _Parser too (argparse makes them of the parent's class).
    sub = cast(Subparsers, parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    if command is None:
        for name, line in COMMANDS.items():
            # Takes any arguments: they are checked by the command's own parser.
            sub.add_parser(name, help=line, add_help=False)
        return parser
    # --json, --db and --store are accepted before or after the subcommand.
    common = _Parser(add_help=False)
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    common.add_argument("--db", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--store", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    module = load(command)
    module.register(sub, [common]).set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ckptstore ARGV``; returns the exit code."""
    # First which command (``--help`` and a missing or unknown command end here), then its
    # arguments with its own parser.
    command = build_parser().parse_known_args(argv)[0].command
    parser = build_parser(command)
    args = parser.parse_args(argv)
    for key, value in vars(args).items():
        # Python 3.11's argparse turns an attached "--" (`--sample=--`, `-o--`) into [] and
        # skips the option's type; no option here takes a list.
        if isinstance(value, list):
            parser.error(f"argument --{key.replace('_', '-')}: expected one argument")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        with CliContext(args) as ctx:
            return int(args.handler(args, ctx))
    except ConfigError as exc:
        print(f"ckptstore: error: {error_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (CkptStoreError, KeyError) as exc:
        print(f"ckptstore: error: {error_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # e.g. piped into head
        return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
