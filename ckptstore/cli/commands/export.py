"""``ckptstore export RUN@STEP DIR``: a checkpoint's components as safetensors or torch files,
or a DCP/Megatron checkpoint consolidated into one file or Hugging Face shards (``--hf``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstore.cli.args import parse_target
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import emit, progress, quoted
from ckptstore.cli.protocol import Subparsers
from ckptstore.errors import ConfigError
from ckptstore.integrations._common.names import HF_FILES
from ckptstore.integrations.formats import format_of
from ckptstore.maintenance import export_component
from ckptstore.maintenance.export import FORMATS, check_output_dir, export_tensors, safe_path
from ckptstore.maintenance.hfexport import (
    DEFAULT_SHARD_SIZE,
    DTYPE_NAMES,
    EXAMPLE_MAP,
    MapFunction,
    load_map,
    parse_size,
)
from ckptstore.manifest import reading as reads
from ckptstore.names import printable

if TYPE_CHECKING:
    from ckptstore.maintenance.export_sources import SourceTensor
    from ckptstore.manifest.records import CheckpointInfo
    from ckptstore.objectstore import ObjectStore


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``export RUN@STEP DIR [--format safetensors|torch] [--hf ...]``."""
    parser = sub.add_parser(
        "export",
        parents=parents,
        description=(
            "Write each component of RUN@STEP as a file under DIR. A checkpoint saved through "
            "torch DCP or Megatron-Core from several ranks is consolidated instead: its whole "
            "tensors, under their state-dict names, in DIR/consolidated.safetensors (or .pt), "
            "or with --hf as Hugging Face shards (model-0000k-of-0000N.safetensors and "
            "model.safetensors.index.json), with the config and tokenizer files an imported "
            "model brought (config.json, tokenizer.json, ...), so transformers' "
            "from_pretrained(DIR) loads it. Exporting --hf again into the same DIR replaces "
            "the earlier export's files; safetensors files no export wrote there are refused. "
            "Safetensors files are written one tensor at a time: memory holds about the "
            "largest tensor, not the model."
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
    parser.add_argument(
        "--hf",
        action="store_true",
        help="consolidated checkpoints only: Hugging Face safetensors shards and their index",
    )
    parser.add_argument(
        "--shard-size",
        metavar="SIZE",
        help="with --hf: the most bytes per shard (default 5GB; 500MB, 2GiB, or bytes)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        help="consolidated safetensors only: convert floating-point tensors to this dtype",
    )
    parser.add_argument(
        "--map",
        metavar="MODULE:FUNCTION",
        help=(
            "consolidated safetensors only: rename (or split, or leave out) tensors with "
            f"FUNCTION(name, tensor), e.g. {EXAMPLE_MAP} (Megatron-Core GPT -> GPT-NeoX)"
        ),
    )
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Write one file per component under DIR (or the consolidated file(s)); print their paths."""
    name, step = parse_target(args.target)
    if step is None:
        raise ConfigError("export needs RUN@STEP (use `ckptstore latest RUN` for the step)")
    shard_size, mapping = check_consolidation_options(args)
    # Checked before anything is opened; the directory is made only for a checkpoint that exists.
    out = check_output_dir(args.directory)
    info = reads.checkpoint_or_latest(ctx.db, name, step)
    sources = consolidated_sources(ctx.store, info)
    if sources is None:
        used = [o for o in ("prefix", "hf", "shard_size", "dtype", "map") if getattr(args, o)]
        if used:
            raise ConfigError(
                f"--{used[0].replace('_', '-')} applies to checkpoints saved through torch DCP "
                f"or Megatron-Core; {quoted(name)} step {info.step} holds plain components "
                "(one file each)"
            )
        return export_components(args, ctx, info, out)
    if args.prefix is not None:
        from ckptstore.maintenance.export_sources import with_prefix

        sources = with_prefix(sources, args.prefix)
    context = f"run {quoted(name)}, step {info.step}"
    files = next((c.index_digest for c in info.components if c.name == HF_FILES), None)
    written = export_consolidated(
        args, ctx, sources, out, context, shard_size, mapping, files_digest=files
    )
    emit(args, {"files": written}, text="\n".join(map(printable, written)))
    return EXIT_OK


def check_consolidation_options(args: argparse.Namespace) -> tuple[int, MapFunction | None]:
    """The shard size and map function the options ask for, checked before anything is
    opened (the map's module is imported now, so a typo fails first)."""
    if args.format == "torch" and (args.hf or args.dtype or args.map):
        option = "--hf" if args.hf else "--dtype" if args.dtype else "--map"
        raise ConfigError(f"{option} writes safetensors; leave out --format torch")
    if args.shard_size is not None and not args.hf:
        raise ConfigError("--shard-size applies to --hf exports; add --hf")
    shard_size = DEFAULT_SHARD_SIZE if args.shard_size is None else parse_size(args.shard_size)
    return shard_size, None if args.map is None else load_map(args.map)


def export_components(
    args: argparse.Namespace, ctx: CliContext, info: CheckpointInfo, out: Path
) -> int:
    """One file per component of a plain checkpoint."""
    suffix = ".safetensors" if args.format == "safetensors" else ".pt"
    # Every name is checked before the first file is written.
    targets = [(c, safe_path(out, c.name, suffix)) for c in info.components]
    written: list[str] = []
    with progress(len(targets), "export", "component", not args.json) as bar:
        for comp, path in targets:
            context = f"run {quoted(info.run)}, step {info.step}, component {quoted(comp.name)}"
            exported = export_component(
                ctx.store, comp.index_digest, path, args.format, context=context
            )
            written.append(str(exported))
            bar.update()
    emit(args, {"files": written}, text="\n".join(map(printable, written)))
    return EXIT_OK


def export_consolidated(
    args: argparse.Namespace,
    ctx: CliContext,
    sources: list[SourceTensor],
    out: Path,
    context: str,
    shard_size: int,
    mapping: MapFunction | None,
    *,
    files_digest: str | None = None,
) -> list[str]:
    """A multi-rank checkpoint's whole tensors: HF shards (with the config and tokenizer files
    of the ``files`` component ``files_digest``, an imported model's), one safetensors file
    (both written tensor by tensor), or one torch file."""
    from ckptstore.maintenance import hfexport
    from ckptstore.maintenance.export_sources import iter_assembled

    if args.format == "torch":
        tensors = iter_assembled(ctx.store, sources, context)
        return [str(export_tensors(tensors, out / "consolidated.pt", "torch", context=context))]
    dtype = hfexport.target_dtype(args.dtype)
    with progress(len(sources), "export", "tensor", not args.json) as bar:
        if args.hf:
            files = hfexport.export_hf(
                ctx.store,
                sources,
                out,
                shard_size=shard_size,
                dtype=dtype,
                mapping=mapping,
                context=context,
                progress=bar.update,
                files_digest=files_digest,
            )
            return [str(f) for f in files]
        path = hfexport.export_single(
            ctx.store,
            sources,
            out / "consolidated.safetensors",
            dtype=dtype,
            mapping=mapping,
            context=context,
            progress=bar.update,
        )
        return [str(path)]


def consolidated_sources(store: ObjectStore, info: CheckpointInfo) -> list[SourceTensor] | None:
    """The whole tensors of a multi-rank checkpoint (DCP or Megatron), None for any other."""
    found = format_of(info)
    return None if found is None else found.tensors(store, info)
