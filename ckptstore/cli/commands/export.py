"""``ckptstore export RUN@STEP DIR``: a checkpoint's components as safetensors or torch files."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ckptstore.cli.args import parse_target
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import emit, progress, quoted
from ckptstore.cli.protocol import Subparsers
from ckptstore.errors import ConfigError
from ckptstore.maintenance import export_component
from ckptstore.maintenance.export import FORMATS, check_output_dir, export_tensors, safe_path
from ckptstore.manifest import reads
from ckptstore.names import printable

if TYPE_CHECKING:
    from ckptstore.manifest.records import CheckpointInfo
    from ckptstore.objectstore import ObjectStore


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``export RUN@STEP DIR [--format safetensors|torch]``."""
    parser = sub.add_parser(
        "export",
        parents=parents,
        description=(
            "Write each component of RUN@STEP as a file under DIR. A checkpoint saved through "
            "torch DCP or Megatron-Core from several ranks is consolidated instead: its whole "
            "tensors, under their state-dict names, in DIR/consolidated.safetensors (or .pt)."
        ),
    )
    parser.add_argument("target", metavar="RUN@STEP")
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("--format", choices=FORMATS, default="safetensors")
    parser.add_argument(
        "--prefix",
        metavar="KEY",
        help=(
            "consolidated checkpoints only: export just the tensors named KEY.<name>, as <name> "
            "(e.g. --prefix model after saving {'model': model.state_dict(), ...}, for names "
            "that model.load_state_dict and Hugging Face loaders accept)"
        ),
    )
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
    consolidated = consolidated_tensors(ctx.store, info)
    if consolidated is None and args.prefix is not None:
        raise ConfigError(
            "--prefix applies to checkpoints saved through torch DCP or Megatron-Core; "
            f"{quoted(name)} step {info.step} holds plain components (one file each)"
        )
    if consolidated is not None:
        if args.prefix is not None:
            consolidated = strip_prefix(consolidated, args.prefix)
        # A multi-rank checkpoint (torch DCP, Megatron): its shards put together, one file.
        path = out / f"consolidated{suffix}"
        context = f"run {quoted(name)}, step {step}"
        exported = export_tensors(consolidated, path, args.format, context=context)
        emit(args, {"files": [str(exported)]}, text=printable(str(exported)))
        return EXIT_OK
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


def consolidated_tensors(
    store: ObjectStore, info: CheckpointInfo
) -> Iterator[tuple[str, Any]] | None:
    """The whole tensors of a multi-rank checkpoint (DCP or Megatron), None for any other."""
    names = {c.name for c in info.components}
    if "dcp/metadata" in names:
        from ckptstore.integrations import dcp

        return dcp.iter_full_tensors(store, info)
    if "megatron/meta" in names:
        with warnings.catch_warnings():
            # Megatron announces at import that Apex and Transformer Engine are missing:
            # nothing an export uses.
            warnings.filterwarnings("ignore", "Transformer Engine and Apex", UserWarning)
            from ckptstore.integrations import megatron

        return megatron.iter_full_tensors(store, info)
    return None


def strip_prefix(tensors: Iterator[tuple[str, Any]], key: str) -> Iterator[tuple[str, Any]]:
    """Only the tensors under ``key.``, renamed without it; none at all is an error."""
    head = key.rstrip(".") + "."
    found = False
    for name, tensor in tensors:
        if name.startswith(head):
            found = True
            yield name[len(head) :], tensor
    if not found:
        raise ConfigError(f"no tensor is named {head}<name> in this checkpoint; check --prefix")
