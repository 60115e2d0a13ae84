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
from ckptstore.names import printable

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
    lines = [
        render([*usage.runs, usage.total], COLUMNS),
        "",
        f"all blobs in the manifest (incl. unreferenced): {human_bytes(all_rows)}",
    ]
    larger = [u.run for u in usage.runs if u.stored_bytes > u.logical_bytes]
    if larger:
        lines.append(STORED_OVER_LOGICAL.format(runs=", ".join(map(printable, larger))))
    emit(args, usage, text="\n".join(lines))
    return EXIT_OK


#: Why stored can exceed logical while compression is above 1.00x (said when it does).
STORED_OVER_LOGICAL = (
    "note: stored > logical for {runs}: blobs also hold indexes, pack tables and headers, "
    "which logical (tensor data only) leaves out; compression (unique / stored) counts them "
    "on both sides, so it can be above 1.00x all the same"
)
