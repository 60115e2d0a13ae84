"""Each checkpoint's retention fate, in words: kept by which rule, or gone and why.

The manifest records what retention did (``deleted``, with no error; a re-saved step's older
checkpoint is ``deleted`` with "superseded by ..."), not the policy it applied. The run's
config may record that policy under the key ``retention`` (:func:`policy_of`; the fields of
:class:`~ckptstore.checkpointer.RetentionPolicy` but ``metric_name``/``higher_is_better``,
which the run row holds); then each kept checkpoint is explained by the rules that keep it,
ranked exactly as :func:`ckptstore.checkpointer.retention.to_delete` ranks (a test holds the
two together). Without it, a kept checkpoint shows its rank by the run's metric.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptstore.manifest.serving import SavePoint
from ckptstore.manifest.statuses import Status

KEPT = "kept"


@dataclass(frozen=True, slots=True)
class Policy:
    """What the run's config says its retention keeps (``config["retention"]``)."""

    keep_top_k: int | None = None
    keep_latest_k: int = 0
    keep_every_n_steps: int | None = None
    rank_triggers: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Fate:
    """A checkpoint's status in a word (kept, deleted, failed, corrupt, pending, local) and
    why."""

    verdict: str
    why: str


def policy_of(config: Mapping[str, Any] | None) -> Policy | None:
    """The retention policy a run's config records under ``retention``, or None if it has
    none or it is malformed (a page explains less, it does not fail)."""
    raw = (config or {}).get("retention")
    if not isinstance(raw, Mapping):
        return None
    top, latest, every = (raw.get(k) for k in ("keep_top_k", "keep_latest_k", "keep_every_n_steps"))
    triggers = raw.get("rank_triggers")
    if not (
        _count_or_none(top)
        and _count_or_none(latest)
        and _count_or_none(every)
        and (
            triggers is None
            or (isinstance(triggers, list) and all(isinstance(t, str) for t in triggers))
        )
    ):
        return None
    return Policy(
        top, latest or 0, every or None, None if triggers is None else frozenset(triggers)
    )


def _count_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def fates(
    points: Sequence[SavePoint], metric: str | None, higher_is_better: bool, policy: Policy | None
) -> dict[int, Fate]:
    """Checkpoint id -> its fate, for every checkpoint of one run."""
    committed = [p for p in points if p.status == Status.COMMITTED]
    kept = _kept_reasons(committed, metric, higher_is_better, policy)
    # Most fates repeat ("deleted by retention"): one record each, shared.
    shared: dict[tuple[str, str], Fate] = {}
    found = {}
    for p in points:
        if p.status == Status.COMMITTED:
            key = (KEPT, "; ".join(kept.get(p.id, ())) or "kept")
        elif p.status == Status.DELETED:
            key = (p.status, p.error or "deleted by retention")
        elif p.status == Status.PENDING:
            key = (p.status, "being saved (or its writer died; gc marks it failed)")
        elif p.status == Status.LOCAL:
            key = (p.status, "on node-local tiers only: a drain commits it")
        else:
            key = (p.status, p.error or p.status)
        found[p.id] = shared.get(key) or shared.setdefault(key, Fate(*key))
    return found


def _kept_reasons(
    committed: Sequence[SavePoint],
    metric: str | None,
    higher_is_better: bool,
    policy: Policy | None,
) -> dict[int, list[str]]:
    newest = sorted(committed, key=lambda p: (p.step, p.id), reverse=True)
    reasons: dict[int, list[str]] = {p.id: [] for p in committed}
    if newest:
        reasons[newest[0].id].append("latest")
    if policy is None:
        if metric is not None:
            ranked = ranked_by_metric(committed, metric, higher_is_better, None)
            for rank, p in enumerate(ranked, 1):
                reasons[p.id].append(f"#{rank} of {len(ranked)} by {metric}")
        return reasons
    if policy.keep_top_k is None:
        for p in committed:
            reasons[p.id].append("retention keeps every checkpoint")
        return reasons
    for p in newest[1 : policy.keep_latest_k]:
        reasons[p.id].append(f"among the {policy.keep_latest_k} newest")
    every = policy.keep_every_n_steps
    if every is not None:
        for p in committed:
            if p.step % every == 0:
                reasons[p.id].append(f"step a multiple of {every}")
    best = ranked_by_metric(committed, metric, higher_is_better, policy.rank_triggers)
    by = f"by {metric}" if metric else "newest"
    for rank, p in enumerate(best[: policy.keep_top_k], 1):
        reasons[p.id].append(f"top {policy.keep_top_k} {by} (#{rank})")
    for p in committed:
        if not reasons[p.id]:
            reasons[p.id].append("no rule of the recorded policy keeps it (policy changed?)")
    return reasons


def ranked_by_metric(
    points: Sequence[SavePoint],
    metric: str | None,
    higher_is_better: bool,
    triggers: frozenset[str] | None,
) -> list[SavePoint]:
    """The points that compete (trigger in ``triggers``, or all), best first: retention's
    order (a missing or non-numeric metric ranks worst, ties go to the newer step; without a
    metric, newest first)."""
    competing = [p for p in points if triggers is None or p.trigger in triggers]
    if metric is None:
        return sorted(competing, key=lambda p: (p.step, p.id), reverse=True)
    sign = 1.0 if higher_is_better else -1.0

    def rank(p: SavePoint) -> tuple[bool, float, int, int]:
        value = metric_value(p.metrics, metric)
        return (value is None, -sign * (value or 0.0), -p.step, -p.id)

    return sorted(competing, key=rank)


def metric_value(metrics: Mapping[str, Any] | None, name: str) -> float | None:
    """``metrics[name]`` as a float, or None if absent, not a number (bools are not) or NaN."""
    value = (metrics or {}).get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isnan(value) else float(value)
