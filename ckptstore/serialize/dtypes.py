"""Names of the element types a checkpoint can hold, and their byte views."""

from __future__ import annotations

import re
import warnings

import numpy as np
import torch

from ckptstore.errors import SerializationError


def _probe_torch_dtypes() -> dict[str, torch.dtype]:
    """Every torch dtype whose storage can be viewed as bytes (quantized types cannot)."""
    found: dict[str, torch.dtype] = {}
    for name in dir(torch):
        value = getattr(torch, name)
        if not isinstance(value, torch.dtype):
            continue
        canonical = str(value).removeprefix("torch.")
        # Quantized dtypes carry scales beside their storage; a byte view would lose them.
        if canonical in found or canonical.startswith(("qint", "quint")):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "complex32 is experimental" and the like
                torch.empty(1, dtype=value).view(torch.uint8)
        except (RuntimeError, TypeError):
            continue
        found[canonical] = value
    return found


TORCH_DTYPES: dict[str, torch.dtype] = _probe_torch_dtypes()
_FLOAT_KINDS = "fc"


def torch_dtype_name(dtype: torch.dtype, path: str) -> str:
    """The name an index stores for ``dtype``; ``SerializationError`` if it cannot be saved."""
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise SerializationError(f"{path}: tensors of dtype {dtype} cannot be checkpointed")
    return name


def torch_dtype(name: str, where: str) -> torch.dtype:
    """The torch dtype an index names; ``SerializationError`` naming ``where`` if unknown."""
    try:
        return TORCH_DTYPES[name]
    except (KeyError, TypeError):
        raise SerializationError(f"{where}: unknown tensor dtype {name!r}") from None


_NUMPY_DTYPE_STR = re.compile(r"[<>|=]?[biufcmM][0-9]{1,2}(\[[0-9]*[a-zA-Z]{1,2}\])?")


def numpy_dtype(name: str, where: str) -> np.dtype[np.generic]:
    """A plain numpy dtype from its ``dtype.str`` (no objects, no structured records)."""
    # np.dtype parses some strings as Python literals or deprecated aliases: only the plain
    # ``dtype.str`` form is handed to it.
    if not isinstance(name, str) or not _NUMPY_DTYPE_STR.fullmatch(name):
        raise SerializationError(f"{where}: unknown numpy dtype {name!r}")
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError, SyntaxError):
        raise SerializationError(f"{where}: unknown numpy dtype {name!r}") from None
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise SerializationError(f"{where}: numpy dtype {name!r} is not a plain element type")
    if dtype.kind not in "biufcmM" or dtype.itemsize == 0:
        raise SerializationError(f"{where}: numpy dtype {name!r} is not supported")
    return dtype


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a plain row-major layout (a copy only if it has another layout).

    Handles what ``contiguous()`` alone does not: one-element views with odd strides (which
    count as contiguous but cannot be viewed as bytes), and dtypes without copy kernels
    (the sub-byte placeholders), copied through a same-sized integer view.
    """
    if tensor.is_contiguous() and (tensor.dim() == 0 or tensor.stride(-1) == 1):
        return tensor
    try:
        return tensor.clone(memory_format=torch.contiguous_format)
    except (NotImplementedError, RuntimeError):
        carrier = _SAME_SIZE_INT.get(tensor.element_size())
        if carrier is None:
            raise
        return tensor.view(carrier).clone(memory_format=torch.contiguous_format).view(tensor.dtype)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a CPU ``tensor`` as a flat uint8 tensor (no copy when already dense)."""
    return dense(tensor).reshape(-1).view(torch.uint8)


def is_float_like(dtype: torch.dtype | np.dtype[np.generic]) -> bool:
    """Whether byte-grouping can help: floats and complex numbers (exponent bytes cluster)."""
    if isinstance(dtype, torch.dtype):
        return dtype.is_floating_point or dtype.is_complex
    return dtype.kind in _FLOAT_KINDS
