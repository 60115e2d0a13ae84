"""Retention's choice (DESIGN.md §8): which committed checkpoints ``to_delete`` marks deleted,
a pure function of the candidates and the policy. The end-to-end case (saves, retention in the
commit's wake, GC) is in test_checkpointer.py."""

from __future__ import annotations

import math
from typing import Any

import pytest

from ckptstore.checkpointer import RetentionPolicy
from ckptstore.checkpointer.retention import Candidate, to_delete
from ckptstore.errors import ConfigError


def C(step: int, metrics: dict[str, Any] | None) -> Candidate:
    return Candidate(id=step, step=step, metrics=metrics)


def R(value: Any) -> dict[str, Any]:
    return {"train:reward": value}


REWARD = "train:reward"
RETENTION_CASES = [
    # (id, candidates, policy, expected deleted steps)
    ("keep-all", [C(s, None) for s in (1, 2, 3)], RetentionPolicy(), set()),
    (
        "keep-all-with-metric",
        [C(1, R(1.0)), C(2, R(0.0))],
        RetentionPolicy(keep_top_k=None, metric_name=REWARD),
        set(),
    ),
    ("empty", [], RetentionPolicy(keep_top_k=1), set()),
    (
        "no-metric-keeps-newest",
        [C(s, R(s)) for s in (1, 2, 3, 4, 5)],
        RetentionPolicy(keep_top_k=2),
        {1, 2, 3},
    ),
    (
        "top-k-zero-keeps-only-latest",
        [C(1, R(9.0)), C(2, R(8.0)), C(3, R(0.0))],
        RetentionPolicy(keep_top_k=0, metric_name=REWARD),
        {1, 2},
    ),
    (
        "higher-is-better",
        [C(1, R(0.5)), C(2, R(0.9)), C(3, R(0.1)), C(4, R(0.7)), C(5, R(0.2))],
        RetentionPolicy(keep_top_k=2, metric_name=REWARD),
        {1, 3},
    ),
    (
        "lower-is-better",
        [C(1, R(0.5)), C(2, R(0.9)), C(3, R(0.1)), C(4, R(0.2)), C(5, R(0.7))],
        RetentionPolicy(keep_top_k=2, metric_name=REWARD, higher_is_better=False),
        {1, 2},
    ),
    (
        "int-and-float-metrics",
        [C(1, R(3)), C(2, R(2.5)), C(3, R(0))],
        RetentionPolicy(keep_top_k=1, metric_name=REWARD),
        {2},
    ),
    (
        "missing-ranks-below-any-value",
        [C(1, R(-5.0)), C(2, None), C(3, {"other": 100.0}), C(4, R(-1.0)), C(5, R(1.0))],
        RetentionPolicy(keep_top_k=3, metric_name=REWARD),
        {2, 3},
    ),
    (
        "missing-ranks-worst-when-lower-is-better",
        [C(1, R(50.0)), C(2, {}), C(3, R(10.0))],
        RetentionPolicy(keep_top_k=2, metric_name=REWARD, higher_is_better=False),
        {2},
    ),
    (
        "nan-ranks-worst",
        [C(1, R(math.nan)), C(2, R(-3.0)), C(3, R(0.5)), C(4, R(0.1))],
        RetentionPolicy(keep_top_k=3, metric_name=REWARD),
        {1},
    ),
    (
        "nan-ranks-worst-when-lower-is-better",
        [C(1, R(math.nan)), C(2, R(3.0)), C(3, R(1.0))],
        RetentionPolicy(keep_top_k=2, metric_name=REWARD, higher_is_better=False),
        {1},
    ),
    (
        "non-numeric-ranks-worst",
        [
            C(1, R("0.9")),
            C(2, R(True)),
            C(3, R([1.0])),
            C(4, R(None)),
            C(5, R(-1.0)),
            C(6, R(-2.0)),
        ],
        RetentionPolicy(keep_top_k=1, metric_name=REWARD),
        {1, 2, 3, 4},
    ),
    (
        "ties-keep-the-newer-step",
        [C(1, R(0.5)), C(2, R(0.5)), C(3, R(0.5)), C(4, R(0.1))],
        RetentionPolicy(keep_top_k=1, metric_name=REWARD),
        {1, 2},
    ),
    (
        "ties-keep-the-newer-steps",
        [C(1, R(0.5)), C(2, R(0.5)), C(3, R(0.5)), C(4, R(0.1))],
        RetentionPolicy(keep_top_k=2, metric_name=REWARD),
        {1},
    ),
    (
        "ties-among-missing-keep-the-newer",
        [C(1, None), C(2, None), C(3, None), C(4, R(1.0))],
        RetentionPolicy(keep_top_k=2, metric_name=REWARD),
        {1, 2},
    ),
    (
        "keep-latest-k-protects-newest",
        [C(1, R(0.9)), C(2, R(0.1)), C(3, R(0.2)), C(4, R(0.3)), C(5, R(0.0))],
        RetentionPolicy(keep_top_k=1, metric_name=REWARD, keep_latest_k=2),
        {2, 3},
    ),
    (
        "keep-latest-k-larger-than-history",
        [C(1, R(0.9)), C(2, R(0.1))],
        RetentionPolicy(keep_top_k=0, metric_name=REWARD, keep_latest_k=5),
        set(),
    ),
    (
        "latest-kept-even-when-worst",
        [C(1, R(0.9)), C(2, R(0.8)), C(3, None)],
        RetentionPolicy(keep_top_k=1, metric_name=REWARD),
        {2},
    ),
    (
        "order-of-input-does-not-matter",
        [C(5, R(0.2)), C(1, R(0.5)), C(4, R(0.7)), C(3, R(0.1)), C(2, R(0.9))],
        RetentionPolicy(keep_top_k=2, metric_name=REWARD),
        {1, 3},
    ),
]


@pytest.mark.parametrize(
    ("candidates", "policy", "expected"),
    [pytest.param(c, p, e, id=i) for i, c, p, e in RETENTION_CASES],
)
def test_retention_to_delete(
    candidates: list[Candidate], policy: RetentionPolicy, expected: set[int]
) -> None:
    assert to_delete(candidates, policy) == expected
    assert to_delete(reversed(candidates), policy) == expected


def test_retention_policy_rejects_negative_counts() -> None:
    with pytest.raises(ConfigError, match="keep_top_k"):
        RetentionPolicy(keep_top_k=-1)
    with pytest.raises(ConfigError, match="keep_latest_k"):
        RetentionPolicy(keep_latest_k=-1)
