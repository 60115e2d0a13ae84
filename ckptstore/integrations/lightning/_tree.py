"""A Lightning checkpoint dict as ckptstore components, and back, with no pickle either way.

Lightning's ``TorchCheckpointIO`` pickles the whole dict. Here it is split into components
(``model``: the ``state_dict``; ``optimizer``: ``optimizer_states`` and ``lr_schedulers``;
``trainer``: everything else -- loops, callbacks, hyperparameters, versions) that ckptstore
stores as tensors plus a JSON structure tree. What a Lightning dict may hold is allow-listed
(:func:`check_tree`), on save with an error that names the key and the fix, and on load again,
so a checkpoint someone committed with other values (pickled bytes, say) is refused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ckptstore.errors import ConfigError, SerializationError

MODEL, OPTIMIZER, TRAINER = "model", "optimizer", "trainer"
_OPTIMIZER_KEYS = ("optimizer_states", "lr_schedulers")
#: ``state_dict()._metadata`` (module versions ``load_state_dict`` reads), kept in ``trainer``.
STATE_DICT_METADATA = "_ckptstore_state_dict_metadata"
_SCALARS = (type(None), bool, int, float, str, torch.Size, torch.dtype, np.generic)
_FIX = (
    "turn it into a tensor, a number, a str or a dict/list of them (in the LightningModule's or "
    "callback's on_save_checkpoint / state_dict), or leave it out of save_hyperparameters("
    "ignore=[...])"
)


def check_tree(value: Any, path: str = "", *, loading: bool = False) -> None:
    """Refuse, naming the key, anything in a Lightning checkpoint but dicts (str or int keys),
    lists, tuples, tensors, numpy arrays and plain scalars. ``loading``: a stored checkpoint
    that holds anything else was not written by this plugin and is refused as untrusted."""
    stack: list[tuple[str, Any, int]] = [(path, value, 0)]
    while stack:
        where, item, depth = stack.pop()
        if depth > 100:
            raise SerializationError(f"{where}: a Lightning checkpoint nested over 100 levels")
        if isinstance(item, dict):
            for key, sub in item.items():
                if isinstance(key, bool) or not isinstance(key, str | int):
                    raise _refuse(f"{where}: dict key {key!r}", type(key), loading)
                stack.append((f"{where}/{key}" if where else str(key), sub, depth + 1))
        elif isinstance(item, list | tuple) and not isinstance(item, torch.Size):
            stack.extend((f"{where}/{i}", sub, depth + 1) for i, sub in enumerate(item))
        elif not isinstance(item, (torch.Tensor, np.ndarray, *_SCALARS)):
            raise _refuse(where or "<root>", type(item), loading)


def _refuse(where: str, kind: type, loading: bool) -> SerializationError:
    name = kind.__qualname__
    if loading:
        hint = " (pickled data?)" if kind in (bytes, bytearray) else ""
        return SerializationError(
            f"{where}: the stored Lightning checkpoint holds a {name}{hint}, which this plugin "
            "never writes; refusing it as untrusted (it was committed by other code)"
        )
    return SerializationError(
        f"{where}: a {name} cannot be stored in a Lightning checkpoint without pickle; {_FIX}"
    )


def split(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The components of one Lightning checkpoint dict (checked first)."""
    check_tree(checkpoint)
    rest = dict(checkpoint)
    components: dict[str, Any] = {}
    if "state_dict" in rest:
        weights = rest.pop("state_dict")
        metadata = getattr(weights, "_metadata", None)
        if isinstance(metadata, dict):
            check_tree(metadata, "state_dict._metadata")
            rest[STATE_DICT_METADATA] = dict(metadata)
        components[MODEL] = weights
    optimizer = {key: rest.pop(key) for key in _OPTIMIZER_KEYS if key in rest}
    if optimizer:
        components[OPTIMIZER] = optimizer
    components[TRAINER] = rest
    return components


def join(state: dict[str, Any], where: str) -> dict[str, Any]:
    """The Lightning checkpoint dict from the loaded components (checked)."""
    trainer = state.get(TRAINER)
    if not isinstance(trainer, dict):
        raise SerializationError(f"{where}: no {TRAINER!r} component; not a Lightning checkpoint")
    checkpoint = dict(trainer)
    optimizer = state.get(OPTIMIZER, {})
    if not isinstance(optimizer, dict) or set(optimizer) - set(_OPTIMIZER_KEYS):
        raise SerializationError(f"{where}: the {OPTIMIZER!r} component is not Lightning's")
    checkpoint.update(optimizer)
    metadata = checkpoint.pop(STATE_DICT_METADATA, None)
    if MODEL in state:
        weights = state[MODEL]
        if not isinstance(weights, dict):
            raise SerializationError(f"{where}: the {MODEL!r} component is not a state_dict")
        if isinstance(metadata, dict):
            weights = OrderedDict(weights)
            weights._metadata = metadata  # type: ignore[attr-defined]  # as Module.state_dict()
        checkpoint["state_dict"] = weights
    check_tree(checkpoint, loading=True)
    return checkpoint


def mover(map_location: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """What ``map_location`` asks for: nothing (None, ``"cpu"``), or every tensor moved to one
    device (a ``torch.device`` or its name)."""
    if map_location is None:
        return lambda checkpoint: checkpoint
    if not isinstance(map_location, str | torch.device):
        raise ConfigError(
            f"map_location={map_location!r}: CkptstoreCheckpointIO loads to the CPU or to one "
            "device; pass None, 'cpu' or a torch.device (Lightning moves the state itself)"
        )
    device = torch.device(map_location)
    return lambda checkpoint: _to(checkpoint, device)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        moved = type(value)((k, _to(v, device)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            moved._metadata = value._metadata  # type: ignore[attr-defined]
        return moved
    if isinstance(value, list | tuple) and not isinstance(value, torch.Size):
        return type(value)(_to(v, device) for v in value)
    return value
