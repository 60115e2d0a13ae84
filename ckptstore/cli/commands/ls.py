"""``ckptstore ls RUN``: the checkpoints of a run."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ckptstore.cli.args import lookup_name
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import Column, emit, human_bytes, quoted
from ckptstore.cli.protocol import Subparsers
from ckptstore.manifest import reading as reads
from ckptstore.manifest.statuses import Status

#: The table; ``--json`` has every field of each checkpoint.
COLUMNS = (
    Column("step", "step"),
    Column("status", "status"),
    Column("trigger", "trigger"),
    Column("logical", "logical_bytes", human_bytes),
    Column("uploaded", "uploaded_bytes", human_bytes),
    Column("save s", "save_seconds"),
    Column("blocked s", "blocked_seconds"),
    Column("metrics", "metrics"),
)
#: What retention deleted is history, shown with --all only.
VISIBLE = tuple(status for status in Status if status != Status.DELETED)


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``ls RUN [--all]``."""
    parser = sub.add_parser("ls", parents=parents)
    parser.add_argument("run")
    parser.add_argument(
        "--all", action="store_true", help="include checkpoints deleted by retention"
    )
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """List the run's checkpoints, oldest first."""
    found = reads.require_run(ctx.db, lookup_name(args.run))
    checkpoints = reads.checkpoints(ctx.db, found, None if args.all else VISIBLE)
    emit(
        args,
        checkpoints,
        columns=COLUMNS,
        empty=f"run {quoted(args.run)} has no checkpoints",
    )
    return EXIT_OK
