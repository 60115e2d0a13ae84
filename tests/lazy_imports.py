"""Heavy optional dependencies, imported when a test first uses them rather than when pytest
collects the module that names them.

Megatron-Core takes seconds to import (it pulls in torch's compiler stack); a test module that
imports it at its top makes every collection of the suite pay for it, even ``pytest -k`` runs
that select none of its tests. ``deferred("module")`` stands in for the module, and
``deferred("module", "Name")`` for one of its attributes: the import runs on the first attribute
access or call, with warnings silenced, since Megatron warns at import about Apex,
TransformerEngine and its own deprecated imports, which the suite's ``filterwarnings = error``
would turn into failures.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any


class Deferred:
    """A module, or one attribute of it, imported on first use."""

    def __init__(self, module: str, attribute: str | None = None) -> None:
        self._module = module
        self._attribute = attribute
        self._target: Any = None

    def _resolve(self) -> Any:
        if self._target is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                target = importlib.import_module(self._module)
            if self._attribute is not None:
                target = getattr(target, self._attribute)
            self._target = target
        return self._target

    def __getattr__(self, name: str) -> Any:
        # Introspection (pytest's collection, copy, inspect) asks for private and dunder names;
        # answering them must not import anything.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._resolve(), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        name = self._module + (f".{self._attribute}" if self._attribute else "")
        state = "imported" if self._target is not None else "not imported yet"
        return f"<deferred {name}, {state}>"


def deferred(module: str, attribute: str | None = None) -> Any:
    """``module`` (or ``module.attribute``), imported on first attribute access or call."""
    return Deferred(module, attribute)
