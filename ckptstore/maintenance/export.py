"""Materialise a checkpoint's components as files other tools read (safetensors or torch)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.errors import ConfigError, SerializationError
from ckptstore.maintenance.safetensors_writer import save_tensors
from ckptstore.names import printable

if TYPE_CHECKING:
    from ckptstore.objectstore import ObjectStore

FORMATS = ("safetensors", "torch")
Progress = Callable[[int], None]


def check_output_dir(directory: str | Path) -> Path:
    """``directory`` if exported files can be written there, checked before any export starts:
    it is a writable directory, or one can be made there (its nearest existing parent is a
    writable directory). Creates nothing; a :class:`ConfigError` names the path otherwise."""
    if not str(directory):
        raise ConfigError(
            "cannot export to '': the directory is an empty string; name one (it is made if "
            "missing)"
        )
    path = Path(directory)
    where = f"'{printable(path)}'"
    try:
        nearest = path.absolute()
        while not os.path.lexists(nearest) and nearest != nearest.parent:
            nearest = nearest.parent
        nearest_is_dir = nearest.is_dir()
        writable = os.access(nearest, os.W_OK | os.X_OK)
    except (OSError, ValueError) as exc:  # too long a name, a NUL byte
        raise ConfigError(f"cannot export to {where}: {exc}") from None
    if not nearest_is_dir:
        raise ConfigError(
            f"cannot export to {where}: it exists and is not a directory"
            if nearest == path.absolute()
            else f"cannot export to {where}: '{printable(nearest)}' is not a directory"
        )
    if not writable:
        raise ConfigError(
            f"cannot export to {where}: '{printable(nearest)}' is not writable; choose another "
            "directory"
        )
    return path


def safe_path(root: Path, name: str, suffix: str) -> Path:
    """``root/name + suffix`` for a component name like ``policy/rank3``, refusing any name
    that could point outside ``root``."""
    parts = name.split("/")
    if any(p in ("", ".", "..") or "\\" in p or "\x00" in p for p in parts):
        raise ConfigError(f"component name '{printable(name)}' cannot be used as a file name")
    path = (root / Path(*parts)).with_name(parts[-1] + suffix)
    resolved_root = root.resolve()
    if not path.resolve().is_relative_to(resolved_root):
        raise ConfigError(f"component name '{printable(name)}' points outside {printable(root)}")
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
    # Imported here: the CLI reads FORMATS and checks paths at start-up without torch.
    import numpy as np
    import torch

    from ckptstore.serialize.reader import ComponentReader

    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {FORMATS}, not {fmt!r}")
    reader = ComponentReader(store, index_digest, context=context)
    for entry in reader.entries:
        _check_tensor_name(entry.path)
    make_dir(path.parent, context)
    if fmt == "torch":
        return _write_file(path, fmt, reader.load(), {}, context)
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, Any] = {}
    for entry, value in zip(reader.entries, reader.values(), strict=True):
        if isinstance(value, torch.Tensor):
            tensors[entry.path] = value.contiguous()
        elif isinstance(value, np.ndarray | np.generic):
            tensors[entry.path] = torch.from_numpy(np.array(value))
        elif isinstance(value, bytes | bytearray):
            tensors[entry.path] = torch.frombuffer(bytearray(value), dtype=torch.uint8)
        else:
            metadata[entry.path] = value if entry.kind == "json" else str(value)
    return _write_file(path, fmt, tensors, metadata, context)


def export_tensors(
    tensors: Iterable[tuple[str, Any]], path: Path, fmt: str, *, context: str = ""
) -> Path:
    """Write whole tensors (name -> tensor; e.g. a multi-rank checkpoint consolidated by its
    integration) as one file in ``fmt``; returns the file written."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {FORMATS}, not {fmt!r}")
    collected: dict[str, Any] = {}
    for name, tensor in tensors:
        _check_tensor_name(name)
        collected[name] = tensor.contiguous()
    make_dir(path.parent, context)
    return _write_file(path, fmt, collected, {}, context)


def make_dir(directory: Path, context: str) -> None:
    """Make ``directory`` and its parents; a ConfigError names it if that fails."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # e.g. a file where a component needs a directory
        raise ConfigError(
            f"{context}: cannot make the directory '{printable(directory)}': {exc.strerror or exc}"
        ) from exc


def _write_file(path: Path, fmt: str, payload: Any, metadata: dict[str, Any], context: str) -> Path:
    """Write ``payload`` (safetensors: name -> tensor, with ``metadata`` as JSON; torch: any
    state) to a temporary name, then rename it into place."""
    import torch

    if fmt == "safetensors":
        values = {"ckptstore.values": json.dumps(metadata, allow_nan=True)}
        return save_tensors(path, payload, values, context=context)
    tmp = path.with_name(f".{path.name}.partial")
    torch.save(payload, tmp)
    tmp.replace(path)
    return path
