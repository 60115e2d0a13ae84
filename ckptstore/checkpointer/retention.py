"""Which committed checkpoints to keep (the reference trainer's rules, DESIGN.md §8).

- The latest checkpoint is always kept.
- ``keep_latest_k`` protects the k newest.
- ``keep_top_k`` keeps the k best by ``metric_name`` (``higher_is_better``); a checkpoint
  without the metric (or with a non-numeric or NaN value) ranks worst; ties keep the newer step.
- Everything else is marked deleted. With ``keep_top_k=None`` nothing is deleted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class RetentionPolicy:
    """Which committed checkpoints survive each commit."""

    #: How many best checkpoints (by ``metric_name``) to keep; None keeps everything.
    keep_top_k: int | None = None
    #: Metric the ranking reads from each checkpoint's metrics, e.g. ``"train:reward"``. Without
    #: it, "best" means "newest".
    metric_name: str | None = None
    #: Whether a larger metric is better.
    higher_is_better: bool = True
    #: The k newest checkpoints are kept whatever their metric.
    keep_latest_k: int = 0

    def __post_init__(self) -> None:
        if self.keep_top_k is not None and self.keep_top_k < 0:
            raise ConfigError("retention keep_top_k must be >= 0 or None (keep everything)")
        if self.keep_latest_k < 0:
            raise ConfigError("retention keep_latest_k must be >= 0")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One committed checkpoint as retention sees it."""

    id: int
    step: int
    metrics: Mapping[str, Any] | None


def _metric(candidate: Candidate, name: str) -> float | None:
    value = (candidate.metrics or {}).get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isnan(value) else float(value)


def to_delete(candidates: Iterable[Candidate], policy: RetentionPolicy) -> set[int]:
    """Ids of the committed checkpoints that ``policy`` no longer keeps."""
    items = list(candidates)
    if policy.keep_top_k is None or not items:
        return set()
    newest_first = sorted(items, key=lambda c: (c.step, c.id), reverse=True)
    keep = {newest_first[0].id}
    keep.update(c.id for c in newest_first[: policy.keep_latest_k])
    if policy.metric_name is None:
        ranked = newest_first
    else:
        sign = 1.0 if policy.higher_is_better else -1.0
        name = policy.metric_name

        def rank(c: Candidate) -> tuple[int, float, int, int]:
            value = _metric(c, name)
            # Missing metrics sort after every present one; ties go to the newer step.
            return (value is None, -sign * (value or 0.0), -c.step, -c.id)

        ranked = sorted(items, key=rank)
    keep.update(c.id for c in ranked[: policy.keep_top_k])
    return {c.id for c in items if c.id not in keep}
