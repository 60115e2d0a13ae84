"""``ckptstore runs``: one line per run."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import RATIOS_HELP, Column, emit
from ckptstore.cli.protocol import Subparsers
from ckptstore.formatting import human_bytes, ratio
from ckptstore.manifest import reporting as reports

COLUMNS = (
    Column("run", "run"),
    Column("ckpts", "checkpoints"),
    Column("committed", "committed"),
    Column("failed", "failed"),
    Column("corrupt", "corrupt"),
    Column("deleted", "deleted"),
    Column("latest", "latest_step"),
    Column("metric", "metric_name", lambda name: name or "-"),
    Column("best", "best_metric"),
    Column("logical", "logical_bytes", human_bytes),
    Column("stored", "stored_bytes", human_bytes),
    Column("dedup", "dedup_ratio", ratio),
)


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``runs``, without arguments."""
    return sub.add_parser(
        "runs",
        parents=parents,
        description="One line per run: checkpoints (all, committed, failed, corrupt, deleted by "
        "retention: rows kept for history), the newest committed step, the best value of the "
        "run's metric, and the bytes of its committed checkpoints.",
        epilog=RATIOS_HELP,
    )


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """List every run's summary."""
    emit(args, reports.run_summaries(ctx.db), columns=COLUMNS, empty="no runs yet")
    return EXIT_OK
