"""A Megatron checkpoint's state dict by key, read from its ``megatron/meta`` component without
torch: what ``ckptstore show --entries`` prints (``formats.Items``), as
``megatron_source.state_dict_items`` lists it.

Only what a listing shows is checked here (the component's format and version, each row's
types); ``megatron_source.validate_checkpoint`` checks what a load checks (each tensor's
shards tile it, each shard lies in a component the checkpoint has)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ckptstore.errors import IntegrityError, UnreadableError
from ckptstore.formats import json_values
from ckptstore.integrations._common.names import MEGATRON_META

if TYPE_CHECKING:
    from ckptstore.extending import CheckpointInfo, ObjectStore

#: The meta component's ``format`` and the ``version`` read (``megatron_layout``'s).
FORMAT = "ckptstore-megatron"
VERSION = 1


def state_dict_items(store: ObjectStore, info: CheckpointInfo) -> list[dict[str, Any]]:
    """The checkpoint's state dict by key: each tensor's dtype and global shape (objects have
    none) and the ranks whose components hold its shards."""
    where = f"run {info.run!r}, step {info.step}"
    component = next(c for c in info.components if c.name == MEGATRON_META)
    values = json_values(store, component, where)
    where = f"{where}, component {MEGATRON_META!r}"
    if values.get("format") != FORMAT:
        raise IntegrityError(f"{where}: {MEGATRON_META} is not a ckptstore Megatron meta component")
    if values.get("version") != VERSION:
        raise UnreadableError(
            f"{where}: Megatron meta version {values.get('version')!r} is not supported "
            f"(this ckptstore reads {VERSION}); upgrade ckptstore"
        )
    return layout_items(values.get("layout"), where)


def layout_items(text: object, where: str) -> list[dict[str, Any]]:
    """The items a layout document (JSON ``text``) describes; ``IntegrityError`` naming
    ``where`` and what is wrong if it is malformed."""
    try:
        doc = json.loads(text) if isinstance(text, str) else None
        if not isinstance(doc, dict):
            raise TypeError("the layout is not a JSON object")
        items: dict[str, dict[str, Any]] = {}
        for key, component, _path, dtype, shape, *_ in _rows(doc["tensors"], 7):
            item = items.setdefault(
                _str(key),
                {"name": key, "kind": "tensor", "dtype": _str(dtype), "shape": _dims(shape)},
            )
            item.setdefault("ranks", set()).add(_rank_of(component))
        for key, component, *_ in _rows(doc["objects"], 5):
            item = items.setdefault(
                _str(key), {"name": key, "kind": "object", "dtype": None, "shape": None}
            )
            item.setdefault("ranks", set()).add(_rank_of(component))
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise IntegrityError(f"{where}: malformed Megatron layout ({detail})") from None
    return [item | {"ranks": sorted(item["ranks"])} for item in items.values()]


def _rows(value: Any, width: int) -> list[list[Any]]:
    if not isinstance(value, list) or not all(
        isinstance(row, list) and len(row) == width for row in value
    ):
        raise TypeError(f"expected an array of {width}-element rows")
    return value


def _rank_of(component: Any) -> int:
    """``megatron/rank3`` -> 3."""
    prefix = "megatron/rank"
    text = _str(component)
    number = text[len(prefix) :]
    if not text.startswith(prefix) or not (number.isascii() and number.isdigit()):
        raise ValueError(f"{text!r} is no rank component")
    return int(number)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _dims(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    ):
        raise TypeError(f"expected a shape (non-negative integers), got {value!r}")
    return value
