"""Import a checkpoint written elsewhere: a torch DCP ``FileSystemWriter`` directory or Hugging
Face safetensors (one file, or an index and its shards).

Either way the result is an ordinary DCP checkpoint of the run, saved through
:func:`ckptstore.integrations.dcp.save` from this one process, so ``ckpt_dcp.load`` reshards
it to any layout and ``open_run(..., fork_from="RUN@STEP")`` may start from it. Its state-dict
names are the source's: DCP's fqns (``model.layers.0.weight``), or the safetensors names
(with ``prefix.`` in front when a prefix is given, to load into ``{"model": ...}``).

Nothing is pickled or unpickled: DCP's ``.metadata`` and its ``torch.save``-d items are read by
an allowlist unpickler that runs nothing (:mod:`ckptstore.maintenance._dcp_pickle`), and
safetensors are read by the ``safetensors`` package. Everything is read and checked before
anything is stored, so a refused source leaves no checkpoint. The tensors are held in memory
whole while they are saved: an import needs about the checkpoint's size in free memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ConfigError,
    SerializationError,
)
from ckptstore.maintenance._dcp_pickle import (
    ForbiddenPickleError,
    load_metadata,
    load_torch_saved,
)
from ckptstore.manifest.models import Trigger
from ckptstore.manifest.records import CheckpointInfo
from ckptstore.serialize.tiling import WRONG_METADATA, check_shape, check_tiling

if TYPE_CHECKING:
    from ckptstore.checkpointer.run import Run

__all__ = ["FORMATS", "ForbiddenPickleError", "ImportReport", "detect_format", "import_checkpoint"]

#: What an import reads: a DCP FileSystemWriter directory, or Hugging Face safetensors.
FORMATS = ("dcp", "safetensors")
_SAFETENSORS = ".safetensors"
#: How every torch.save file (a zip archive) begins.
_ZIP = b"PK\x03\x04"


@dataclass(frozen=True, slots=True)
class ImportReport:
    """What an import stored: the committed checkpoint and what went into it."""

    source: str
    format: str
    tensors: int
    values: int
    checkpoint: CheckpointInfo


def import_checkpoint(
    source: str | Path, run: Run, step: int, *, prefix: str | None = None
) -> ImportReport:
    """Store the checkpoint at ``source`` as ``step`` of ``run`` (a writable run) and commit it.

    ``source`` is a DCP directory (it holds ``.metadata``), a ``.safetensors`` file, or a
    directory of safetensors (``*.safetensors.index.json`` and its shards, or one file).
    ``prefix`` puts ``prefix.`` before every safetensors name. Raises ``ConfigError`` for a
    source that is neither or a step the run already has, ``ForbiddenPickleError`` (a
    ``SerializationError``) for a pickle that asks for more than DCP's metadata, and
    ``SerializationError`` for any other unreadable item -- in every case before anything is
    stored.
    """
    # Imported here: the DCP wrappers start torch.distributed.
    from ckptstore.integrations import dcp as ckpt_dcp

    path = Path(source)
    fmt = detect_format(path)
    _check_step_free(run, step)
    if fmt == "dcp":
        if prefix is not None:
            raise ConfigError("prefix applies to safetensors imports; DCP keeps its own names")
        state = read_dcp(path)
    else:
        state = read_safetensors(path, prefix)
    info = ckpt_dcp.save(
        state,
        run,
        step,
        trigger=Trigger.MANUAL,
        training_info={"imported_from": str(path), "import_format": fmt},
    )
    assert isinstance(info, CheckpointInfo)  # a synchronous save on the coordinator
    tensors = sum(isinstance(v, torch.Tensor) for v in state.values())
    return ImportReport(str(path), fmt, tensors, len(state) - tensors, info)


def detect_format(path: Path) -> str:
    """``"dcp"`` or ``"safetensors"`` for the source at ``path``; ``ConfigError`` otherwise."""
    if path.is_file() and path.name.endswith(_SAFETENSORS):
        return "safetensors"
    if not path.is_dir():
        raise ConfigError(f"import source {str(path)!r} is not a directory or .safetensors file")
    if (path / ".metadata").is_file():
        return "dcp"
    if any(path.glob("__*.metadata")):
        raise ConfigError(
            f"{path}: DCP metadata written per rank (no collectives) cannot be imported; "
            "save it with collectives so that it has one .metadata"
        )
    if any(path.glob(f"*{_SAFETENSORS}")):
        return "safetensors"
    raise ConfigError(
        f"{path}: neither a torch DCP directory (.metadata) nor Hugging Face safetensors "
        "(*.safetensors, *.safetensors.index.json)"
    )


def _check_step_free(run: Run, step: int) -> None:
    try:
        run.checkpoint(step)
    except CheckpointNotFoundError:
        return
    raise ConfigError(
        f"run {run.name!r} already has a committed step {step}; import to a new step or run"
    )


# -- torch DCP --------------------------------------------------------------------------------


def read_dcp(path: Path) -> dict[str, Any]:
    """fqn -> whole tensor or plain value, from a DCP ``FileSystemWriter`` directory."""
    where = str(path / ".metadata")
    metadata = load_metadata((path / ".metadata").read_bytes(), where)
    entries, storage = _checked_metadata(metadata, where)
    state: dict[str, Any] = {}
    for fqn, md in entries.items():
        if isinstance(md, BytesStorageMetadata):
            info = _info(storage, MetadataIndex(fqn), where)
            value = load_torch_saved(_item_bytes(path, info), f"{path}: item {fqn!r}")
            if isinstance(value, torch.Tensor):
                raise SerializationError(f"{path}: item {fqn!r} is a tensor saved as a byte item")
            state[fqn] = value
        else:
            state[fqn] = _whole_tensor(path, fqn, md, storage, where)
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
    path: Path, fqn: str, md: TensorStorageMetadata, storage: dict[Any, Any], where: str
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


# -- Hugging Face safetensors -----------------------------------------------------------------


def read_safetensors(path: Path, prefix: str | None) -> dict[str, torch.Tensor]:
    """name -> tensor from a ``.safetensors`` file or a directory of them (index + shards)."""
    from safetensors import SafetensorError, safe_open

    head = "" if prefix is None else prefix.rstrip(".") + "."
    state: dict[str, torch.Tensor] = {}
    for file, names in _safetensors_files(path).items():
        try:
            with safe_open(str(file), framework="pt") as opened:
                present = set(opened.keys())
                missing = sorted(set(names or present) - present)
                if missing:
                    raise SerializationError(
                        f"{file}: the index places {missing[:5]} here, but the file lacks them"
                    )
                for name in sorted(names or present):
                    if head + name in state:
                        raise SerializationError(f"{file}: tensor {name!r} is in two files")
                    state[head + name] = opened.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise SerializationError(f"{file}: not a readable safetensors file ({exc})") from None
    return state


def _safetensors_files(path: Path) -> dict[Path, list[str] | None]:
    """Each file to read and the names the index gives it (None: all it holds)."""
    if path.is_file():
        return {path: None}
    indexes = sorted(path.glob(f"*{_SAFETENSORS}.index.json"))
    if len(indexes) > 1:
        raise ConfigError(f"{path}: holds {len(indexes)} safetensors indexes; name one's shards")
    if not indexes:
        files = sorted(path.glob(f"*{_SAFETENSORS}"))
        if len(files) != 1:
            raise ConfigError(
                f"{path}: holds {len(files)} .safetensors files and no *.safetensors.index.json "
                "saying which tensor is where"
            )
        return {files[0]: None}
    return _index_shards(path, indexes[0])


def _index_shards(path: Path, index: Path) -> dict[Path, list[str] | None]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SerializationError(f"{index}: not a safetensors index ({exc})") from None
    if not isinstance(weight_map, dict):
        raise SerializationError(f"{index}: weight_map is not an object")
    shards: dict[Path, list[str] | None] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            raise SerializationError(
                f"{index}: {name!r} is placed in {shard!r}, not a file beside it"
            )
        names = shards.setdefault(path / shard, [])
        assert names is not None
        names.append(str(name))
    return shards
