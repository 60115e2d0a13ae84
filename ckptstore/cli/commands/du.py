"""``ckptstore du``: logical versus stored bytes per run, deduplication and compression (the
definitions are :class:`~ckptstore.manifest.reports.Usage`'s, shared with ``runs``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import RATIOS_HELP, Column, emit, human_bytes, ratio, render
from ckptstore.cli.protocol import Subparsers
from ckptstore.maintenance import Usage, disk_usage


@dataclass(frozen=True, slots=True)
class RunUsage:
    """One line of ``du``: a run's usage (or the total's) with its ratios."""

    run: str
    checkpoints: int
    logical_bytes: int
    referenced_bytes: int
    unique_bytes: int
    stored_bytes: int
    dedup_ratio: float | None
    compression_ratio: float | None

    @classmethod
    def of(cls, usage: Usage) -> RunUsage:
        """The line for ``usage``."""
        return cls(
            usage.name,
            usage.checkpoints,
            usage.logical_bytes,
            usage.referenced_bytes,
            usage.unique_bytes,
            usage.stored_bytes,
            usage.dedup_ratio,
            usage.compression_ratio,
        )


@dataclass(frozen=True, slots=True)
class DiskUsage:
    """What ``du`` shows."""

    runs: list[RunUsage]
    total: RunUsage
    all_blob_rows_stored_bytes: int


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
    usage = DiskUsage([RunUsage.of(u) for u in runs], RunUsage.of(total), all_rows)
    emit(
        args,
        usage,
        text=f"{render([*usage.runs, usage.total], COLUMNS)}\n\n"
        f"all blobs in the manifest (incl. unreferenced): {human_bytes(all_rows)}",
    )
    return EXIT_OK
