"""``ckptstore show RUN[@STEP]``: one checkpoint, its components and (``--entries``) entries."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptstore.cli.args import parse_target
from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import Column, cell, emit, render, table
from ckptstore.cli.protocol import Subparsers
from ckptstore.formatting import human_bytes
from ckptstore.integrations.formats import format_of
from ckptstore.manifest import reading as reads
from ckptstore.manifest.records import CheckpointInfo, as_dict, field_names
from ckptstore.names import printable

if TYPE_CHECKING:
    from ckptstore.objectstore import ObjectStore

COMPONENT_COLUMNS = (
    Column("component", "name"),
    Column("kind", "kind"),
    Column("entries", "entries"),
    Column("logical", "logical_bytes", human_bytes),
    Column("stored", "stored_bytes", human_bytes),
    Column("index", "index_digest"),
)
#: The components a state-dict listing replaces (their entries are numbered items).
_HELD = {"torch DCP": {"dcp/"}, "Megatron-Core": {"megatron/meta", "megatron/rank"}}
#: Fields the text shows in a line of their own (bytes, timing) or as a table (components);
#: every other field of the record is a "name: value" line, so a new one is shown too.
_SUMMARISED = {
    "components",
    "logical_bytes",
    "stored_bytes",
    "uploaded_bytes",
    "save_seconds",
    "blocked_seconds",
}


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``show RUN[@STEP] [--entries]``."""
    parser = sub.add_parser("show", parents=parents)
    parser.add_argument("target", metavar="RUN[@STEP]")
    parser.add_argument(
        "--entries", action="store_true", help="also list every entry (reads indexes)"
    )
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Show the checkpoint (RUN: the newest committed one); JSON has every field. With
    ``--entries``, a DCP or Megatron checkpoint's state dict is listed by name
    (``state_dict``) instead of its rank components' numbered items."""
    name, step = parse_target(args.target)
    info = reads.checkpoint_or_latest(ctx.db, name, step, local=True)
    payload = as_dict(info)
    payload["durability"] = reads.durability(info.status)
    payload["replicas"] = reads.replica_counts(ctx.db, [info.id]).get(info.id)
    entries: dict[str, list[dict[str, Any]]] = {}
    named: tuple[str, list[dict[str, Any]]] | None = None
    if args.entries:
        named = _state_dict(ctx.store, info)
        entries = _entries(ctx.store, info, skip=set() if named is None else _HELD[named[0]])
        payload["entries"] = entries
        if named is not None:
            payload["state_dict"] = {"format": named[0], "items": named[1]}
    emit(args, payload, text=_text(info, entries, named, payload))
    return EXIT_OK


def _entries(
    store: ObjectStore, info: CheckpointInfo, skip: set[str]
) -> dict[str, list[dict[str, Any]]]:
    """Component name -> its entries, from each component's index (but those whose names
    start with one of ``skip``: rank components listed by state-dict name instead)."""
    # The index alone: a listing reads no tensor and imports no torch.
    from ckptstore.serialize.indexes import fetch_index

    where = f"run {info.run!r}, step {info.step}"
    found = {}
    for comp in info.components:
        if any(comp.name.startswith(prefix) for prefix in skip):
            continue
        found[comp.name] = [
            {
                "path": e.path,
                "kind": e.kind,
                "dtype": e.dtype,
                "shape": list(e.shape),
                "nbytes": e.nbytes,
                **({} if e.is_array else {"value": e.value}),
            }
            for e in fetch_index(
                store, comp.index_digest, context=f"{where}, component {comp.name!r}"
            ).entries
        ]
    return found


def _state_dict(
    store: ObjectStore, info: CheckpointInfo
) -> tuple[str, list[dict[str, Any]]] | None:
    """A DCP or Megatron checkpoint's state dict by name: each tensor's global dtype and shape
    and the ranks whose components hold its data (each value's ranks); None for others."""
    found = format_of(info)
    return None if found is None else (found.title, found.items(store, info))


def _text(
    info: CheckpointInfo,
    entries: dict[str, list[dict[str, Any]]],
    named: tuple[str, list[dict[str, Any]]] | None,
    payload: dict[str, Any],
) -> str:
    lines = [
        f"{name:>14}: {cell(getattr(info, name))}"
        for name in field_names(CheckpointInfo)
        if name not in _SUMMARISED
    ]
    replicas = payload["replicas"]
    lines.append(
        f"{'durability':>14}: {payload['durability'] or '-'}, on "
        f"{'-' if replicas is None else replicas} node-local tier(s)"
    )
    lines.append(
        f"{'bytes':>14}: {human_bytes(info.logical_bytes)} logical, "
        f"{human_bytes(info.stored_bytes)} stored, {human_bytes(info.uploaded_bytes)} uploaded"
    )
    lines.append(
        f"{'timing':>14}: save {info.save_seconds or 0:.3f}s, "
        f"training blocked {info.blocked_seconds or 0:.3f}s"
    )
    lines += ["", render(info.components, COMPONENT_COLUMNS)]
    for comp_name, items in entries.items():
        lines += [f"\n{printable(comp_name)}:"]
        lines.append(
            table(
                ["path", "kind", "dtype", "shape", "bytes"],
                [(e["path"], e["kind"], e["dtype"] or "-", e["shape"], e["nbytes"]) for e in items],
            )
        )
    if named is not None:
        fmt, items = named
        lines += [f"\nstate dict ({fmt}):"]
        lines.append(
            table(
                ["name", "kind", "dtype", "shape", "ranks"],
                [
                    (
                        e["name"],
                        e["kind"],
                        e["dtype"] or "-",
                        "-" if e["shape"] is None else e["shape"],
                        ",".join(map(str, e["ranks"])),
                    )
                    for e in items
                ],
            )
        )
    return "\n".join(lines)
