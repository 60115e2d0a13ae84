"""A process's random number generators as plain values: tensors, numpy arrays and JSON scalars.

Accelerate and the Trainer pickle these states (``torch.save`` of ``random.getstate()`` and
``np.random.get_state()``); here each one is written out field by field, so ckptstore stores
it without pickle and a load rebuilds it from checked values only:

- ``python``: ``random.getstate()`` -- version, the Mersenne Twister's 624 words and its
  position (625 values, each < 2**32: a ``uint32`` array), the cached Gaussian (None or float).
- ``numpy``: ``np.random.get_state()`` -- the legacy generator's name, 624 ``uint32`` keys,
  position, whether a Gaussian is cached and its value.
- ``torch``: ``torch.get_rng_state()`` (a ``uint8`` tensor).
- ``device``: the accelerator's generators (CUDA, XPU, ...), one ``uint8`` tensor per device,
  and the device type they belong to; absent on a CPU-only machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptstore.errors import ConfigError, SerializationError

#: What a state that fails these checks is: the bytes verified, so it was written so.
_CRAFTED = "not an RNG state ckptstore wrote (corrupt or crafted)"


def capture() -> dict[str, Any]:
    """This process's generators, as plain values."""
    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {
            "version": int(version),
            "state": np.asarray(words, dtype=np.uint32),
            "gauss_next": gauss,
        },
        "numpy": {
            "name": str(name),
            "keys": np.asarray(keys, dtype=np.uint32).copy(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    device = _device_states()
    if device is not None:
        state["device"] = device
    return state


def _device_module() -> tuple[str, Any] | tuple[None, None]:
    """The accelerator's device type and its torch module (``torch.cuda``, ...), if any."""
    if not torch.cuda.is_available() and not (
        hasattr(torch, "accelerator") and torch.accelerator.is_available()
    ):
        return None, None
    current = torch.accelerator.current_accelerator()
    if current is None:
        return None, None
    module = torch.get_device_module(current.type)
    return current.type, module


def _device_states() -> dict[str, Any] | None:
    kind, module = _device_module()
    if kind is None or module is None:
        return None
    states = (
        module.get_rng_state_all()
        if hasattr(module, "get_rng_state_all")
        else [module.get_rng_state()]
    )
    return {"type": kind, "states": [s.cpu() for s in states]}


@dataclass(frozen=True, slots=True)
class Checked:
    """An RNG state that passed every check, ready to set."""

    python_state: tuple[Any, ...]
    numpy_state: tuple[Any, ...]
    torch_state: torch.Tensor
    device_state: tuple[Any, list[torch.Tensor]] | None


def check(state: Any, where: str) -> Checked:
    """``state`` (what :func:`capture` returned, loaded) with every field checked; ``where``
    names the stored component in errors."""
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise SerializationError(f"{where}: {_CRAFTED}: expected python, numpy and torch states")
    return Checked(
        _python_state(state["python"], where),
        _numpy_state(state["numpy"], where),
        _tensor(state["torch"], f"{where}/torch"),
        _device_target(state.get("device"), where),
    )


def restore(checked: Checked) -> None:
    """Set this process's generators from a checked state."""
    random.setstate(checked.python_state)
    np.random.set_state(checked.numpy_state)
    torch.set_rng_state(checked.torch_state)
    if checked.device_state is not None:
        module, states = checked.device_state
        if hasattr(module, "set_rng_state_all"):
            module.set_rng_state_all(states)
        else:
            module.set_rng_state(states[0])


def _python_state(value: Any, where: str) -> tuple[Any, ...]:
    path = f"{where}/python"
    if not isinstance(value, dict) or set(value) != {"version", "state", "gauss_next"}:
        raise SerializationError(f"{path}: {_CRAFTED}")
    words = value["state"]
    if not (isinstance(words, np.ndarray) and words.dtype == np.uint32 and words.shape == (625,)):
        raise SerializationError(f"{path}/state: {_CRAFTED}: expected 625 uint32 words")
    gauss = value["gauss_next"]
    if not (gauss is None or isinstance(gauss, float)) or not _is_int(value["version"]):
        raise SerializationError(f"{path}: {_CRAFTED}")
    return (value["version"], tuple(int(w) for w in words), gauss)


def _numpy_state(value: Any, where: str) -> tuple[Any, ...]:
    path = f"{where}/numpy"
    fields = {"name", "keys", "pos", "has_gauss", "cached_gaussian"}
    if not isinstance(value, dict) or set(value) != fields:
        raise SerializationError(f"{path}: {_CRAFTED}")
    keys = value["keys"]
    if not (isinstance(keys, np.ndarray) and keys.dtype == np.uint32 and keys.shape == (624,)):
        raise SerializationError(f"{path}/keys: {_CRAFTED}: expected 624 uint32 keys")
    if value["name"] != "MT19937" or not _is_int(value["pos"]) or not _is_int(value["has_gauss"]):
        raise SerializationError(f"{path}: {_CRAFTED}")
    if not isinstance(value["cached_gaussian"], float):
        raise SerializationError(f"{path}/cached_gaussian: {_CRAFTED}")
    return ("MT19937", keys, value["pos"], value["has_gauss"], value["cached_gaussian"])


def _tensor(value: Any, path: str) -> torch.Tensor:
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1):
        raise SerializationError(f"{path}: {_CRAFTED}: expected a uint8 tensor")
    return value


def _device_target(value: Any, where: str) -> tuple[Any, list[torch.Tensor]] | None:
    """The device module and states to set; None when none were saved."""
    if value is None:
        return None
    path = f"{where}/device"
    if not isinstance(value, dict) or set(value) != {"type", "states"}:
        raise SerializationError(f"{path}: {_CRAFTED}")
    states = value["states"]
    if not isinstance(states, list) or not states:
        raise SerializationError(f"{path}/states: {_CRAFTED}")
    tensors = [_tensor(s, f"{path}/states/{i}") for i, s in enumerate(states)]
    kind, module = _device_module()
    if kind != value["type"]:
        raise ConfigError(
            f"{path}: the checkpoint holds {value['type']!r} generator states and this process "
            f"runs on {kind or 'the CPU alone'}; resume on a {value['type']} machine, or load "
            "without the RNG states (rng=False)"
        )
    return module, tensors


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
