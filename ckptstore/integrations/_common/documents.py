"""Helpers for parsing the large metadata documents every rank of a job reads (DCP's metadata,
Megatron's layout): 10^6 rows each, so the per-row cost of a check is the document's cost."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

__all__ = ["collector_paused", "naturals"]

_INT_ONLY = frozenset({int})


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a document is built or parsed: it becomes
    a few objects per row and none of them form cycles, but every 700 allocations wake the
    collector, which walks everything still young. With it running, parsing DCP's metadata took
    10x longer at 20,000 chunks (``bench/bench_scale.py``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def naturals(values: list[Any]) -> bool:
    """Whether every value is a non-negative ``int`` (JSON's integers; not a bool), in a few
    C-level steps: the short way a parser takes for a well-formed row before it falls back to
    the field-by-field checks that name a fault."""
    return set(map(type, values)) <= _INT_ONLY and (not values or min(values) >= 0)


def json_list(value: Any) -> list[Any]:
    """``value`` if a JSON document gave an array there; else a TypeError naming what it gave."""
    if not isinstance(value, list):
        raise TypeError(f"expected an array, got {type(value).__name__}")
    return value


def json_str(value: Any) -> str:
    """``value`` if a JSON document gave a string there; else a TypeError naming what it gave."""
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value
