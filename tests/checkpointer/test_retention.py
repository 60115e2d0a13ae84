"""Retention's choice (DESIGN.md §8, §9.6): which committed checkpoints ``to_delete`` marks
deleted, a pure function of the candidates and the policy; and the same rules end to end,
through ``open_run(retention=...)`` and real saves (more in test_checkpointer.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from ckptstore.checkpointer import RetentionPolicy, open_run
from ckptstore.checkpointer.retention import Candidate, to_delete
from ckptstore.errors import ConfigError
from ckptstore.manifest.models import Trigger
from ckptstore.objectstore import LocalStore


def C(step: int, metrics: dict[str, Any] | None, trigger: str = "period") -> Candidate:
    return Candidate(id=step, step=step, metrics=metrics, trigger=trigger)


def R(value: Any) -> dict[str, Any]:
    return {"train:reward": value}


REWARD = "train:reward"
#: The reference trainer's example: periodic saves at 2, 4, 6, 8 and a time-limit save at 7.
REFERENCE = [
    C(2, R(0.5)),
    C(4, R(0.6)),
    C(6, R(0.4)),
    C(7, R(0.9), "timeout"),
    C(8, R(0.3)),
]
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
    # rank_triggers: only some triggers compete for keep_top_k (the reference's rule).
    (
        "reference-only-periodic-saves-rank",
        REFERENCE,
        RetentionPolicy(keep_top_k=2, metric_name=REWARD, rank_triggers=frozenset({"period"})),
        {6, 7},  # kept 2, 4 (best periodic) and 8 (latest); the timeout save goes
    ),
    (
        "reference-every-save-ranks",
        REFERENCE,
        RetentionPolicy(keep_top_k=2, metric_name=REWARD),
        {2, 6},  # kept 7 and 4 (best) and 8 (latest)
    ),
    (
        "non-ranked-kept-by-keep-latest-k",
        REFERENCE,
        RetentionPolicy(
            keep_top_k=2, metric_name=REWARD, rank_triggers=frozenset({"period"}), keep_latest_k=2
        ),
        {6},
    ),
    (
        "a-non-ranked-latest-is-kept",
        [C(1, R(0.1)), C(2, R(0.2)), C(3, None, "last")],
        RetentionPolicy(keep_top_k=1, metric_name=REWARD, rank_triggers=frozenset({"period"})),
        {1},
    ),
    (
        "several-rank-triggers",
        [C(1, R(0.9), "manual"), C(2, R(0.8), "timeout"), C(3, R(0.7)), C(4, R(0.1), "last")],
        RetentionPolicy(
            keep_top_k=2, metric_name=REWARD, rank_triggers=frozenset({"period", "timeout"})
        ),
        {1},
    ),
    (
        "rank-triggers-without-metric-keeps-newest-ranked",
        [C(1, None), C(2, None), C(3, None, "timeout"), C(4, None, "manual")],
        RetentionPolicy(keep_top_k=1, rank_triggers=frozenset({"period"})),
        {1, 3},
    ),
    (
        "top-k-zero-with-rank-triggers",
        REFERENCE,
        RetentionPolicy(keep_top_k=0, metric_name=REWARD, rank_triggers=frozenset({"period"})),
        {2, 4, 6, 7},
    ),
    # keep_every_n_steps: multiples of n are kept whatever else happens.
    (
        "every-n-steps-kept",
        [C(s, R(s / 10)) for s in range(1, 11)],
        RetentionPolicy(keep_top_k=1, metric_name=REWARD, keep_every_n_steps=4),
        {1, 2, 3, 5, 6, 7, 9},  # kept 4, 8 (multiples) and 10 (best, latest)
    ),
    (
        "every-n-steps-with-top-k",
        [C(s, R(-s)) for s in range(1, 11)],
        RetentionPolicy(keep_top_k=2, metric_name=REWARD, keep_every_n_steps=5),
        {3, 4, 6, 7, 8, 9},  # kept 1, 2 (best), 5 (multiple), 10 (multiple, latest)
    ),
    (
        "every-n-steps-protects-non-ranked",
        REFERENCE,
        RetentionPolicy(
            keep_top_k=1,
            metric_name=REWARD,
            rank_triggers=frozenset({"period"}),
            keep_every_n_steps=7,
        ),
        {2, 6},  # kept 4 (best periodic), 7 (multiple of 7, though a timeout save), 8 (latest)
    ),
    (
        "every-n-steps-keeps-step-zero",
        [C(0, R(0.0)), C(1, R(0.0)), C(2, R(1.0))],
        RetentionPolicy(keep_top_k=0, metric_name=REWARD, keep_every_n_steps=3),
        {1},
    ),
    (
        "every-n-steps-alone-deletes-nothing",
        [C(s, None) for s in range(1, 6)],
        RetentionPolicy(keep_every_n_steps=2),
        set(),
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


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"keep_every_n_steps": 0}, "keep_every_n_steps=0 must be >= 1"),
        ({"keep_every_n_steps": -3}, "keep_every_n_steps=-3 must be >= 1"),
        ({"rank_triggers": {"periodic"}}, r"rank_triggers: unknown trigger 'periodic'"),
        ({"rank_triggers": "period"}, "not one string"),
        ({"rank_triggers": []}, "rank_triggers is empty"),
    ],
)
def test_retention_policy_rejects_bad_options(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RetentionPolicy(keep_top_k=2, **options)


def test_rank_triggers_accepts_any_iterable_and_stores_a_frozenset() -> None:
    expected = frozenset({"period", "timeout"})
    for given in (["period", "timeout"], ("timeout", "period"), {Trigger.PERIOD, Trigger.TIMEOUT}):
        policy = RetentionPolicy(keep_top_k=1, rank_triggers=given)  # type: ignore[arg-type]
        assert policy.rank_triggers == expected
        assert type(policy.rank_triggers) is frozenset
        assert all(type(t) is str for t in policy.rank_triggers)
    generated = RetentionPolicy(keep_top_k=1, rank_triggers=(t for t in ["last"]))  # type: ignore[arg-type]
    assert generated.rank_triggers == frozenset({"last"})
    assert RetentionPolicy(keep_top_k=1) == RetentionPolicy(keep_top_k=1, rank_triggers=None)


def test_rank_triggers_and_every_n_steps_end_to_end(db_url: str, store: LocalStore) -> None:
    policy = RetentionPolicy(
        keep_top_k=2,
        metric_name=REWARD,
        rank_triggers=frozenset({"period"}),
        keep_every_n_steps=5,
    )
    state = {"policy": {"w": torch.arange(100, dtype=torch.float32)}}
    plan = [(2, "period", 0.5), (4, "period", 0.6), (5, "timeout", 0.0), (6, "period", 0.4)]
    plan += [(7, "timeout", 0.9), (8, "period", 0.3)]
    with open_run("retain-triggers", db=db_url, store=store, retention=policy) as run:
        for step, trigger, reward in plan:
            run.save(step, state, trigger=trigger, metrics=R(reward)).wait()
        kept = [c.step for c in run.checkpoints(["committed"])]
        deleted = [c.step for c in run.checkpoints(["deleted"])]
        # 2 and 4: best periodic; 5: a multiple of 5; 8: the latest. 7 had the best metric, but
        # a timeout save does not compete; 6 fell out of the top 2.
        assert kept == [2, 4, 5, 8]
        assert deleted == [6, 7]
        run.save(9, state, trigger="last", metrics=R(0.0)).wait()
        assert [c.step for c in run.checkpoints(["committed"])] == [2, 4, 5, 9]


def test_save_and_policy_refuse_an_unknown_trigger_alike(db_url: str, store: LocalStore) -> None:
    """One check serves ``Run.save(trigger=...)`` and ``rank_triggers``: the same message, naming
    the setting and the known triggers; the refused save leaves no checkpoint."""
    known = str([t.value for t in Trigger])
    with pytest.raises(ConfigError, match="rank_triggers: unknown trigger 'periodic'") as policy:
        RetentionPolicy(keep_top_k=1, rank_triggers={"periodic"})
    assert known in str(policy.value)
    with open_run("bad-trigger", db=db_url, store=store) as run:
        with pytest.raises(ConfigError, match="trigger: unknown trigger 'periodic'") as save:
            run.save(1, {"policy": {"w": torch.zeros(2)}}, trigger="periodic")
        assert known in str(save.value)
        assert run.checkpoints() == []
