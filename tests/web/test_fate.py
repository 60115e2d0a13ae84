"""Retention fates: the reasons the view gives for keeping a checkpoint are retention's own rules
(held against :func:`ckptstore.checkpointer.retention.to_delete` on random histories)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.checkpointer.retention import Candidate, RetentionPolicy, to_delete
from ckptstore.manifest.serving import SavePoint
from ckptstore.manifest.statuses import Status, Trigger
from ckptstore.web.fate import Policy, fates, policy_of

NO_RULE = "no rule of the recorded policy keeps it"
VALUES = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-3, 3),
    st.booleans(),
    st.text(max_size=2),
)
TRIGGERS = st.sampled_from([t.value for t in Trigger])


def point(ident: int, step: int, status: str = Status.COMMITTED, **fields: Any) -> SavePoint:
    values: dict[str, Any] = {
        "trigger": Trigger.PERIOD,
        "metrics": None,
        "error": None,
        "logical_bytes": 0,
        "stored_bytes": 0,
        "uploaded_bytes": 0,
        "save_seconds": None,
        "blocked_seconds": None,
    }
    return SavePoint(ident, step, status, **(values | fields))


@settings(max_examples=300, deadline=None)
@given(
    history=st.lists(st.tuples(st.integers(0, 12), TRIGGERS, VALUES), max_size=10),
    top=st.one_of(st.none(), st.integers(0, 4)),
    latest=st.integers(0, 3),
    every=st.one_of(st.none(), st.integers(1, 4)),
    triggers=st.one_of(st.none(), st.sets(TRIGGERS, min_size=1)),
    metric=st.sampled_from([None, "m"]),
    higher=st.booleans(),
)
def test_kept_checkpoints_are_exactly_those_retention_keeps(
    history: list[tuple[int, str, Any]],
    top: int | None,
    latest: int,
    every: int | None,
    triggers: set[str] | None,
    metric: str | None,
    higher: bool,
) -> None:
    points = [
        point(i + 1, step, trigger=trigger, metrics={"m": value})
        for i, (step, trigger, value) in enumerate(history)
    ]
    policy = Policy(top, latest, every, None if triggers is None else frozenset(triggers))
    explained = fates(points, metric, higher, policy)
    kept = {p.id for p in points if NO_RULE not in explained[p.id].why}
    retention = RetentionPolicy(
        keep_top_k=top,
        keep_latest_k=latest,
        keep_every_n_steps=every,
        rank_triggers=triggers,
        metric_name=metric,
        higher_is_better=higher,
    )
    candidates = [Candidate(p.id, p.step, p.metrics, p.trigger) for p in points]
    assert kept == {p.id for p in points} - to_delete(candidates, retention)


def test_fates_of_gone_checkpoints_say_why() -> None:
    points = [
        point(1, 1, Status.DELETED),
        point(2, 2, Status.DELETED, error="superseded by checkpoint 3, a newer save of step 2"),
        point(3, 2),
        point(4, 3, Status.FAILED, error="SaveError: the store refused"),
        point(5, 4, Status.PENDING),
    ]
    found = fates(points, None, True, None)
    assert found[1].why == "deleted by retention"
    assert found[2].why.startswith("superseded by checkpoint 3")
    assert (found[3].verdict, found[3].why) == ("kept", "latest")
    assert (found[4].verdict, found[4].why) == ("failed", "SaveError: the store refused")
    assert found[5].verdict == "pending"


def test_without_a_recorded_policy_kept_ones_show_their_rank() -> None:
    points = [point(i, i, metrics={"loss": loss}) for i, loss in ((1, 0.5), (2, 0.1), (3, 0.9))]
    found = fates(points, "loss", False, None)
    assert found[2].why == "#1 of 3 by loss"
    assert found[3].why == "latest; #3 of 3 by loss"


def test_policy_of_reads_the_config_and_ignores_a_malformed_one() -> None:
    config = {
        "retention": {"keep_top_k": 3, "keep_every_n_steps": 100, "rank_triggers": ["period"]}
    }
    assert policy_of(config) == Policy(3, 0, 100, frozenset({"period"}))
    assert policy_of({"retention": {}}) == Policy()
    for bad in (
        None,
        {},
        {"retention": 3},
        {"retention": {"keep_top_k": -1}},
        {"retention": {"keep_top_k": True}},
        {"retention": {"rank_triggers": "period"}},
    ):
        assert policy_of(bad) is None
