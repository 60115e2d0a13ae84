"""``ckptstore ls RUN``: the checkpoints of a run."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptstore.cli.args import lookup_name
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import Column, compact_metrics, emit, quoted
from ckptstore.cli.protocol import Subparsers
from ckptstore.formatting import human_bytes
from ckptstore.manifest import reading as reads
from ckptstore.manifest.records import CheckpointInfo, as_dict
from ckptstore.manifest.statuses import Status

#: The table; ``--json`` has every field of each checkpoint.
COLUMNS = (
    Column("step", "step"),
    Column("status", "status"),
    Column("durability", "durability", lambda d: d or "-"),
    Column("replicas", "replicas", lambda n: "-" if n is None else n),
    Column("trigger", "trigger"),
    Column("logical", "logical_bytes", human_bytes),
    Column("uploaded", "uploaded_bytes", human_bytes),
    Column("save s", "save_seconds"),
    Column("blocked s", "blocked_seconds"),
    Column("metrics", "metrics", compact_metrics),
)


@dataclass(frozen=True, slots=True)
class Listed:
    """A checkpoint as ``ls`` lists it: its record, what it survives, and on how many nodes'
    tiers its least-copied blob is."""

    info: CheckpointInfo
    durability: str | None
    replicas: int | None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.info, name)

    def as_json(self) -> dict[str, Any]:
        """Every field of the record, with ``durability`` and ``replicas``."""
        return {**as_dict(self.info), "durability": self.durability, "replicas": self.replicas}


def listed(ctx: CliContext, checkpoints: Sequence[CheckpointInfo]) -> list[Listed]:
    """``checkpoints`` with their durability and replica counts (one query for all)."""
    replicas = reads.replica_counts(ctx.db, [c.id for c in checkpoints])
    return [Listed(c, reads.durability(c.status), replicas.get(c.id)) for c in checkpoints]


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
    checkpoints = listed(ctx, reads.checkpoints(ctx.db, found, None if args.all else VISIBLE))
    emit(
        args,
        [c.as_json() for c in checkpoints] if args.json else checkpoints,
        columns=COLUMNS,
        empty=f"run {quoted(args.run)} has no checkpoints",
    )
    return EXIT_OK
