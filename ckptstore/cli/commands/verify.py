"""``ckptstore verify [RUN[@STEP]]``: re-hash checkpoints' blobs; mark damaged ones corrupt.

Exit 1 while anything is wrong: damage or unreadable blobs found now, or a checkpoint still
marked corrupt from before (until it is repaired or released), so that a CI gate on the exit
code stays red over a broken run.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckptstore.cli.args import DIGITS, parse_target
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK, EXIT_PROBLEMS
from ckptstore.cli.output import emit, jsonable, progress, quoted
from ckptstore.cli.protocol import Subparsers
from ckptstore.formatting import human_bytes
from ckptstore.manifest import reading as reads
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
    """Verify; exit 1 if any problem remains, or any checkpoint is still marked corrupt."""
    name, step = parse_target(args.target) if args.target is not None else (None, None)
    if name is not None:
        reads.require_run(ctx.db, name)  # a typo is an error, not "0 checkpoints: OK"
    # A wrong database or store fails here, in one request, before torch is imported.
    db, store = ctx.db, ctx.store

    from ckptstore.maintenance import verify  # torch: imported only by this command

    with progress(None, "verify", "blob", not args.json) as bar:
        if args.recheck:
            bar.phase("recheck")
        report = verify(
            db,
            store,
            run=name,
            step=step,
            sample=args.sample,
            mark_corrupt=not args.no_mark,
            recheck=args.recheck,
            progress=bar.update,
            planned=lambda total: bar.phase("blobs", total),
        )
    pairs = {"corrupt_checkpoints": report.corrupt_checkpoints, "repaired": report.repaired}
    payload = jsonable(report) | {
        name: [{"run": r, "step": s} for r, s in found] for name, found in pairs.items()
    }
    payload["marked"] = [{"run": r, "step": s} for r, s in report.marked]
    payload["still_corrupt"] = [
        {"run": r, "step": s, "error": why} for r, s, why in report.still_corrupt
    ]
    emit(args, payload, text=_text(report, no_mark=args.no_mark))
    return EXIT_OK if report.ok else EXIT_PROBLEMS


#: How much of why a checkpoint was marked corrupt a STILL CORRUPT line shows.
REASON_CHARS = 240
#: How a corrupt checkpoint stops being one (see checkpointer/repair.py and ``gc``).
REPAIR_HINT = (
    "  to repair: store good bytes again (save the same state again, or put the object back "
    "under its key), then `ckptstore verify --recheck`; to give up on it: "
    "`ckptstore gc --release-corrupt`"
)


def _text(report: VerifyReport, *, no_mark: bool) -> str:
    lines = []
    for p in report.problems:
        lines.append(
            f"{p.kind.upper()}: run {quoted(p.run)} step {p.step} "
            f"component {quoted(p.component)}: {printable(p.key)}"
        )
        if p.kind == "unreadable":
            lines.append(f"  not marked (not proven damaged): {printable(p.detail)}")
        elif p.kind == "metadata":
            lines.append(f"  the metadata is wrong, no blob moved: {printable(p.detail)}")
    lines += [
        f"REPAIRED: run {quoted(run)} step {step} is committed again"
        for run, step in report.repaired
    ]
    lines += [
        f"STILL CORRUPT: run {quoted(run)} step {step} is still marked corrupt: "
        + printable(why if len(why) <= REASON_CHARS else why[:REASON_CHARS] + "...")
        for run, step, why in report.still_corrupt
    ]
    if report.marked or report.still_corrupt:
        lines.append(REPAIR_HINT)
    lines.append(
        f"verified {report.checkpoints} checkpoint(s), {report.blobs_checked} blob(s), "
        f"{human_bytes(report.bytes_checked)}: {_verdict(report, no_mark=no_mark)}"
    )
    return "\n".join(lines)


def _verdict(report: VerifyReport, *, no_mark: bool) -> str:
    if report.ok:
        return "OK"
    found = []
    if report.problems:
        marked = "not marked (--no-mark)" if no_mark else f"{len(report.marked)} marked corrupt"
        found.append(
            f"{len(report.problems)} problem(s) in {len(report.corrupt_checkpoints)} "
            f"checkpoint(s), {marked}"
        )
    if report.still_corrupt:
        found.append(f"{len(report.still_corrupt)} checkpoint(s) still marked corrupt")
    return "; ".join(found)


def _sample(text: str) -> int:
    """``--sample``: a whole number of blobs per checkpoint, at least 1."""
    if not DIGITS.fullmatch(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"invalid sample size {quoted(text)}: use a whole number >= 1 (blobs per checkpoint)"
        )
    return int(text)
