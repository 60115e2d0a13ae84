"""``ckptstore``: look after a checkpoint store from the shell.

Exit codes (:data:`ckptstore.cli.exits.MEANINGS`, printed by ``--help``): 0 success, 1 a check
found problems, 2 usage or configuration error, 3 not found (an unknown run or step) or a store,
database or integrity error. An error is one line on stderr, names and paths in it escaped; with
``--json`` it is also a JSON object on stdout, ``{"error": {"type", "message", "exit_code"}}``,
argparse's usage errors included. Only ``db upgrade`` creates a database; every other command
opens the database and the store that exist and creates neither (a mistyped path is an error,
exit 2). An exception of any other kind is a bug and is left to propagate.

The subcommands are the modules listed in :data:`ckptstore.cli.commands.COMMANDS`; only the
one that runs is imported.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, cast

from ckptstore.cli.commands import COMMANDS, load
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_ERROR, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, MEANINGS
from ckptstore.cli.output import show_progress
from ckptstore.cli.protocol import Subparsers
from ckptstore.errors import CkptStoreError, ConfigError
from ckptstore.formatting import dumps
from ckptstore.names import printable
from ckptstore.settings import package_version

__all__ = [
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "UsageExit",
    "build_parser",
    "error_line",
    "main",
]


_EPILOG = "\n".join(
    [
        "The database and store default to $CKPTSTORE_DB / $CKPTSTORE_STORE, else",
        "./.ckptstore/manifest.db and ./.ckptstore/store.",
        "",
        "exit codes:",
        *(f"  {code}  {meaning}" for code, meaning in MEANINGS.items()),
        "",
        "An error is one line on stderr; with --json it is also printed on stdout as",
        '{"error": {"type": ..., "message": ..., "exit_code": ...}}.',
    ]
)


class _Version(argparse.Action):
    """``--version``: the installed package's version, looked up only when asked (the lookup
    would cost every command tens of milliseconds)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_args: object) -> None:
        print(f"{parser.prog} {package_version()}")
        parser.exit()


class UsageExit(SystemExit):
    """argparse's exit (code 2) after a usage error, with the error's one line."""

    def __init__(self, message: str) -> None:
        """The exit for ``message`` (already one escaped line)."""
        super().__init__(EXIT_USAGE)
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error never echoes control characters from the command line, and
    ends in :class:`UsageExit` so that ``main`` can report it as JSON too."""

    def error(self, message: str) -> NoReturn:
        line = error_line(message)
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {line}\n")
        raise UsageExit(line)


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
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    parser.add_argument("--db", help="manifest database URL or SQLite path")
    parser.add_argument("--store", help="object store URL or directory")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log what each command does and how long each phase takes (INFO on stderr); "
        "implies --progress",
    )
    parser.add_argument(
        "--progress",
        action="store_true",
        help="show progress bars on stderr even when it is not a terminal (a log, CI); "
        "without it they show on a terminal only, and never with --json",
    )
    # Its parsers are _Parser too (argparse makes them of the parent's class).
    sub = cast(Subparsers, parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    if command is None:
        for name, line in COMMANDS.items():
            # Takes any arguments: they are checked by the command's own parser.
            sub.add_parser(name, help=line, add_help=False)
        return parser
    # --json, --db, --store, -v and --progress are accepted before or after the subcommand.
    common = _Parser(add_help=False)
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    for flag in (("-v", "--verbose"), ("--progress",)):
        common.add_argument(
            *flag, action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    common.add_argument("--db", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--store", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    module = load(command)
    module.register(sub, [common]).set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ckptstore ARGV``; returns the exit code. Without ``argv`` this is the process's
    own command line (the ``ckptstore`` script, ``python -m ckptstore``), which ends soon
    after: see :func:`_exit_soon`."""
    if argv is None:
        try:
            return _main(sys.argv[1:])
        finally:
            _exit_soon()
    return _main(list(argv))


def _exit_soon() -> None:
    """Spare the exiting process the collector's passes over every object: with torch loaded
    they take 1.5-3 s after the command's last line (an error included). Everything the
    command opened is closed by now and the atexit handlers still run; only a process that
    ends now may do this (an in-process caller, a test, keeps collecting)."""
    gc.freeze()


def _main(argv: list[str]) -> int:
    try:
        args = _parse(argv)
    except UsageExit as exc:
        if _wants_json(argv):
            print(dumps(_error_object("UsageError", exc.message, EXIT_USAGE)))
        raise
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # Bars go to stderr: on a terminal, or anywhere when asked; never beside JSON.
    show_progress(False if args.json else (True if args.verbose or args.progress else None))
    try:
        with CliContext(args) as ctx:
            return int(args.handler(args, ctx))
    except ConfigError as exc:
        return _failed(exc, EXIT_USAGE, args.json)
    except (CkptStoreError, KeyError) as exc:
        return _failed(exc, EXIT_ERROR, args.json)
    except BrokenPipeError:  # e.g. piped into head
        return EXIT_OK


def _parse(argv: list[str]) -> argparse.Namespace:
    # First which command (``--help``, ``--version`` and a missing or unknown command end
    # here), then its arguments with its own parser.
    command = build_parser().parse_known_args(argv)[0].command
    parser = build_parser(command)
    args = parser.parse_args(argv)
    for key, value in vars(args).items():
        # Python 3.11's argparse turns an attached "--" (`--sample=--`, `-o--`) into [] and
        # skips the option's type; no option here takes a list.
        if isinstance(value, list):
            parser.error(f"argument --{key.replace('_', '-')}: expected one argument")
    return args


def _failed(exc: BaseException, code: int, as_json: bool) -> int:
    line = error_line(exc)
    print(f"ckptstore: error: {line}", file=sys.stderr)
    if as_json:
        print(dumps(_error_object(type(exc).__name__, line, code)))
    return code


def _error_object(kind: str, message: str, code: int) -> dict[str, dict[str, object]]:
    return {"error": {"type": kind, "message": message, "exit_code": code}}


def _wants_json(argv: Sequence[str]) -> bool:
    """Whether a command line that argparse refused asked for ``--json`` (or an abbreviation
    argparse accepts), before any ``--``."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return any(len(a) >= 3 and "--json".startswith(a) for a in options)


if __name__ == "__main__":
    raise SystemExit(main())
