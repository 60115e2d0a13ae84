"""Which committed checkpoints to keep (the reference trainer's rules, DESIGN.md §8 and §9.6).

A checkpoint is kept if any rule keeps it:

- it is the latest checkpoint (always kept);
- it is among the ``keep_latest_k`` newest;
- its step is a multiple of ``keep_every_n_steps`` (kept permanently);
- it competes for ``keep_top_k`` (its trigger is in ``rank_triggers``, or every checkpoint
  competes when that is None) and is among the k best by ``metric_name``
  (``higher_is_better``); a checkpoint without the metric (or with a non-numeric or NaN value)
  ranks worst; ties keep the newer step.

Everything else is marked deleted: with ``rank_triggers={"period"}`` an off-period save (a
time-limit save, say) goes as soon as a newer checkpoint exists, unless another rule protects
it. With ``keep_top_k=None`` nothing is deleted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import ConfigError
from ckptstore.manifest.models import Trigger


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
    #: Triggers whose checkpoints compete for ``keep_top_k`` (e.g. ``{"period"}``); None: all.
    #: Any iterable of trigger names is accepted and stored as a frozenset.
    rank_triggers: frozenset[str] | None = None
    #: A checkpoint whose step is a multiple of n is kept permanently; None keeps none that way.
    keep_every_n_steps: int | None = None

    def __post_init__(self) -> None:
        if self.keep_top_k is not None and self.keep_top_k < 0:
            raise ConfigError("retention keep_top_k must be >= 0 or None (keep everything)")
        if self.keep_latest_k < 0:
            raise ConfigError("retention keep_latest_k must be >= 0")
        if self.keep_every_n_steps is not None and self.keep_every_n_steps < 1:
            raise ConfigError(
                f"retention keep_every_n_steps={self.keep_every_n_steps} must be >= 1, "
                "or None to keep no step for being a multiple"
            )
        if self.rank_triggers is not None:
            object.__setattr__(self, "rank_triggers", _trigger_set(self.rank_triggers))


def check_trigger(trigger: str, option: str = "trigger") -> str:
    """``trigger`` if it names a known trigger (:class:`Trigger`), else a ConfigError naming
    ``option`` (the setting that holds it) and the known names. ``Run.save`` and the retention
    policy both check their triggers here."""
    if trigger not in set(Trigger):
        raise ConfigError(
            f"{option}: unknown trigger {trigger!r}; use one of {[t.value for t in Trigger]}"
        )
    return str(trigger)


def _trigger_set(values: Iterable[str]) -> frozenset[str]:
    """``values`` as a frozenset of known trigger names, or ConfigError naming the bad one."""
    if isinstance(values, str):
        raise ConfigError(
            f"retention rank_triggers={values!r} must be a collection of trigger names, "
            f"e.g. {{{values!r}}}, not one string"
        )
    names = frozenset(check_trigger(v, "retention rank_triggers") for v in values)
    if not names:
        raise ConfigError(
            "retention rank_triggers is empty, so no checkpoint could compete for keep_top_k; "
            "use None to rank every checkpoint"
        )
    return names


@dataclass(frozen=True, slots=True)
class Candidate:
    """One committed checkpoint as retention sees it."""

    id: int
    step: int
    metrics: Mapping[str, Any] | None
    trigger: str = Trigger.MANUAL


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
    every = policy.keep_every_n_steps
    if every is not None:
        keep.update(c.id for c in items if c.step % every == 0)
    keep.update(c.id for c in _best(items, policy)[: policy.keep_top_k])
    return {c.id for c in items if c.id not in keep}


def _best(items: list[Candidate], policy: RetentionPolicy) -> list[Candidate]:
    """The candidates that compete for ``keep_top_k``, best first."""
    triggers = policy.rank_triggers
    competing = [c for c in items if triggers is None or c.trigger in triggers]
    name = policy.metric_name
    if name is None:
        return sorted(competing, key=lambda c: (c.step, c.id), reverse=True)
    sign = 1.0 if policy.higher_is_better else -1.0

    def rank(c: Candidate) -> tuple[int, float, int, int]:
        value = _metric(c, name)
        # Missing metrics sort after every present one; ties go to the newer step.
        return (value is None, -sign * (value or 0.0), -c.step, -c.id)

    return sorted(competing, key=rank)
