"""Reading a torch DCP ``FileSystemWriter`` directory into whole tensors and plain values,
without unpickling: ``.metadata`` and the ``torch.save``-d items go through the allowlist
unpickler of :mod:`._dcp_pickle`, and every chunk's place is checked against the metadata
(chunks tile their tensor, byte ranges lie inside their files) before it is read."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ckptstore.errors import CkptStoreError, SerializationError
from ckptstore.extending import WRONG_METADATA, check_shape, check_tiling
from ckptstore.integrations.importing._dcp_pickle import load_metadata, load_torch_saved

#: How every torch.save file (a zip archive) begins.
_ZIP = b"PK\x03\x04"
#: Called with the bytes of each item read (a progress bar's update).
Progress = Callable[[int], None]


def read_dcp(path: Path, progress: Progress | None = None) -> dict[str, Any]:
    """fqn -> whole tensor or plain value, from a DCP ``FileSystemWriter`` directory
    (``progress`` is called with the bytes of each item read)."""
    where = str(path / ".metadata")
    metadata = load_metadata((path / ".metadata").read_bytes(), where)
    try:
        return _read_items(path, metadata, where, progress)
    except CkptStoreError:  # the reader's own errors (some are TypeErrors too) say it better
        raise
    except (AttributeError, TypeError) as exc:
        # The allowlist unpickler rebuilds DCP's metadata objects from what the file says,
        # without their constructors: a crafted file can leave out a field or give it the
        # wrong type. Either is the file's error, said in one line.
        raise SerializationError(
            f"{where}: malformed DCP metadata ({type(exc).__name__}: {exc})"
        ) from None


def _read_items(
    path: Path, metadata: Metadata, where: str, progress: Progress | None
) -> dict[str, Any]:
    """:func:`read_dcp` once the metadata is unpickled."""
    entries, storage = _checked_metadata(metadata, where)
    state: dict[str, Any] = {}
    for fqn, md in entries.items():
        if isinstance(md, BytesStorageMetadata):
            info = _info(storage, MetadataIndex(fqn), where)
            value = load_torch_saved(_item_bytes(path, info), f"{path}: item {fqn!r}")
            if isinstance(value, torch.Tensor):
                raise SerializationError(f"{path}: item {fqn!r} is a tensor saved as a byte item")
            state[fqn] = value
            if progress is not None:
                progress(info.length)
        else:
            state[fqn] = _whole_tensor(path, fqn, md, storage, where, progress)
    return state


def _checked_metadata(
    metadata: Metadata, where: str
) -> tuple[dict[str, TensorStorageMetadata | BytesStorageMetadata], dict[Any, Any]]:
    """The metadata's entries and storage map, their types and tiling checked."""
    entries = metadata.state_dict_metadata
    storage = metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise SerializationError(f"{where}: malformed metadata (no state dict or storage map)")
    for fqn, md in entries.items():
        if not isinstance(fqn, str):
            raise SerializationError(f"{where}: an entry's name is a {type(fqn).__name__}")
        if isinstance(md, TensorStorageMetadata):
            _check_tensor(fqn, md, where)
        elif not isinstance(md, BytesStorageMetadata):
            raise SerializationError(f"{where}: entry {fqn!r} is a {type(md).__name__}")
    return entries, storage


def _check_tensor(fqn: str, md: TensorStorageMetadata, where: str) -> None:
    what = f"{where}: tensor {fqn!r}"
    dtype = getattr(md.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise SerializationError(f"{what} has no dtype")
    if getattr(md.properties, "layout", torch.strided) != torch.strided:
        raise SerializationError(f"{what} is not a dense (strided) tensor")
    try:
        check_shape(list(md.size), dtype.itemsize, what)
        check_tiling(list(md.size), [(list(c.offsets), list(c.sizes)) for c in md.chunks], what)
    except CkptStoreError as exc:
        message = str(exc).removesuffix(WRONG_METADATA).rstrip()
        raise SerializationError(f"{message} -- the source checkpoint is inconsistent") from None


def _info(storage: dict[Any, Any], index: MetadataIndex, where: str) -> _StorageInfo:
    """Where an item's bytes are: a file of the directory itself, a non-negative range."""
    info = storage.get(index)
    what = f"{where}: item {index.fqn!r}" + ("" if index.offset is None else f" {index.offset}")
    if not isinstance(info, _StorageInfo):
        raise SerializationError(f"{what} has no storage location")
    name = info.relative_path
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in ("..", "."):
        raise SerializationError(f"{what} is stored at {name!r}, not a file of the directory")
    if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
        raise SerializationError(f"{what} has a malformed byte range")
    if info.transform_descriptors:
        raise SerializationError(
            f"{what} was written through DCP stream extensions {info.transform_descriptors}; "
            "re-save it without _extensions to import it"
        )
    return info


def _item_bytes(path: Path, info: _StorageInfo) -> bytes:
    file = path / info.relative_path
    end = info.offset + info.length
    try:
        with file.open("rb") as stream:
            # The claimed range against the file before anything is read (a crafted length
            # would otherwise be allocated and read first).
            if end > os.fstat(stream.fileno()).st_size:
                raise SerializationError(f"{file}: ends before byte {end} (truncated?)")
            stream.seek(info.offset)
            data = stream.read(info.length)
    except OSError as exc:
        raise SerializationError(f"{file}: cannot be read ({exc})") from None
    if len(data) != info.length:
        raise SerializationError(f"{file}: ends before byte {end} (truncated?)")
    return data


def _whole_tensor(
    path: Path,
    fqn: str,
    md: TensorStorageMetadata,
    storage: dict[Any, Any],
    where: str,
    progress: Progress | None,
) -> torch.Tensor:
    """The tensor ``fqn`` put together from its chunks (which tile it: checked)."""
    dtype = md.properties.dtype
    full = torch.empty(tuple(md.size), dtype=dtype)
    for chunk in md.chunks:
        info = _info(storage, MetadataIndex(fqn, chunk.offsets), where)
        data = _item_bytes(path, info)
        sizes = tuple(chunk.sizes)
        what = f"{path}: chunk {list(chunk.offsets)} of {fqn!r}"
        part = _chunk(data, dtype, sizes, what)
        box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, sizes, strict=True))
        full[box] = part
        if progress is not None:
            progress(info.length)
    return full


def _chunk(data: bytes, dtype: torch.dtype, sizes: tuple[int, ...], what: str) -> torch.Tensor:
    """One chunk, from its ``torch.save`` file (read without unpickling)."""
    if not data.startswith(_ZIP):
        # SerializationFormat.SAFETENSORS appends one safetensors blob per file and records
        # ranges that do not hold the tensors: reading them would import garbage.
        raise SerializationError(
            f"{what} is not a torch.save file: the directory was probably written with "
            "FileSystemWriter(serialization_format=SAFETENSORS), which import does not read; "
            "re-save it with the default torch_save format"
        )
    tensor = load_torch_saved(data, what)
    if not isinstance(tensor, torch.Tensor):
        raise SerializationError(f"{what} holds a {type(tensor).__name__}, not a tensor")
    if tensor.dtype != dtype or tuple(tensor.shape) != sizes:
        raise SerializationError(
            f"{what} holds {tensor.dtype} {list(tensor.shape)}; the metadata says "
            f"{dtype} {list(sizes)}"
        )
    return tensor
