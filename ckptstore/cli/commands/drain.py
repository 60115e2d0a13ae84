"""``ckptstore drain RUN[@STEP]``: make a local-durable checkpoint remote-durable.

The blobs the object store does not hold are read from the node-local tiers (``--local-dir``,
``{node}`` standing for each node's name; default ``$CKPTSTORE_LOCAL_DIR``), verified against
their digests, uploaded, and the checkpoint is marked ``committed`` once the store holds every
one. Safe beside the run's own writer: the run is not taken over (its writer epoch stays), and
a drain killed midway leaves the checkpoint local-durable for the next one to finish.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import asdict

from ckptstore.cli.args import parse_target
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK, EXIT_PROBLEMS
from ckptstore.cli.output import emit, progress
from ckptstore.cli.protocol import Subparsers
from ckptstore.durations import parse_duration
from ckptstore.errors import ConfigError
from ckptstore.formatting import human_bytes
from ckptstore.settings import LOCAL_DIR_ENV


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``drain RUN[@STEP] [--local-dir DIR] [--within DURATION]``."""
    parser = sub.add_parser("drain", parents=parents)
    parser.add_argument("target", metavar="RUN[@STEP]", help="the run (its newest local step)")
    parser.add_argument(
        "--local-dir",
        default=os.environ.get(LOCAL_DIR_ENV),
        help=f"the node-local tiers' directory, {{node}} for the node's name (default "
        f"${LOCAL_DIR_ENV})",
    )
    parser.add_argument(
        "--within",
        type=_duration,
        default=None,
        help="send only what ends within this long (e.g. 90s, 10m); the rest stays for the "
        "next drain",
    )
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Drain the checkpoint; exit 1 if it is still local-durable afterwards (a deadline)."""
    name, step = parse_target(args.target)
    if not args.local_dir:
        raise ConfigError(
            f"drain reads the node-local tiers: pass --local-dir DIR (or set ${LOCAL_DIR_ENV}) "
            "as the run's TierConfig.local_dir / checkpointing.local_dir names them"
        )
    store = ctx.store  # a wrong store fails here, in one request, before torch is imported

    from ckptstore.checkpointer.open import open_run
    from ckptstore.tiers import TierConfig

    deadline = None if args.within is None else time.monotonic() + args.within
    tiers = TierConfig(local_dir=args.local_dir)
    with (
        open_run(name, db=ctx.db, store=store, writable=False, tiers=tiers) as opened,
        progress(None, "drain", "B", not args.json) as bar,
    ):
        report = opened.drain(step, deadline=deadline, progress=bar.update)
    if report is None:
        emit(
            args,
            {"run": name, "step": step, "drained": False, "nothing": True},
            text=f"run {name!r} has no local-durable checkpoint to drain",
        )
        return EXIT_OK
    text = (
        f"drained {name}@{report.step}: {report.uploaded_blobs} blob(s), "
        f"{human_bytes(report.uploaded_bytes)} uploaded, {report.present_blobs} already in the "
        f"store, {report.seconds:.2f}s; it is remote-durable"
        if report.drained
        else f"{name}@{report.step} stays local-durable: stopped at {report.stopped}; "
        f"{report.uploaded_blobs} blob(s) ({human_bytes(report.uploaded_bytes)}) sent, run "
        "`ckptstore drain` again for the rest"
    )
    emit(args, {"run": name, **asdict(report)}, text=text)
    return EXIT_OK if report.drained else EXIT_PROBLEMS


def _duration(text: str) -> float:
    try:
        return parse_duration(text, what="--within")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
