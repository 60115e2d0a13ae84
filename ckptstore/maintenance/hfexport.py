"""Streaming a consolidated checkpoint into safetensors files: one file, or Hugging Face shards
(``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``).

The files are planned before any tensor data is read: names, dtypes and shapes come from the
checkpoint's metadata, a ``--map`` function is called once per tensor with a ``meta`` tensor
(shape and dtype, no data) to learn what it makes of it, and the shards are cut at
``shard_size`` in checkpoint order. Then every file's header is written and each tensor is put
together from its stored pieces, mapped, converted and written at its place before the next one
is read, so the peak memory is about the largest tensor (twice that where ``--dtype`` converts
it), whatever the size of a shard or of the model.

A map function takes ``(name, tensor)`` and returns the new name (a ``str``), ``None`` to leave
the tensor out, or an iterable of ``(name, tensor)`` pairs made from the tensor (views: one per
layer of a stacked tensor, the parts of a fused one). It must return the same names and shapes
whether the tensor is a ``meta`` tensor or a real one.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstore.errors import ConfigError, SerializationError
from ckptstore.maintenance.export import make_dir
from ckptstore.maintenance.hfdir import (
    FILES_KEY,
    INDEX_NAME,
    previous_export,
    remove_leftovers,
    write_side_files,
)
from ckptstore.maintenance.safetensors_writer import FILE_MODE, SafetensorsFile, TensorSpec

if TYPE_CHECKING:
    import torch

    from ckptstore.maintenance.export_sources import SourceTensor
    from ckptstore.objectstore import ObjectStore

#: What a map function returns: a new name, None (leave the tensor out), or (name, tensor) pairs.
MapResult = str | Iterable[tuple[str, "torch.Tensor"]] | None
MapFunction = Callable[[str, "torch.Tensor"], MapResult]
#: The worked example of a map (Megatron-Core GPT -> Hugging Face GPT-NeoX names).
EXAMPLE_MAP = "ckptstore.maintenance.hfnames:megatron_to_hf"
#: --dtype's names.
DTYPE_NAMES = ("bf16", "fp16", "fp32")
#: Hugging Face's default shard size (``max_shard_size="5GB"``).
DEFAULT_SHARD_SIZE = 5_000_000_000
#: The metadata Hugging Face loaders require of a PyTorch safetensors file.
HF_METADATA = {"format": "pt"}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}

Plan = list[tuple["SourceTensor", list[TensorSpec]]]


def parse_size(text: str) -> int:
    """A size like ``5GB``, ``500MiB`` or ``1000000`` in bytes (ConfigError naming
    --shard-size otherwise)."""
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number) :].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not 0 < value < 2**63 or int(value * _UNITS[unit]) < 1:
        raise ConfigError(
            f"--shard-size {text!r} is not a size; give bytes or a number with a unit "
            "(5GB, 500MB, 2GiB)"
        )
    return int(value * _UNITS[unit])


def load_map(spec: str) -> MapFunction:
    """The function ``module:function`` names (imported: it runs that module's code)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--map {spec!r} must be module:function, e.g. {EXAMPLE_MAP}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # its own code may raise anything, a SyntaxError included
        raise ConfigError(
            f"--map {spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})"
        ) from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise ConfigError(f"--map {spec!r}: {module_name} has no function {attr!r}")
    return function  # type: ignore[no-any-return]


def target_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype a --dtype name means (None: keep each tensor's own)."""
    import torch

    if name is None:
        return None
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in dtypes:
        raise ConfigError(f"--dtype must be one of {DTYPE_NAMES}, not {name!r}")
    return dtypes[name]


def _mapped(
    mapping: MapFunction | None, name: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """What ``mapping`` makes of one tensor, as (name, tensor) pairs."""
    import torch

    if mapping is None:
        return [(name, tensor)]
    try:
        result = mapping(name, tensor)
        pairs = (
            []
            if result is None
            else [(result, tensor)]
            if isinstance(result, str)
            else [(str(n), t) for n, t in result]
        )
    except Exception as exc:
        raise ConfigError(f"--map failed on tensor {name!r}: {type(exc).__name__}: {exc}") from exc
    for new_name, value in pairs:
        if not isinstance(value, torch.Tensor) or not new_name:
            raise ConfigError(
                f"--map returned {new_name!r}: {type(value).__name__} for tensor {name!r}; it "
                "must return a name, None, or (name, tensor) pairs"
            )
    return pairs


def plan(
    sources: Iterable[SourceTensor], mapping: MapFunction | None, dtype: torch.dtype | None
) -> Plan:
    """Each source tensor that is written and the tensors it becomes (from ``meta`` tensors:
    nothing is read)."""
    import torch

    planned: Plan = []
    names: set[str] = set()
    for source in sources:
        meta = torch.empty(source.shape, dtype=source.dtype, device="meta")
        specs = []
        for name, value in _mapped(mapping, source.name, meta):
            if name in names:
                raise ConfigError(f"two tensors would be named {name!r}; check --map or --prefix")
            names.add(name)
            specs.append(TensorSpec(name, _converted(value.dtype, dtype), tuple(value.shape)))
        if specs:
            planned.append((source, specs))
    if not planned:
        raise ConfigError("no tensor is left to export; check --map and --prefix")
    return planned


def _converted(dtype: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """--dtype applies to floating-point tensors; integers and booleans keep theirs."""
    return target if target is not None and dtype.is_floating_point else dtype


def cut_shards(planned: Plan, shard_size: int) -> list[list[TensorSpec]]:
    """The tensors of each shard, in order; a shard closes before the tensor that would take it
    past ``shard_size`` (a larger tensor gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for _, specs in planned:
        for spec in specs:
            if shards[-1] and size + spec.nbytes > shard_size:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += spec.nbytes
    return shards


def write_files(
    store: ObjectStore,
    planned: Plan,
    files: list[tuple[Path, list[TensorSpec]]],
    *,
    mapping: MapFunction | None,
    context: str,
    progress: Callable[[], None] | None = None,
) -> list[Path]:
    """Write ``files`` (each a path and its tensors), one tensor at a time; returns the paths."""
    from ckptstore.maintenance.export_sources import PieceReader

    where = {spec.name: n for n, (_, specs) in enumerate(files) for spec in specs}
    reader = PieceReader(store, (source for source, _ in planned), context)
    with ExitStack() as stack:
        opened = [
            stack.enter_context(SafetensorsFile(path, specs, HF_METADATA, context=context))
            for path, specs in files
        ]
        for source, specs in planned:
            pairs = _mapped(mapping, source.name, reader.assemble(source))
            if [name for name, _ in pairs] != [spec.name for spec in specs]:
                raise ConfigError(
                    f"--map named the parts of {source.name!r} differently for its data than "
                    "for its shape; it must depend on the name and shape alone"
                )
            for (name, value), spec in zip(pairs, specs, strict=True):
                opened[where[name]].write(name, value.to(spec.dtype))
            del pairs
            if progress is not None:
                progress()
        return [f.commit() for f in opened]


def export_hf(
    store: ObjectStore,
    sources: list[SourceTensor],
    directory: Path,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    mapping: MapFunction | None = None,
    context: str = "",
    progress: Callable[[], None] | None = None,
    files_digest: str | None = None,
) -> list[Path]:
    """Hugging Face shards and their index under ``directory``, with the config and tokenizer
    files of the ``files`` component ``files_digest`` (an imported model's); returns the files
    written (the index last). An earlier export's files there that this one does not write
    again are removed after the new index is in place; safetensors files no earlier export
    wrote are refused before anything is written (:mod:`ckptstore.maintenance.hfdir`)."""
    planned = plan(sources, mapping, dtype)
    shards = cut_shards(planned, shard_size)
    count = len(shards)
    files = [
        (directory / f"model-{n:05d}-of-{count:05d}.safetensors", specs)
        for n, specs in enumerate(shards, start=1)
    ]
    previous = previous_export(directory)
    make_dir(directory, context)
    written = write_files(
        store, planned, files, mapping=mapping, context=context, progress=progress
    )
    side = (
        []
        if files_digest is None
        else write_side_files(store, files_digest, directory, context=context)
    )
    weight_map = {spec.name: path.name for path, specs in files for spec in specs}
    metadata: dict[str, object] = {"total_size": sum(s.nbytes for _, specs in files for s in specs)}
    if side:
        metadata[FILES_KEY] = [p.name for p in side]
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    index_path = write_text(directory / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    remove_leftovers(directory, previous, [*written, *side, index_path])
    return [*written, *side, index_path]


def export_single(
    store: ObjectStore,
    sources: list[SourceTensor],
    path: Path,
    *,
    dtype: torch.dtype | None = None,
    mapping: MapFunction | None = None,
    context: str = "",
    progress: Callable[[], None] | None = None,
) -> Path:
    """Every tensor in the one safetensors file ``path``, written as the shards are."""
    planned = plan(sources, mapping, dtype)
    files = [(path, [spec for _, specs in planned for spec in specs])]
    make_dir(path.parent, context)
    [written] = write_files(
        store, planned, files, mapping=mapping, context=context, progress=progress
    )
    return written


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary name (mode 0644 less the umask)."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SerializationError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path
