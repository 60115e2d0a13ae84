"""Plain (non-tensor) values as JSON text, where other checkpointers would pickle them.

torch DCP's default planners pickle every non-tensor value of a state dict and unpickle it on
load with nothing restricting what it may build: a bucket that anyone can write to runs code
on every rank that loads from it. The no-pickle planners encode such values with this module
instead: JSON, with a tag for what JSON lacks (tuples, dicts with int keys, bytes, non-finite
floats, ``torch.Size``, ``torch.dtype``). Decoding builds only these types, never calls
anything, and refuses anything malformed with the value's path.

Encoded forms (``$``-tagged objects; a plain JSON object never appears)::

    {"$d": [[key, value], ...]}   dict (str or int keys, order kept)
    {"$t": [...]}                 tuple          {"$S": [...]}   torch.Size
    {"$b": "<base64>"}            bytes          {"$f": "nan" | "inf" | "-inf"}
    {"$dtype": "bfloat16"}        torch.dtype
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

import torch

from ckptstore.errors import SerializationError
from ckptstore.extending import torch_dtype, torch_dtype_name

#: Deeper values are refused (and Python's recursion limit stays far away).
MAX_DEPTH = 100
_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode_plain(value: Any, path: str) -> bytes:
    """``value`` as JSON text; anything that is not a plain value raises ``SerializationError``
    naming ``path`` and what to do instead."""
    return json.dumps(_encode(value, path, 0), separators=(",", ":"), allow_nan=False).encode()


def decode_plain(data: bytes | bytearray | memoryview, path: str) -> Any:
    """The value :func:`encode_plain` encoded; anything else (a pickle, crafted JSON) raises
    ``SerializationError`` naming ``path``. Never runs code."""
    try:
        doc = json.loads(bytes(data))
    except (ValueError, RecursionError):
        # A pickle starts with the PROTO opcode 0x80 (UTF-8-encoded when it came as text).
        pickled = bytes(data[:2]).startswith((b"\x80", b"\xc2\x80"))
        hint = " (it looks like a pickle, which ckptstore never loads)" if pickled else ""
        raise SerializationError(
            f"{path}: the stored value is not ckptstore's plain-value JSON{hint}; it was written "
            "by another planner or has been tampered with"
        ) from None
    return _decode(doc, path, 0)


def _encode(value: Any, path: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise SerializationError(f"{path}: the value is nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$f": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, torch.Size):
        return {"$S": list(value)}
    if isinstance(value, tuple):
        return {"$t": [_encode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        pairs = []
        for key, item in value.items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise SerializationError(
                    f"{path}: dict key {key!r} is a {type(key).__name__}; plain values need str "
                    "or int keys"
                )
            pairs.append([key, _encode(item, f"{path}.{key}", depth + 1)])
        return {"$d": pairs}
    if isinstance(value, bytes | bytearray):
        return {"$b": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"$dtype": torch_dtype_name(value, path)}
    raise SerializationError(
        f"{path}: a {type(value).__module__}.{type(value).__qualname__} is not a plain value "
        "(None, bool, int, float, str, bytes, list, tuple, dict, torch.Size, torch.dtype), and "
        "ckptstore does not pickle; store it as a tensor or convert it to plain values"
    )


def _decode(doc: Any, path: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise SerializationError(f"{path}: the stored value is nested deeper than {MAX_DEPTH}")
    if doc is None or isinstance(doc, bool | int | float | str):
        return doc
    if isinstance(doc, list):
        return [_decode(v, path, depth + 1) for v in doc]
    if not isinstance(doc, dict) or len(doc) != 1:
        raise SerializationError(f"{path}: malformed plain value (an untagged JSON object)")
    ((tag, body),) = doc.items()
    try:
        if tag == "$t":
            return tuple(_decode(v, path, depth + 1) for v in _array(body))
        if tag == "$d":
            out: dict[str | int, Any] = {}
            for pair in _array(body):
                key, item = _array(pair)
                if not isinstance(key, str | int) or isinstance(key, bool):
                    raise TypeError("a dict key must be a str or an int")
                out[key] = _decode(item, path, depth + 1)
            return out
        if tag == "$S":
            dims = _array(body)
            if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
                raise ValueError("torch.Size holds ints")
            return torch.Size(dims)
        if tag == "$b" and isinstance(body, str):
            return base64.b64decode(body.encode("ascii"), validate=True)
        if tag == "$f" and body in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[body]
        if tag == "$dtype" and isinstance(body, str):
            return torch_dtype(body, path)
    except (ValueError, TypeError, binascii.Error) as exc:
        raise SerializationError(f"{path}: malformed plain value {tag!r}: {exc}") from None
    raise SerializationError(f"{path}: malformed plain value (unknown tag {str(tag)[:40]!r})")


def _array(body: Any) -> list[Any]:
    if not isinstance(body, list):
        raise TypeError("expected a JSON array")
    return body
