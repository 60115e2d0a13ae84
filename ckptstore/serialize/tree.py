"""Flattening a state into entries plus a structure tree, and rebuilding it.

Supported: dicts (str or int keys; OrderedDict kept), lists, tuples, ``torch.Size``, tensors,
numpy arrays and scalars, TensorDicts, bytes, bytearray, None, bool, int, float, str and
``torch.dtype``. Anything else fails here, at save time, with the path of the offending value.

Tree nodes (JSON)::

    {"d": [[key, node], ...]}      dict          {"od": [...]}   OrderedDict
    {"l": [node, ...]}             list          {"t": [...]}    tuple
    {"S": [int, ...]}              torch.Size
    {"td": {"b": [...], "i": [[key, node], ...]}}  TensorDict
    {"e": n}                       entry n of the index's entry list
"""

from __future__ import annotations

import math
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptstore.errors import SerializationError
from ckptstore.serialize.dtypes import numpy_dtype, torch_dtype_name

#: Deeper structures are refused (and Python's recursion limit stays far away).
MAX_DEPTH = 100


def _tensordict_types() -> tuple[type, ...]:
    # A state can only hold a TensorDict if tensordict is already imported; importing it
    # here would cost a second on the first (blocking) snapshot for nothing.
    module = sys.modules.get("tensordict")
    base = getattr(module, "TensorDictBase", None)
    return (base,) if isinstance(base, type) else ()


@dataclass(slots=True)
class Leaf:
    """One entry found while flattening. Array-like leaves carry a byte view of their data."""

    path: str
    kind: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    data: memoryview | None = None
    itemsize: int = 1
    float_like: bool = False
    value: Any = None
    #: The object that owns ``data``'s memory; held until the bytes are stored.
    owner: Any = None


def escape_key(key: str | int) -> str:
    """A key as one path segment: ``%`` and ``/`` escaped, the empty key written ``%00``."""
    text = str(key)
    return text.replace("%", "%25").replace("/", "%2F") if text else "%00"


def join(prefix: str, key: str | int) -> str:
    """The path of ``key`` under ``prefix`` (escaped, ``/``-separated)."""
    return f"{prefix}/{escape_key(key)}" if prefix else escape_key(key)


class Flattener:
    """Walks a state once; ``leaves`` and the returned tree describe it completely."""

    def __init__(
        self, tensor_view: Callable[[torch.Tensor, str], Leaf], *, copy_arrays: bool = False
    ) -> None:
        self.leaves: list[Leaf] = []
        self._copy = copy_arrays
        self._paths: set[str] = set()
        self._active: set[int] = set()
        self._tensor_view = tensor_view
        self._td_types = _tensordict_types()

    def flatten(self, value: Any, path: str = "", depth: int = 0) -> Any:
        """The tree node for ``value`` at ``path``; its leaves are appended to ``leaves``."""
        if depth > MAX_DEPTH:
            raise SerializationError(f"{path or '<root>'}: nesting deeper than {MAX_DEPTH} levels")
        if isinstance(value, torch.Tensor):
            return self._leaf(self._tensor_view(value, path or "<root>"))
        if isinstance(value, np.ndarray | np.generic):
            return self._leaf(_numpy_leaf(value, path or "<root>", copy=self._copy))
        if isinstance(value, float) and math.isnan(value):
            # JSON's NaN has no sign or payload: keep the exact bits.
            return self._leaf(Leaf(path, "float", value=struct.pack("<d", value).hex()))
        if value is None or isinstance(value, bool | int | float | str):
            return self._leaf(Leaf(path, "json", value=value))
        if isinstance(value, bytes | bytearray):
            kind = "bytes" if isinstance(value, bytes) else "bytearray"
            if self._copy and kind == "bytearray":
                value = bytearray(value)
            view = memoryview(value)
            return self._leaf(Leaf(path, kind, "uint8", (len(value),), view, owner=value))
        if isinstance(value, torch.dtype):
            return self._leaf(Leaf(path, "dtype", value=torch_dtype_name(value, path)))
        if isinstance(value, torch.Size):
            return {"S": [int(d) for d in value]}
        container = self._container(value, path, depth)
        if container is not None:
            return container
        raise SerializationError(
            f"{path or '<root>'}: cannot checkpoint a value of type {type(value).__qualname__}; "
            "use tensors, numpy arrays, TensorDicts, dicts/lists/tuples and JSON scalars"
        )

    def _container(self, value: Any, path: str, depth: int) -> Any:
        if not isinstance(value, dict | list | tuple) and not isinstance(value, self._td_types):
            return None
        if id(value) in self._active:
            raise SerializationError(f"{path or '<root>'}: the state contains a reference cycle")
        self._active.add(id(value))
        try:
            if isinstance(value, dict):
                tag = "od" if isinstance(value, OrderedDict) else "d"
                return {tag: [self._item(k, v, path, depth) for k, v in value.items()]}
            if isinstance(value, list | tuple):
                items = [self.flatten(v, join(path, i), depth + 1) for i, v in enumerate(value)]
                return {"t" if isinstance(value, tuple) else "l": items}
            return self._tensordict(value, path, depth)
        finally:
            self._active.discard(id(value))

    def _item(self, key: Any, value: Any, path: str, depth: int) -> list[Any]:
        if isinstance(key, bool) or not isinstance(key, str | int):
            raise SerializationError(
                f"{path or '<root>'}: dict key {key!r} of type {type(key).__qualname__} is not "
                "supported; use str or int keys"
            )
        return [key, self.flatten(value, join(path, key), depth + 1)]

    def _tensordict(self, td: Any, path: str, depth: int) -> Any:
        from tensordict import is_non_tensor

        items = []
        for key in td.keys():  # noqa: SIM118 - iterating a TensorDict walks its batch dim
            sub = td.get(key)
            if is_non_tensor(sub):
                items.append([key, {"nt": self.flatten(sub.data, join(path, key), depth + 1)}])
            else:
                items.append(self._item(key, sub, path, depth))
        return {"td": {"b": [int(d) for d in td.batch_size], "i": items}}

    def _leaf(self, leaf: Leaf) -> dict[str, int]:
        if leaf.path in self._paths:
            raise SerializationError(
                f"{leaf.path}: two values flatten to the same path (an int key and a str key "
                "with the same text?); rename one"
            )
        self._paths.add(leaf.path)
        self.leaves.append(leaf)
        return {"e": len(self.leaves) - 1}


def tensor_paths(state: Any) -> dict[str, torch.Tensor]:
    """Each tensor of ``state`` by the path a save of ``state`` gives its entry (the targets of
    a load ``into`` existing tensors); nothing is copied."""
    flattener = Flattener(lambda tensor, path: Leaf(path, "tensor", owner=tensor))
    flattener.flatten(state)
    return {leaf.path: leaf.owner for leaf in flattener.leaves if leaf.kind == "tensor"}


def _numpy_leaf(value: np.ndarray | np.generic, path: str, *, copy: bool) -> Leaf:
    kind = "npscalar" if isinstance(value, np.generic) else "ndarray"
    array = np.asarray(value)  # keeps 0-d arrays 0-d, unlike ascontiguousarray
    if copy or not array.flags.c_contiguous:
        array = array.copy(order="C")
    dtype = numpy_dtype(array.dtype.str, path)
    data = memoryview(array.reshape(-1).view(np.uint8).data) if array.size else memoryview(b"")
    return Leaf(
        path,
        kind,
        dtype.str,
        tuple(array.shape),
        data,
        itemsize=dtype.itemsize,
        float_like=dtype.kind in "fc",
        owner=array,
    )


def rebuild(node: Any, entries: list[Any], where: str, depth: int = 0) -> Any:
    """Rebuild the structure from a validated tree and the loaded entry values."""
    if depth > MAX_DEPTH:
        raise SerializationError(
            f"{where}: the structure is nested deeper than {MAX_DEPTH} levels (corrupt or crafted)"
        )
    if not isinstance(node, dict) or len(node) != 1:
        raise SerializationError(f"{where}: malformed structure node")
    ((tag, body),) = node.items()
    if tag == "e":
        if not isinstance(body, int) or isinstance(body, bool) or not 0 <= body < len(entries):
            raise SerializationError(f"{where}: structure refers to a missing entry {body!r}")
        return entries[body]
    if tag in ("d", "od"):
        pairs = [_pair(p, entries, where, depth) for p in _list(body, where)]
        return OrderedDict(pairs) if tag == "od" else dict(pairs)
    if tag in ("l", "t"):
        items = [rebuild(n, entries, where, depth + 1) for n in _list(body, where)]
        return tuple(items) if tag == "t" else items
    if tag == "S":
        dims = _list(body, where)
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            raise SerializationError(f"{where}: malformed torch.Size")
        return torch.Size(dims)
    if tag == "td":
        return _rebuild_tensordict(body, entries, where, depth)
    raise SerializationError(f"{where}: unknown structure node {tag!r}")


def _rebuild_tensordict(body: Any, entries: list[Any], where: str, depth: int) -> Any:
    from tensordict import TensorDict

    if not isinstance(body, dict) or set(body) != {"b", "i"}:
        raise SerializationError(f"{where}: malformed TensorDict node")
    try:
        return _fill_tensordict(TensorDict, body, entries, where, depth)
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        if isinstance(exc, SerializationError):
            raise
        raise SerializationError(f"{where}: invalid TensorDict node: {exc}") from exc


def _fill_tensordict(
    cls: Any, body: dict[str, Any], entries: list[Any], where: str, depth: int
) -> Any:
    td = cls({}, batch_size=rebuild({"S": body["b"]}, entries, where, depth + 1))
    for pair in _list(body["i"], where):
        if (
            isinstance(pair, list)
            and len(pair) == 2
            and isinstance(pair[1], dict)
            and set(pair[1]) == {"nt"}
        ):
            key = _key(pair[0], where)
            td.set_non_tensor(str(key), rebuild(pair[1]["nt"], entries, where, depth + 1))
            continue
        key, value = _pair(pair, entries, where, depth)
        td.set(str(key), value)
    return td


def _list(body: Any, where: str) -> list[Any]:
    if not isinstance(body, list):
        raise SerializationError(f"{where}: malformed structure (expected a list)")
    return body


def _key(key: Any, where: str) -> str | int:
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise SerializationError(f"{where}: malformed dict key {key!r}")
    return key


def _pair(pair: Any, entries: list[Any], where: str, depth: int) -> tuple[str | int, Any]:
    if not isinstance(pair, list) or len(pair) != 2:
        raise SerializationError(f"{where}: malformed dict item")
    return _key(pair[0], where), rebuild(pair[1], entries, where, depth + 1)
