"""What each prompt-group sampler (DESIGN.md §9.4) trains on, drops and aborts, the buffer
capacity it needs, and whether it is on-policy, checked against a simulated controller."""

from __future__ import annotations

import pytest

pytest.importorskip("tensordict")

from sampler_groups import grp, ids, opts

from trainer.replay import Group
from trainer.samplers import (
    InOrderSampler,
    PromptGroupSampler,
    ReadyFirstSampler,
    WeightFifoSampler,
    WindowedSampler,
)

# -- windowed ---------------------------------------------------------------------------------


def test_windowed_selects_inside_the_window_oldest_first() -> None:
    sampler = WindowedSampler(opts(max_staleness_versions=2))
    ready = [
        grp(1, 5, dispatch_index=5),
        grp(2, 2, dispatch_index=2),  # below [3, 5]
        grp(3, 3, dispatch_index=4),
        grp(4, 4, dispatch_index=4),
        grp(5, 3, dispatch_index=3),
        grp(6, 6, dispatch_index=6),  # above v (not possible in practice, still excluded)
        grp(7, 4, dispatch_index=1),  # a failed prompt of batch 1, re-dispatched at v=4
    ]
    assert ids(sampler.select(ready, 5, 10)) == [5, 3, 7, 4, 1]
    assert ids(sampler.select(ready, 5, 3)) == [5, 3, 7]
    assert sampler.select(ready, 5, 0) == []
    assert sampler.select([], 5, 3) == []


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_windowed_window_is_inclusive(staleness: int) -> None:
    sampler = WindowedSampler(opts(max_staleness_versions=staleness))
    v = 10
    ready = [grp(sw, sw, dispatch_index=sw) for sw in range(13)]
    assert ids(sampler.select(ready, v, 100)) == list(range(v - staleness, v + 1))
    evicted = sampler.evict(ready, v)
    assert ids(evicted) == list(range(v - staleness))
    for group in ready:
        unready = grp(group.group_id, group.start_weight, ready=False)
        assert sampler.should_abort_inflight(unready, v) is (group.start_weight < v - staleness)


def test_windowed_evicts_ready_groups_only() -> None:
    sampler = WindowedSampler(opts(max_staleness_versions=1))
    groups = [grp(1, 0), grp(2, 0, ready=False), grp(3, 4), grp(4, 1, ready=False)]
    assert ids(sampler.evict(groups, 4)) == [1]
    # The unready ones below the window are aborted instead.
    assert [sampler.should_abort_inflight(g, 4) for g in groups] == [True, True, False, True]


# -- weight_fifo ------------------------------------------------------------------------------


def test_weight_fifo_selects_oldest_in_window_first() -> None:
    sampler = WeightFifoSampler(opts(max_staleness_versions=1, gate_window=3))
    ready = [
        grp(1, 4, dispatch_index=4),
        grp(2, 3, dispatch_index=3),
        grp(3, 2, dispatch_index=2),  # stale at v=4
        grp(4, 3, dispatch_index=2),
        grp(5, 4, dispatch_index=3),
        grp(6, 4, dispatch_index=1),  # a failed prompt of batch 1, re-dispatched at v=4
    ]
    # Oldest weights first, then dispatch order.
    assert ids(sampler.select(ready, 4, 10)) == [4, 2, 6, 5, 1]
    assert ids(sampler.select(ready, 4, 3)) == [4, 2, 6]
    assert ids(sampler.select(ready, 4, 1)) == [4]


def test_weight_fifo_evicts_and_aborts_below_the_window() -> None:
    sampler = WeightFifoSampler(opts(max_staleness_versions=2))
    groups = [grp(1, 0), grp(2, 1), grp(3, 2), grp(4, 5), grp(5, 0, ready=False)]
    assert ids(sampler.evict(groups, 4)) == [1, 2]  # ready ones only
    assert ids(sampler.evict(groups, 2)) == []
    # An in-flight rollout below the window would be evicted the moment it is ready.
    assert [g.group_id for g in groups if sampler.should_abort_inflight(g, 4)] == [1, 2, 5]
    assert not any(sampler.should_abort_inflight(g, 2) for g in groups)


# -- in_order ---------------------------------------------------------------------------------


def test_in_order_stamps_target_step_with_the_dispatch_index() -> None:
    sampler = InOrderSampler(opts(gate_window=2))
    stamps = []
    while sampler.can_admit(0):
        stamps.append((sampler.admit(0), sampler.dispatch_index))
    assert stamps == [(0, 0), (1, 1), (2, 2)]


def test_in_order_selects_exactly_the_due_step() -> None:
    sampler = InOrderSampler(opts(gate_window=2, max_staleness_versions=0))
    ready = [
        grp(7, 0, dispatch_index=1, target_step=1),
        grp(3, 1, dispatch_index=1, target_step=1),
        grp(5, 2, dispatch_index=2, target_step=2),
        grp(1, 0, dispatch_index=0, target_step=0),
        grp(9, 0, dispatch_index=1, target_step=None),
        grp(4, 0, dispatch_index=1, target_step=1),
    ]
    # Due at version 1: target_step == 1, by group id, whatever start_weight or staleness says.
    assert ids(sampler.select(ready, 1, 10)) == [3, 4, 7]
    assert ids(sampler.select(ready, 1, 2)) == [3, 4]
    assert ids(sampler.select(ready, 0, 10)) == [1]
    assert ids(sampler.select(ready, 2, 10)) == [5]
    assert sampler.select(ready, 3, 10) == []


def test_in_order_evicts_and_aborts_passed_targets() -> None:
    sampler = InOrderSampler()
    groups = [
        grp(1, 0, target_step=0),
        grp(2, 0, target_step=1),
        grp(3, 0, target_step=2),
        grp(4, 0, target_step=None),
    ]
    assert ids(sampler.evict(groups, 2)) == [1, 2]
    assert ids(sampler.evict(groups, 0)) == []
    assert ids(sampler.evict(groups, 99)) == [1, 2, 3]
    aborts = [
        sampler.should_abort_inflight(grp(g.group_id, 0, target_step=g.target_step, ready=False), 2)
        for g in groups
    ]
    assert aborts == [True, True, False, False]


# -- ready_first ------------------------------------------------------------------------------


def test_ready_first_selects_started_groups_by_dispatch_order() -> None:
    sampler = ReadyFirstSampler(opts(gate_window=4, max_staleness_versions=0))
    ready = [
        grp(1, 3, dispatch_index=6),
        grp(2, 0, dispatch_index=0),  # very stale: still usable
        grp(3, 5, dispatch_index=7),  # started after v=4
        grp(4, 4, dispatch_index=5),
        grp(5, 2, dispatch_index=3),
    ]
    assert ids(sampler.select(ready, 4, 10)) == [2, 5, 4, 1]
    assert ids(sampler.select(ready, 4, 2)) == [2, 5]
    assert ids(sampler.select(ready, 0, 10)) == [2]


def test_ready_first_never_evicts_or_aborts() -> None:
    sampler = ReadyFirstSampler(opts(max_staleness_versions=0))
    groups = [grp(1, 0, target_step=0), grp(2, 0, ready=False), grp(3, 50)]
    for v in (0, 10, 1000):
        assert sampler.evict(groups, v) == []
        assert not any(sampler.should_abort_inflight(g, v) for g in groups)


# -- capacity and policy ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "gate_window", "prompts", "expected"),
    [
        (WindowedSampler, 3, 8, 8),
        (WeightFifoSampler, 1, 8, 8),
        (WeightFifoSampler, 3, 8, 24),
        (InOrderSampler, 2, 5, 10),
        (ReadyFirstSampler, 4, 3, 12),
    ],
)
def test_required_buffer_capacity(
    cls: type[PromptGroupSampler], gate_window: int, prompts: int, expected: int
) -> None:
    assert cls(opts(gate_window=gate_window)).required_buffer_capacity(prompts) == expected


@pytest.mark.parametrize(
    ("cls", "options", "expected"),
    [
        (WindowedSampler, {"max_staleness_versions": 0}, True),
        (WindowedSampler, {"max_staleness_versions": 1}, False),
        (InOrderSampler, {"gate_window": 1, "max_staleness_versions": 0}, False),
        (InOrderSampler, {"gate_window": 2, "max_staleness_versions": 0}, False),
        (WeightFifoSampler, {"max_staleness_versions": 0}, True),
        (WeightFifoSampler, {"max_staleness_versions": 1}, False),
        (ReadyFirstSampler, {"max_staleness_versions": 0}, False),
    ],
)
def test_is_on_policy(
    cls: type[PromptGroupSampler], options: dict[str, int], expected: bool
) -> None:
    assert cls(opts(**options)).is_on_policy is expected


def simulate(
    sampler: PromptGroupSampler, *, steps: int = 6, prompts: int = 2
) -> list[tuple[int, int]]:
    """Drive a sampler like the controller does; return (start_weight, version) per trained group.

    Rollouts finish at once; capacity is ``required_buffer_capacity``; the rollout pump admits
    whenever the gate and capacity allow, including while a train step runs (a selected group
    frees its permit when it is selected, before the trainer's version moves on).
    """
    capacity = sampler.required_buffer_capacity(prompts)
    buffer: list[Group] = []
    trained: list[tuple[int, int]] = []
    next_id = 0

    def pump(v: int) -> None:
        nonlocal next_id
        while sampler.can_admit(v) and len(buffer) + prompts <= capacity:
            target = sampler.admit(v)
            for _ in range(prompts):
                buffer.append(
                    grp(next_id, v, dispatch_index=sampler.dispatch_index, target_step=target)
                )
                next_id += 1

    for v in range(steps):
        for _ in range(10):
            pump(v)
            for group in sampler.evict(buffer, v):
                buffer.remove(group)
            chosen = sampler.select(buffer, v, prompts)
            if len(chosen) == prompts:
                break
        else:
            raise AssertionError(f"{sampler.name} made no progress at version {v}")
        for group in chosen:
            buffer.remove(group)
            trained.append((group.start_weight, v))
        pump(v)
    return trained


@pytest.mark.parametrize(
    ("cls", "options", "bound"),
    [
        (WindowedSampler, {"max_staleness_versions": 0}, 0),
        (WindowedSampler, {"max_staleness_versions": 2}, 2),
        (WeightFifoSampler, {"max_staleness_versions": 1, "gate_window": 1}, 1),
        (WeightFifoSampler, {"max_staleness_versions": 3, "gate_window": 2}, 2),
        (InOrderSampler, {"gate_window": 1}, 1),
        (InOrderSampler, {"gate_window": 3}, 3),
        (ReadyFirstSampler, {"gate_window": 2}, 2),
    ],
)
def test_simulated_training_stays_within_the_staleness_bound(
    cls: type[PromptGroupSampler], options: dict[str, int], bound: int
) -> None:
    trained = simulate(cls(opts(**options)))
    assert len(trained) == 12
    assert all(0 <= v - sw <= bound for sw, v in trained), trained
    if cls is InOrderSampler:
        # Batch k trains at version k, two prompts per batch.
        assert [v for _, v in trained] == [k // 2 for k in range(12)]


@pytest.mark.parametrize(
    ("cls", "options"),
    [
        (WindowedSampler, {"max_staleness_versions": 0}),
        (WindowedSampler, {"max_staleness_versions": 1}),
        (WeightFifoSampler, {"max_staleness_versions": 1}),
        (WeightFifoSampler, {"max_staleness_versions": 0, "gate_window": 2}),
        (ReadyFirstSampler, {}),
        (InOrderSampler, {"gate_window": 2}),
        (InOrderSampler, {"gate_window": 1}),
    ],
)
def test_is_on_policy_matches_what_the_sampler_trains_on(
    cls: type[PromptGroupSampler], options: dict[str, int]
) -> None:
    sampler = cls(opts(**options))
    trained = simulate(sampler)
    assert sampler.is_on_policy is all(sw == v for sw, v in trained), trained
