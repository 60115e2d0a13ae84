"""``ckptstore gc``: delete blobs that no checkpoint needs (mark, then sweep after a grace)."""

from __future__ import annotations

import argparse
import datetime as dt
import os
from collections.abc import Sequence

from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import Bar, emit, progress
from ckptstore.cli.protocol import Subparsers
from ckptstore.durations import parse_duration
from ckptstore.errors import ConfigError
from ckptstore.formatting import human_bytes
from ckptstore.maintenance.gc import DEFAULT_GRACE, GcReport, collect_garbage
from ckptstore.settings import LOCAL_DIR_ENV
from ckptstore.tiers import TierConfig


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``gc [--dry-run] [--grace G] [--release-corrupt] [--local-dir DIR]``."""
    parser = sub.add_parser("gc", parents=parents)
    parser.add_argument("--dry-run", action="store_true", help="only count what would be deleted")
    parser.add_argument(
        "--grace",
        type=_grace,
        default=DEFAULT_GRACE,
        help=f"leave blobs claimed or condemned within this long (default "
        f"{int(DEFAULT_GRACE.total_seconds() // 3600)}h; e.g. 30s, 15m, 2d, DD:HH:MM:SS)",
    )
    parser.add_argument(
        "--release-corrupt",
        action="store_true",
        help="let blobs that only corrupt checkpoints hold be collected too (by default they "
        "are kept, as `ckptstore verify --recheck` or the next save may repair them)",
    )
    parser.add_argument(
        "--local-dir",
        default=os.environ.get(LOCAL_DIR_ENV),
        help="also clean the node-local tiers this machine reaches ({node} for the node's "
        f"name; default ${LOCAL_DIR_ENV}): objects no copy row knows, older than the grace",
    )
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Collect garbage (or count it, ``--dry-run``) and report each phase."""
    with progress(None, "gc", "item", not args.json) as bar:
        report = collect_garbage(
            ctx.db,
            ctx.store,
            grace=args.grace,
            dry_run=args.dry_run,
            release_corrupt=args.release_corrupt,
            progress=_Phases(bar),
            tiers=TierConfig(local_dir=args.local_dir) if args.local_dir else None,
        )
    emit(args, report, text=_text(report, args.grace))
    return EXIT_OK


#: What the bar says during each phase of a pass (its count: what the phase counts).
PHASES = {
    "mark": "mark (blobs condemned)",
    "sweep": "sweep (blobs deleted)",
    "orphans": "orphans (store objects listed)",
    "incomplete": "unfinished writes",
    "tiers": "node-local tiers",
}


class _Phases:
    """GC's progress callback: names each phase on the bar as it begins, counts its items."""

    def __init__(self, bar: Bar) -> None:
        self.bar, self.current = bar, ""

    def __call__(self, phase: str, count: int) -> None:
        if phase != self.current:
            self.current = phase
            self.bar.phase(PHASES.get(phase, phase))
        self.bar.update(count)


def _text(report: GcReport, grace: dt.timedelta) -> str:
    verb = "would" if report.dry_run else "did"
    lines = [
        f"gc ({'dry run, ' if report.dry_run else ''}grace {grace}):",
        f"  condemn   {report.condemned:6d} blobs  {human_bytes(report.condemned_bytes)}"
        f"  ({verb} mark unreferenced blobs)",
        f"  delete    {report.swept:6d} blobs  {human_bytes(report.swept_bytes)}"
        "  (condemned for longer than the grace)",
        f"  orphans   {report.orphans:6d} objs   {human_bytes(report.orphan_bytes)}"
        "  (objects without a row, older than the grace)",
        f"  unfinished {report.incomplete:5d} writes {human_bytes(report.incomplete_bytes)}"
        "  (temporary files, multipart uploads of writers that died, older than the grace)",
    ]
    if report.tier_nodes:
        lines.append(
            f"  tiers     {report.tier_orphans:6d} objs   {human_bytes(report.tier_orphan_bytes)}"
            f"  (on the tiers of {', '.join(report.tier_nodes)}: known to no copy row)"
        )
    if report.kept_for_corrupt and not report.release_corrupt:
        lines.append(
            f"  kept      {report.kept_for_corrupt:6d} blobs  "
            f"{human_bytes(report.kept_for_corrupt_bytes)}  for {report.corrupt_checkpoints} "
            "corrupt checkpoint(s) (repairable; `ckptstore verify --recheck`, or "
            "--release-corrupt to let them go)"
        )
    elif report.kept_for_corrupt:
        lines.append(
            f"  released  {report.kept_for_corrupt:6d} blobs  "
            f"{human_bytes(report.kept_for_corrupt_bytes)}  of {report.corrupt_checkpoints} "
            "corrupt checkpoint(s) (--release-corrupt: no longer kept for repair)"
        )
    return "\n".join(lines)


def _grace(text: str) -> dt.timedelta:
    """``--grace``: 30s, 15m, 6h, 2d, seconds or DD:HH:MM:SS, up to 3650 days."""
    try:
        return dt.timedelta(seconds=parse_duration(text, what="grace"))
    except ConfigError as exc:
        negative = "; a grace must not be negative" if text.lstrip().startswith("-") else ""
        raise argparse.ArgumentTypeError(f"{exc}{negative}") from None
