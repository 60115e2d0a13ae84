"""Bitwise comparison of two states, naming the first difference (for checks and tests)."""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np
import torch

from ckptstore.serialize.dtypes import byte_view
from ckptstore.serialize.tree import join


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    return byte_view(t.detach().cpu().resolve_conj().resolve_neg())


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """None if ``a`` and ``b`` are identical bit for bit (type, dtype, shape, bytes, structure);
    else a description of the first difference and its path."""
    where = path or "<root>"
    if type(a) is not type(b):
        return f"{where}: type {type(a).__qualname__} != {type(b).__qualname__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        return None if torch.equal(_tensor_bytes(a), _tensor_bytes(b)) else f"{where}: bytes differ"
    if isinstance(a, np.ndarray | np.generic):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        same = np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
        return None if same else f"{where}: bytes differ"
    if isinstance(a, dict) or _is_tensordict(a):
        if list(a.keys()) != list(b.keys()):
            return f"{where}: keys {list(a.keys())} != {list(b.keys())}"
        if _is_tensordict(a) and a.batch_size != b.batch_size:
            return f"{where}: batch_size {a.batch_size} != {b.batch_size}"
        for key in a.keys():  # noqa: SIM118 - iterating a TensorDict walks its batch dim
            diff = first_difference(_plain(a.get(key)), _plain(b.get(key)), join(path, key))
            if diff:
                return diff
        return None
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            return f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            diff = first_difference(x, y, join(path, i))
            if diff:
                return diff
        return None
    if isinstance(a, float):
        # Bitwise: -0.0 differs from 0.0, and NaN equals the same NaN.
        same = struct.pack("<d", a) == struct.pack("<d", b)
        return None if same else f"{where}: {a!r} != {b!r}"
    return None if a == b else f"{where}: {a!r} != {b!r}"


def _plain(value: Any) -> Any:
    """A TensorDict's non-tensor leaf as its Python value."""
    module = sys.modules.get("tensordict")
    is_non_tensor = getattr(module, "is_non_tensor", None)
    if is_non_tensor is not None and is_non_tensor(value):
        return value.data
    return value


def _is_tensordict(value: Any) -> bool:
    base = getattr(sys.modules.get("tensordict"), "TensorDictBase", None)
    return isinstance(base, type) and isinstance(value, base)
