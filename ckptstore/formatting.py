"""How a value reads to a person or a script: byte counts, ratios, times in UTC, one-line JSON.

Both faces show manifest figures the same way -- the command line (``ckptstore.cli.output``) and
the web view -- so these sit below both (DESIGN.md §2: layers depend downward only).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any


def human_bytes(n: float | None) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB; ``-`` for None."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def ratio(x: float | None) -> str:
    """``x`` as a ratio (``2.50x``); ``-`` for None."""
    return "-" if x is None else f"{x:.2f}x"


def as_utc(when: dt.datetime) -> dt.datetime:
    """``when`` in UTC; a time without a zone is taken as UTC (what the manifest stores)."""
    return when.replace(tzinfo=dt.UTC) if when.tzinfo is None else when.astimezone(dt.UTC)


def json_value(value: object) -> str:
    """What JSON cannot hold natively: a time as ISO 8601 UTC, anything else as its str."""
    return as_utc(value).isoformat() if isinstance(value, dt.datetime) else str(value)


def dumps(payload: Any) -> str:
    """``payload`` as one line of JSON (times as ISO 8601 UTC, other values as strings)."""
    return json.dumps(payload, default=json_value, allow_nan=True)
