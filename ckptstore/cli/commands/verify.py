"""``ckptstore verify [RUN[@STEP]]``: re-hash checkpoints' blobs; mark damaged ones corrupt."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckptstore.cli.args import DIGITS, parse_target
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK, EXIT_PROBLEMS
from ckptstore.cli.output import emit, human_bytes, jsonable, progress, quoted
from ckptstore.cli.protocol import Subparsers
from ckptstore.manifest import reads
from ckptstore.names import printable

if TYPE_CHECKING:
    from ckptstore.maintenance import VerifyReport


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``verify [RUN[@STEP]] [--sample N] [--no-mark] [--recheck]``."""
    parser = sub.add_parser(
        "verify",
        parents=parents,
    )
    parser.add_argument("target", nargs="?", metavar="RUN[@STEP]", help="default: every run")
    parser.add_argument(
        "--sample", type=_sample, metavar="N", help="check N random blobs per checkpoint"
    )
    parser.add_argument("--no-mark", action="store_true", help="report only; change nothing")
    parser.add_argument(
        "--recheck",
        action="store_true",
        help="also re-verify checkpoints marked corrupt, in full; those whose every blob "
        "verifies again (a good copy was saved again or restored) are committed again",
    )
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Verify; exit 1 if any problem remains."""
    from ckptstore.maintenance import verify  # torch: imported only by this command

    name, step = parse_target(args.target) if args.target is not None else (None, None)
    if name is not None:
        reads.require_run(ctx.db, name)  # a typo is an error, not "0 checkpoints: OK"
    with progress(None, "verify", "blob", not args.json) as bar:
        report = verify(
            ctx.db,
            ctx.store,
            run=name,
            step=step,
            sample=args.sample,
            mark_corrupt=not args.no_mark,
            recheck=args.recheck,
            progress=bar.update,
        )
    payload = jsonable(report) | {
        "corrupt_checkpoints": [{"run": r, "step": s} for r, s in report.corrupt_checkpoints],
        "repaired": [{"run": r, "step": s} for r, s in report.repaired],
    }
    emit(args, payload, text=_text(report, marked=not args.no_mark))
    return EXIT_PROBLEMS if report.problems else EXIT_OK


def _text(report: VerifyReport, *, marked: bool) -> str:
    lines = [
        f"{p.kind.upper()}: run {quoted(p.run)} step {p.step} "
        f"component {quoted(p.component)}: {printable(p.key)}"
        for p in report.problems
    ]
    lines += [
        f"REPAIRED: run {quoted(run)} step {step} is committed again"
        for run, step in report.repaired
    ]
    verdict = (
        "OK"
        if not report.problems
        else f"{len(report.problems)} problem(s) in {len(report.corrupt_checkpoints)} "
        "checkpoint(s)" + (", marked corrupt" if marked else "")
    )
    lines.append(
        f"verified {report.checkpoints} checkpoint(s), {report.blobs_checked} blob(s), "
        f"{human_bytes(report.bytes_checked)}: {verdict}"
    )
    return "\n".join(lines)


def _sample(text: str) -> int:
    """``--sample``: a whole number of blobs per checkpoint, at least 1."""
    if not DIGITS.fullmatch(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"invalid sample size {quoted(text)}: use a whole number >= 1 (blobs per checkpoint)"
        )
    return int(text)
