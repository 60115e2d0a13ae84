"""Materialise a checkpoint's components as files other tools read (safetensors or torch)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptstore.errors import ConfigError, SerializationError
from ckptstore.objectstore import ObjectStore
from ckptstore.serialize.load import load_component, load_entries, read_index

FORMATS = ("safetensors", "torch")
Progress = Callable[[int], None]


def safe_path(root: Path, name: str, suffix: str) -> Path:
    """``root/name + suffix`` for a component name like ``policy/rank3``, refusing any name
    that could point outside ``root``."""
    parts = name.split("/")
    if any(p in ("", ".", "..") or "\\" in p or "\x00" in p for p in parts):
        raise ConfigError(f"component name {name!r} cannot be used as a file name")
    path = (root / Path(*parts)).with_name(parts[-1] + suffix)
    resolved_root = root.resolve()
    if not path.resolve().is_relative_to(resolved_root):
        raise ConfigError(f"component name {name!r} points outside {root}")
    return path


def _check_tensor_name(name: str) -> None:
    if any(p in ("..", ".") for p in name.split("/")) or name.startswith("/") or "\x00" in name:
        raise SerializationError(
            f"tensor name {name!r} looks like a path outside the export directory; refusing "
            "to export it"
        )


def export_component(
    store: ObjectStore, index_digest: str, path: Path, fmt: str, *, context: str = ""
) -> Path:
    """Write one component to ``path`` in ``fmt``; returns the file written."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {FORMATS}, not {fmt!r}")
    index = read_index(store, index_digest, context=context)
    for entry in index.entries:
        _check_tensor_name(entry.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    if fmt == "torch":
        torch.save(load_component(store, index_digest, context=context), tmp)
    else:
        from safetensors.torch import save_file

        values = load_entries(store, index, range(len(index.entries)), context=context)
        tensors: dict[str, torch.Tensor] = {}
        metadata: dict[str, Any] = {}
        for i, entry in enumerate(index.entries):
            value = values[i]
            if isinstance(value, torch.Tensor):
                tensors[entry.path] = value.contiguous()
            elif isinstance(value, np.ndarray | np.generic):
                tensors[entry.path] = torch.from_numpy(np.array(value))
            elif isinstance(value, bytes | bytearray):
                tensors[entry.path] = torch.frombuffer(bytearray(value), dtype=torch.uint8)
            else:
                metadata[entry.path] = value if entry.kind == "json" else str(value)
        try:
            save_file(
                tensors,
                str(tmp),
                metadata={"ckptstore.values": json.dumps(metadata, allow_nan=True)},
            )
        except (ValueError, TypeError, RuntimeError) as exc:
            tmp.unlink(missing_ok=True)
            raise SerializationError(
                f"{context}: safetensors cannot hold this component ({exc}); use --format torch"
            ) from exc
    tmp.replace(path)
    return path
