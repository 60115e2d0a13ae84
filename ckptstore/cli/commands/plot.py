"""``ckptstore plot RUN --metric M -o FILE``: a metric against step, with checkpoint markers."""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptstore.cli.args import lookup_name
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import emit, quoted
from ckptstore.cli.protocol import Subparsers
from ckptstore.errors import CheckpointNotFoundError, ConfigError
from ckptstore.manifest import reading as reads
from ckptstore.manifest import reporting as reports
from ckptstore.manifest.records import RunInfo
from ckptstore.manifest.reporting import MetricPoint
from ckptstore.manifest.statuses import Status
from ckptstore.names import printable


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``plot RUN --metric M -o FILE``."""
    parser = sub.add_parser("plot", parents=parents)
    parser.add_argument("run")
    parser.add_argument("--metric", required=True, help="metric name, e.g. train:reward")
    parser.add_argument("-o", "--output", required=True, help="image file to write (e.g. out.png)")
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Draw the metric of the run's committed and deleted checkpoints into the file."""
    _check_output(args.output)
    metric = lookup_name(args.metric, "metric name")
    found = reads.require_run(ctx.db, lookup_name(args.run))
    points = reports.metric_points(ctx.db, found.id, metric)
    if not points:
        known = _metric_names(ctx, found)
        raise CheckpointNotFoundError(
            f"run {quoted(args.run)} has no checkpoint with metric {quoted(metric)}; "
            + (
                f"its metrics: {', '.join(map(printable, known))}"
                if known
                else "its checkpoints record no numeric metric (run.save(..., metrics={...}))"
            )
        )
    _save(points, f"{printable(args.run)}: {printable(metric)}", printable(metric), args.output)
    emit(args, {"file": args.output, "points": len(points)}, text=printable(args.output))
    return EXIT_OK


def _metric_names(ctx: CliContext, found: RunInfo) -> list[str]:
    """The numeric metrics the run's committed and deleted checkpoints record, sorted."""
    names: set[str] = set()
    for info in reads.checkpoints(ctx.db, found, (Status.COMMITTED, Status.DELETED)):
        metrics = info.metrics if isinstance(info.metrics, dict) else {}
        names.update(
            name
            for name, value in metrics.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        )
    return sorted(names)


def _check_output(text: str) -> Path:
    """``-o``'s file, checked before the database is touched: a known image format in a
    directory that exists and can be written."""
    from matplotlib.figure import Figure

    formats = sorted(Figure().canvas.get_supported_filetypes())
    if not text:
        raise ConfigError("plot -o/--output is empty: name an image file, e.g. loss.png")
    path = Path(text)
    suffix = path.suffix.lower().removeprefix(".")
    if suffix not in formats:
        raise ConfigError(
            f"plot -o {quoted(text)}: "
            + (f"unknown image format '.{printable(suffix)}'" if suffix else "no file extension")
            + f"; use one of {', '.join('.' + f for f in formats)}"
        )
    parent = path.parent
    try:
        parent_exists, parent_is_dir, is_dir = parent.exists(), parent.is_dir(), path.is_dir()
        writable = os.access(parent, os.W_OK | os.X_OK)
    except (OSError, ValueError) as exc:  # too long a name, a NUL byte
        raise ConfigError(f"plot -o {quoted(text)}: {exc}") from None
    if not parent_is_dir:
        raise ConfigError(
            f"plot -o {quoted(text)}: {quoted(parent)} is not a directory"
            if parent_exists
            else f"plot -o {quoted(text)}: the directory {quoted(parent)} does not exist; "
            "create it first"
        )
    if is_dir or not writable:
        raise ConfigError(f"plot -o {quoted(text)}: cannot write a file there")
    return path


def _save(points: list[MetricPoint], title: str, label: str, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Names are drawn as they are: no mathtext for a '$' in them, no glyph for a control one.
    with matplotlib.rc_context({"text.parse_math": False}):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        try:
            _draw(ax, points, label)
            ax.set_title(title)
            fig.tight_layout()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Glyph .* missing from", UserWarning)
                fig.savefig(output, dpi=120)
        except OSError as exc:
            raise ConfigError(f"plot -o {quoted(output)}: {exc.strerror or exc}") from exc
        finally:
            plt.close(fig)


def _draw(ax: Any, points: list[MetricPoint], label: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.plot([p.step for p in points], [p.value for p in points], color="tab:blue", label=label)
    kept = [p for p in points if p.status == Status.COMMITTED]
    gone = [p for p in points if p.status == Status.DELETED]
    ax.scatter(
        [p.step for p in kept],
        [p.value for p in kept],
        marker="o",
        color="tab:green",
        zorder=3,
        label="checkpoint (kept)",
    )
    if gone:
        ax.scatter(
            [p.step for p in gone],
            [p.value for p in gone],
            marker="x",
            color="tab:gray",
            zorder=3,
            label="checkpoint (deleted by retention)",
        )
    # Steps are whole numbers: no tick at 2.5 when a run has three checkpoints.
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend()
