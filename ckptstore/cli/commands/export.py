"""``ckptstore export RUN@STEP DIR``: a checkpoint's components as safetensors or torch files."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ckptstore.cli.args import parse_target
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import emit, progress, quoted
from ckptstore.cli.protocol import Subparsers
from ckptstore.errors import ConfigError
from ckptstore.maintenance import export_component
from ckptstore.maintenance.export import FORMATS, check_output_dir, safe_path
from ckptstore.manifest import reads
from ckptstore.names import printable


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``export RUN@STEP DIR [--format safetensors|torch]``."""
    parser = sub.add_parser(
        "export", parents=parents, help="write a checkpoint's components as files"
    )
    parser.add_argument("target", metavar="RUN@STEP")
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("--format", choices=FORMATS, default="safetensors")
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Write one file per component under DIR; print their paths."""
    name, step = parse_target(args.target)
    if step is None:
        raise ConfigError("export needs RUN@STEP (use `ckptstore latest RUN` for the step)")
    # Checked before anything is opened; the directory is made only for a checkpoint that exists.
    out = check_output_dir(args.directory)
    info = reads.checkpoint_or_latest(ctx.db, name, step)
    suffix = ".safetensors" if args.format == "safetensors" else ".pt"
    # Every name is checked before the first file is written.
    targets = [(c, safe_path(out, c.name, suffix)) for c in info.components]
    written: list[str] = []
    with progress(len(targets), "export", "component", not args.json) as bar:
        for comp, path in targets:
            context = f"run {quoted(name)}, step {step}, component {quoted(comp.name)}"
            exported = export_component(
                ctx.store, comp.index_digest, path, args.format, context=context
            )
            written.append(str(exported))
            bar.update()
    emit(args, {"files": written}, text="\n".join(map(printable, written)))
    return EXIT_OK
