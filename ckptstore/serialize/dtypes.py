"""Names of the element types a checkpoint can hold, and their byte views.

Importing this module loads neither torch nor numpy: an index names its element types, and
decoding one (:func:`element_size`, :func:`numpy_dtype`) must work where torch is absent (the
web UI, ``ckptstore show``). torch is imported by the functions that handle tensors.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import TYPE_CHECKING, Any

from ckptstore.errors import SerializationError

if TYPE_CHECKING:
    import numpy as np
    import torch

#: Bytes per element of every torch dtype a checkpoint can hold, by the name an index stores:
#: what decoding an index needs, without torch. ``torch_dtypes()`` finds the same set by probing
#: torch (a test keeps the two equal for the installed torch).
TORCH_ITEMSIZES: dict[str, int] = {
    **dict.fromkeys(["bool", "bits8", "bits1x8", "bits2x4", "bits4x2", "float4_e2m1fn_x2"], 1),
    **dict.fromkeys(["int8", "uint8", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"], 1),
    **dict.fromkeys(["float8_e5m2fnuz", "float8_e8m0fnu"], 1),
    # Sub-byte integer placeholders: one byte per element in their storage.
    **{f"{sign}int{bits}": 1 for sign in ("", "u") for bits in range(1, 8)},
    **dict.fromkeys(["int16", "uint16", "float16", "bfloat16", "bits16"], 2),
    **dict.fromkeys(["int32", "uint32", "float32", "complex32"], 4),
    **dict.fromkeys(["int64", "uint64", "float64", "complex64"], 8),
    "complex128": 16,
}


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Every torch dtype whose storage can be viewed as bytes (quantized types cannot), by the
    name an index stores; found by probing torch once."""
    import torch

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


def __getattr__(name: str) -> Any:
    # ``TORCH_DTYPES`` is the probe's result, made on first use (it imports torch).
    if name == "TORCH_DTYPES":
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_FLOAT_KINDS = "fc"


def torch_dtype_name(dtype: torch.dtype, path: str) -> str:
    """The name an index stores for ``dtype``; ``SerializationError`` if it cannot be saved."""
    name = str(dtype).removeprefix("torch.")
    if name not in torch_dtypes():
        raise SerializationError(f"{path}: tensors of dtype {dtype} cannot be checkpointed")
    return name


def torch_dtype(name: str, where: str) -> torch.dtype:
    """The torch dtype an index names; ``SerializationError`` naming ``where`` if unknown."""
    try:
        return torch_dtypes()[name]
    except (KeyError, TypeError):
        raise SerializationError(f"{where}: unknown tensor dtype {name!r}") from None


def element_size(name: str, where: str) -> int:
    """Bytes per element of the torch dtype an index names, without importing torch;
    ``SerializationError`` naming ``where`` if the name is unknown."""
    try:
        return TORCH_ITEMSIZES[name]
    except (KeyError, TypeError):
        raise SerializationError(f"{where}: unknown tensor dtype {name!r}") from None


_NUMPY_DTYPE_STR = re.compile(r"[<>|=]?[biufcmM][0-9]{1,2}(\[[0-9]*[a-zA-Z]{1,2}\])?")


def numpy_dtype(name: str, where: str) -> np.dtype[np.generic]:
    """A plain numpy dtype from its ``dtype.str`` (no objects, no structured records)."""
    import numpy as np

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


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a plain row-major layout (a copy only if it has another layout).

    Handles what ``contiguous()`` alone does not: one-element views with odd strides (which
    count as contiguous but cannot be viewed as bytes), and dtypes without copy kernels
    (the sub-byte placeholders), copied through a same-sized integer view.
    """
    import torch

    if tensor.is_contiguous() and (tensor.dim() == 0 or tensor.stride(-1) == 1):
        return tensor
    try:
        return tensor.clone(memory_format=torch.contiguous_format)
    except (NotImplementedError, RuntimeError):
        same_size_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        carrier = same_size_int.get(tensor.element_size())
        if carrier is None:
            raise
        return tensor.view(carrier).clone(memory_format=torch.contiguous_format).view(tensor.dtype)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a CPU ``tensor`` as a flat uint8 tensor (no copy when already dense)."""
    import torch

    return dense(tensor).reshape(-1).view(torch.uint8)


def is_float_like(dtype: torch.dtype | np.dtype[np.generic]) -> bool:
    """Whether byte-grouping can help: floats and complex numbers (exponent bytes cluster)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype.is_floating_point or dtype.is_complex
    return dtype.kind in _FLOAT_KINDS
