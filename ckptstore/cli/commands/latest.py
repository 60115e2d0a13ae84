"""``ckptstore latest RUN``: the newest committed step of a run."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ckptstore.cli.args import lookup_name
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import emit
from ckptstore.cli.protocol import Subparsers
from ckptstore.manifest import reading as reads


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``latest RUN``."""
    parser = sub.add_parser("latest", parents=parents)
    parser.add_argument("run")
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Print the step (a script's ``$(ckptstore latest RUN)``), or run, step and time as JSON."""
    info = reads.checkpoint_or_latest(ctx.db, lookup_name(args.run), None)
    emit(
        args,
        {"run": info.run, "step": info.step, "committed_at": info.committed_at},
        text=str(info.step),
    )
    return EXIT_OK
