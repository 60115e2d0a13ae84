"""Package attributes imported on first use (PEP 562).

A package lists its public names by the module that defines them; importing the package then
costs nothing, and ``from ckptstore.x import Name`` imports only what ``Name`` needs. This keeps
torch and numpy out of processes that only read the manifest (the CLI's read commands).
Type checkers see the same names through the package's ``if TYPE_CHECKING:`` imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a module to the names it
    provides; a name is imported on first access and then kept in ``namespace``."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__
