"""Reading the pickles of a torch DCP ``FileSystemWriter`` directory without running them.

DCP pickles its ``.metadata`` and ``torch.save``-s every item into the ``.distcp`` files, so an
import has to read pickles from a directory it did not write. Nothing here calls
``pickle.load`` or ``torch.load``: a :class:`pickle.Unpickler` whose ``find_class`` admits an
explicit allowlist -- DCP's metadata dataclasses, ``torch.Size``, dtypes, layouts, pure paths --
and nothing else. A pickle that asks for anything more (``os.system``, ``builtins.eval``, a
module's function) stops at that name with :class:`ForbiddenPickleError` before any object is
built; pickle can call nothing it was not handed by ``find_class`` (the Python documentation's
"Restricting Globals").

A ``torch.save`` file (a zip: ``data.pkl`` plus raw storages) is read the same way, except that
``torch._utils._rebuild_tensor_v2`` and the storage classes are replaced by stand-ins that only
record the storage key, dtype, offset, size and stride; the tensor is then cut from the raw
storage bytes with ``torch.frombuffer``. Plain values (numbers, strings, lists, dicts, tuples,
None) come out as they are; anything else is refused by name.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ckptstore.errors import SerializationError

#: DCP's metadata classes, by (module, name): ``.metadata`` references these and no others.
_METADATA_CLASSES: dict[tuple[str, str], Any] = {
    (dcp_md.__name__, cls.__name__): cls
    for cls in (
        dcp_md.Metadata,
        dcp_md.TensorStorageMetadata,
        dcp_md.ChunkStorageMetadata,
        dcp_md.BytesStorageMetadata,
        dcp_md.TensorProperties,
        dcp_md.MetadataIndex,
        dcp_md.StorageMeta,
        dcp_md._MEM_FORMAT_ENCODING,
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    # StorageMeta.checkpoint_id: the path it was saved to. Pure paths touch no file system.
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): OrderedDict,
}
_LAYOUTS = {str(layout): layout for layout in (torch.strided, torch.sparse_coo)}


class ForbiddenPickleError(SerializationError):
    """A pickle in an imported directory asks for a class or function that its format never
    holds (``os.system``, say): refused before anything in it ran, and nothing was imported."""


def _get_layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout``'s job for the layouts DCP records, and no lookup."""
    try:
        return _LAYOUTS[name]
    except (KeyError, TypeError):
        raise SerializationError(f"layout {name!r} is not one a DCP checkpoint records") from None


def _dtype(module: str, name: str) -> torch.dtype | None:
    """``torch.<name>`` if it is a dtype (``torch.float32``), else None."""
    value = getattr(torch, name, None) if module == "torch" else None
    return value if isinstance(value, torch.dtype) else None


class _Unpickler(pickle.Unpickler):
    """An unpickler that admits ``allowed`` (and torch dtypes) and refuses any other name."""

    def __init__(self, data: bytes, where: str, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        """The admitted object for ``module.name``; anything else is refused by name."""
        found = self.allowed.get((module, name))
        if found is None:
            found = _dtype(module, name)
        if found is None:
            raise ForbiddenPickleError(
                f"{self.where}: the pickle asks for {module}.{name}, which this format never "
                "holds; refused without running it (nothing was imported). Re-save the "
                "checkpoint from a trusted source"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        """No persistent references: those load tensor storages, which DCP metadata has none."""
        raise ForbiddenPickleError(f"{self.where}: unexpected persistent reference {pid!r}")


def _unpickle(data: bytes, where: str, unpickler: _Unpickler) -> Any:
    try:
        return unpickler.load()
    except (ForbiddenPickleError, SerializationError):
        raise
    except Exception as exc:  # any malformed pickle: truncated, bad opcode, wrong arguments
        raise SerializationError(
            f"{where}: not a readable pickle ({type(exc).__name__}: {exc})"
        ) from None


def load_metadata(data: bytes, where: str) -> dcp_md.Metadata:
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file, read with the allowlist."""
    allowed = _METADATA_CLASSES | {("torch.serialization", "_get_layout"): _get_layout}
    found = _unpickle(data, where, _Unpickler(data, where, allowed))
    if not isinstance(found, dcp_md.Metadata):
        raise SerializationError(
            f"{where}: holds a {type(found).__name__}, not torch DCP's Metadata"
        )
    return found


# -- torch.save files -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _StorageRef:
    """A storage a ``torch.save`` pickle refers to: its record in the zip and its dtype."""

    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True, slots=True)
class _TensorRef:
    """What ``_rebuild_tensor_v2`` would have been called with."""

    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> _TensorRef:
    if not isinstance(storage, _StorageRef):
        raise SerializationError("a tensor is rebuilt from something other than a storage")
    return _TensorRef(storage, int(offset), tuple(map(int, size)), tuple(map(int, stride)))


class _StorageType:
    """Stands in for ``torch.FloatStorage`` and the like: only its dtype is used."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _storage_types() -> dict[tuple[str, str], Any]:
    # torch's own dtype -> legacy storage class name table; pinned with torch==2.13.
    table = torch.storage._dtype_to_storage_type_map()
    return {("torch", name): _StorageType(dtype) for dtype, name in table.items()}


class _TorchSaveUnpickler(_Unpickler):
    """The allowlist of a ``torch.save`` pickle, with tensor storages as references."""

    def __init__(self, data: bytes, where: str) -> None:
        allowed = {
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
            ("collections", "OrderedDict"): OrderedDict,
            **_storage_types(),
        }
        super().__init__(data, where, allowed)

    def persistent_load(self, pid: Any) -> Any:
        """A ``('storage', type, key, location, numel)`` reference as a :class:`_StorageRef`."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise ForbiddenPickleError(f"{self.where}: unexpected persistent reference {pid!r}")
        _, kind, key, _location, numel = pid
        dtype = kind.dtype if isinstance(kind, _StorageType) else None
        if dtype is None or not isinstance(key, str) or not isinstance(numel, int):
            raise SerializationError(f"{self.where}: malformed storage reference {pid!r}")
        return _StorageRef(key, dtype, numel)


def load_torch_saved(blob: bytes, where: str) -> Any:
    """The tensor or plain value a ``torch.save`` file holds, never running its pickle."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
        names = archive.namelist()
    except (zipfile.BadZipFile, ValueError) as exc:
        raise SerializationError(f"{where}: not a torch.save file ({exc})") from None
    pickles = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pickles) != 1:
        raise SerializationError(f"{where}: not a torch.save file (no single data.pkl)")
    root = pickles[0][: -len("data.pkl")]
    byteorder = f"{root}byteorder"
    if byteorder in names and _member(archive, byteorder, where) != b"little":
        raise SerializationError(f"{where}: saved big-endian; import it on a big-endian host")
    data = _member(archive, pickles[0], where)
    value = _unpickle(data, where, _TorchSaveUnpickler(data, where))
    if isinstance(value, _TensorRef):
        return _tensor(archive, root, value, where)
    _check_plain(value, where)
    return value


def _member(archive: zipfile.ZipFile, name: str, where: str) -> bytes:
    """One record of the archive; a damaged one (its header, offsets, compression, CRC) is
    the file's error, whatever :mod:`zipfile` raises for it."""
    try:
        return archive.read(name)
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, zlib.error) as exc:
        raise SerializationError(f"{where}: record {name!r} is damaged ({exc})") from None
    except (
        NotImplementedError,
        RuntimeError,
    ) as exc:  # a compression or encryption torch never writes
        raise SerializationError(f"{where}: record {name!r} cannot be read ({exc})") from None


def _tensor(archive: zipfile.ZipFile, root: str, ref: _TensorRef, where: str) -> torch.Tensor:
    """The tensor ``ref`` describes, cut from its storage record (a contiguous copy)."""
    name = f"{root}data/{ref.storage.key}"
    if name not in archive.NameToInfo:
        raise SerializationError(f"{where}: storage {ref.storage.key!r} is missing")
    raw = _member(archive, name, where)
    itemsize = ref.storage.dtype.itemsize
    if len(raw) != ref.storage.numel * itemsize:
        raise SerializationError(f"{where}: storage {ref.storage.key!r} has the wrong length")
    if len(ref.size) != len(ref.stride) or any(n < 0 for n in (*ref.size, *ref.stride)):
        raise SerializationError(f"{where}: malformed tensor shape {ref.size}/{ref.stride}")
    last = ref.offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride, strict=True))
    if 0 in ref.size:
        return torch.empty(ref.size, dtype=ref.storage.dtype)
    if ref.offset < 0 or last >= ref.storage.numel:
        raise SerializationError(f"{where}: the tensor reaches past its storage")
    flat = torch.frombuffer(bytearray(raw), dtype=ref.storage.dtype) if raw else None
    assert flat is not None  # a non-empty tensor has a non-empty storage (checked above)
    return flat.as_strided(ref.size, ref.stride, ref.offset).clone()


def _check_plain(value: Any, where: str) -> None:
    """Only JSON-like values (and tuples, bytes) may come out of a byte item."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return
    if isinstance(value, list | tuple):
        for item in value:
            _check_plain(item, where)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, where)
            _check_plain(item, where)
        return
    raise SerializationError(
        f"{where}: holds a {type(value).__name__}, not a tensor or a plain value"
    )
