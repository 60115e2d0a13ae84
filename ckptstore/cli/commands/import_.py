"""``ckptstore import SRC RUN@STEP``: a torch DCP directory or Hugging Face safetensors as a
checkpoint of the store (the command is ``import``; ``import`` is a Python keyword)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ckptstore.cli.args import parse_target
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import emit, progress, quoted
from ckptstore.cli.protocol import Subparsers
from ckptstore.errors import ConfigError
from ckptstore.formatting import human_bytes
from ckptstore.names import check_run_name, printable
from ckptstore.settings import default_store


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``import SRC RUN@STEP [--prefix KEY]``."""
    parser = sub.add_parser(
        "import",
        parents=parents,
        description=(
            "Store the checkpoint at SRC as step STEP of run RUN (created if new; opening it "
            "as its writer fences any other writer of RUN). SRC is a torch DCP directory "
            "written by FileSystemWriter (it holds .metadata and *.distcp), a .safetensors "
            "file, or a directory of safetensors (model.safetensors.index.json and its "
            "shards, or one file); a directory's config and tokenizer files (config.json, "
            "tokenizer.json, ...) are kept with it and written back by export --hf. The "
            "database and store are made if missing. The result is a DCP checkpoint: load it with "
            "ckptstore.integrations.dcp.load, resharded to any world size, or start a run "
            "from it with open_run(..., fork_from='RUN@STEP'). Nothing is unpickled: DCP's "
            "pickles are read by an allowlist that admits DCP's metadata classes, dtypes and "
            "plain values only; any other name in them is refused and nothing is stored."
        ),
    )
    parser.add_argument("source", metavar="SRC")
    parser.add_argument("target", metavar="RUN@STEP")
    parser.add_argument(
        "--prefix",
        metavar="KEY",
        help=(
            "safetensors only: store each tensor as KEY.<name> (e.g. --prefix model, to load "
            "with ckpt_dcp.load({'model': model.state_dict()}, run))"
        ),
    )
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Import SRC; print what was stored."""
    from ckptstore.integrations.importing import check_source  # no torch: answers path errors

    name, step = parse_target(args.target)
    if step is None:
        raise ConfigError("import needs RUN@STEP: the step to store the checkpoint as")
    check_run_name(name)
    fmt = check_source(args.source, args.prefix)
    # Imported here, once the arguments are known good: torch and the DCP wrappers.
    from ckptstore.checkpointer.open import open_run
    from ckptstore.integrations.importing import import_checkpoint, weight_bytes

    # The database and store are made if missing, as by a first save: an import is one.
    store = args.store if args.store is not None else default_store()
    total = weight_bytes(Path(args.source), fmt)
    with (
        open_run(name, db=ctx.db_location, store=store, writable=True, async_save=False) as opened,
        progress(total, "import", "B", not args.json) as bar,
    ):
        report = import_checkpoint(
            args.source,
            opened,
            step,
            prefix=args.prefix,
            progress=bar.update,
            storing=lambda: bar.phase("storing"),
        )
    info = report.checkpoint
    payload = {
        "source": report.source,
        "format": report.format,
        "run": info.run,
        "step": info.step,
        "tensors": report.tensors,
        "values": report.values,
        "files": list(report.files),
        "logical_bytes": info.logical_bytes,
        "stored_bytes": info.stored_bytes,
    }
    kept = f", {len(report.files)} config/tokenizer files" if report.files else ""
    text = (
        f"imported {printable(report.source)} ({report.format}) as {quoted(info.run)} step "
        f"{info.step}: {report.tensors} tensors, {report.values} values{kept}, "
        f"{human_bytes(info.logical_bytes)} logical, {human_bytes(info.stored_bytes)} stored"
    )
    emit(args, payload, text=text)
    return EXIT_OK
