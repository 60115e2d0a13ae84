"""Training info, metrics and configs as the manifest stores them: plain, finite JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ckptstore.errors import ConfigError


def plain_json(value: Mapping[str, Any] | None, what: str) -> dict[str, Any] | None:
    """A JSON copy of ``value`` for the database; NaN and infinities become null (a diverged
    metric must not stop a checkpoint, and SQL JSON has no NaN)."""
    if value is None:
        return None
    try:
        return dict(json.loads(json.dumps(_finite(dict(value)), allow_nan=False)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{what} must be JSON-serializable (it is stored in the manifest database): {exc}"
        ) from exc
    except RecursionError:
        raise ConfigError(
            f"{what} is nested too deeply to store in the manifest database; flatten it"
        ) from None


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
