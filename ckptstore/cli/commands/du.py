"""``ckptstore du``: logical versus stored bytes per run, deduplication and compression (the
definitions are :class:`~ckptstore.manifest.reporting.Usage`'s, shared with ``runs``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import RATIOS_HELP, Column, emit, render
from ckptstore.cli.protocol import Subparsers
from ckptstore.formatting import human_bytes, ratio
from ckptstore.maintenance.usage import DiskUsage, disk_usage

COLUMNS = (
    Column("run", "run"),
    Column("ckpts", "checkpoints"),
    Column("logical", "logical_bytes", human_bytes),
    Column("referenced", "referenced_bytes", human_bytes),
    Column("unique", "unique_bytes", human_bytes),
    Column("stored", "stored_bytes", human_bytes),
    Column("dedup", "dedup_ratio", ratio),
    Column("compression", "compression_ratio", ratio),
)


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``du``, without arguments."""
    return sub.add_parser(
        "du",
        parents=parents,
        description="Bytes of each run's committed checkpoints, and of all of them.",
        epilog=RATIOS_HELP,
    )


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Print usage per run and the total over committed checkpoints."""
    runs, total, all_rows = disk_usage(ctx.db)
    usage = DiskUsage.of(runs, total, all_rows)
    emit(
        args,
        usage,
        text=f"{render([*usage.runs, usage.total], COLUMNS)}\n\n"
        f"all blobs in the manifest (incl. unreferenced): {human_bytes(all_rows)}",
    )
    return EXIT_OK
