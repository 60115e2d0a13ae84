"""The directory of a Hugging Face export: what an earlier export left there, and the config
and tokenizer files an imported model brought ("side files"), written back beside the shards.

An export into a directory that an earlier export wrote replaces that export: its shards and
side files (the files its ``model.safetensors.index.json`` names, in ``weight_map`` and in
``metadata["ckptstore_files"]``) that the new export does not write again are removed once the
new index is in place, so the directory never holds old shards beside new ones. Safetensors
files that no earlier index names (a ``model.safetensors`` from ``save_pretrained``, another
tool's shards) are not this export's to remove: the export refuses before writing anything.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstore.errors import ConfigError, SerializationError
from ckptstore.maintenance.safetensors_writer import FILE_MODE
from ckptstore.names import printable

if TYPE_CHECKING:
    from ckptstore.objectstore import ObjectStore

INDEX_NAME = "model.safetensors.index.json"
#: The index metadata key listing the side files an export wrote.
FILES_KEY = "ckptstore_files"
#: A side file's name: one plain file name (no separators, no leading dot).
_SIDE_NAME = re.compile(r"[A-Za-z0-9_+\-][A-Za-z0-9_.+\-]{0,254}")


def previous_export(directory: Path) -> set[str]:
    """The names of the files an earlier export wrote in ``directory`` (none if it holds no
    index). A ConfigError, before anything is written, if ``directory`` holds safetensors files
    that no earlier index names, or an index that is not one."""
    if not directory.is_dir():
        return set()
    where = f"cannot export to '{printable(directory)}'"
    own: set[str] = set()
    index = directory / INDEX_NAME
    if index.exists():
        try:
            document = json.loads(index.read_text())
            shards = document["weight_map"].values()
            files = document.get("metadata", {}).get(FILES_KEY, [])
            own = {*shards, *files}
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise ConfigError(
                f"{where}: its {INDEX_NAME} is not a safetensors index; export into an empty "
                "directory or remove it"
            ) from None
        if not all(isinstance(n, str) and _SIDE_NAME.fullmatch(n) for n in own):
            raise ConfigError(
                f"{where}: its {INDEX_NAME} names files outside the directory; export into an "
                "empty directory or remove it"
            )
        own.add(INDEX_NAME)
    strays = sorted(p.name for p in directory.glob("*.safetensors") if p.name not in own)
    if strays:
        shown = ", ".join(strays[:3]) + (f" and {len(strays) - 3} more" if len(strays) > 3 else "")
        raise ConfigError(
            f"{where}: it holds safetensors files that no earlier export there wrote ({shown}); "
            "export into an empty directory, or remove them first"
        )
    return own


def remove_leftovers(directory: Path, previous: set[str], written: Iterable[Path]) -> list[str]:
    """Remove the files of the earlier export (``previous``) that this one did not write
    again; returns their names."""
    kept = {p.name for p in written}
    removed = []
    for name in sorted(previous - kept):
        path = directory / name
        if path.is_file() and not path.is_symlink():
            path.unlink()
            removed.append(name)
    return removed


def write_side_files(
    store: ObjectStore, index_digest: str, directory: Path, *, context: str = ""
) -> list[Path]:
    """Write each file of a ``files`` component (name -> bytes) into ``directory``; returns
    the files written. Every name is checked (a plain file name that is no shard or index of
    the export) before the first is written."""
    from ckptstore.serialize.reader import ComponentReader

    reader = ComponentReader(store, index_digest, context=context)
    for entry in reader.entries:
        name = entry.path
        if (
            not _SIDE_NAME.fullmatch(name)
            or name == INDEX_NAME
            or name.endswith(".safetensors")
            or entry.kind not in ("bytes", "bytearray")
        ):
            raise SerializationError(
                f"{context}: the stored file {printable(name)!r} ({entry.kind}) is no config or "
                "tokenizer file a model directory holds; refusing to write it"
            )
    written = []
    for entry, value in zip(reader.entries, reader.values(), strict=True):
        written.append(write_bytes(directory / entry.path, bytes(value)))
    return written


def write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary name (mode 0644 less the umask)."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SerializationError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path
