"""Prompt-group samplers (DESIGN.md §9.4): gating, the dispatch index on resume, and building
a sampler from ``async_rl.sampler`` (a custom one by ``module:Class``). What each built-in
trains on, drops and aborts is in test_sampler_selection.py."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("tensordict")

from sampler_groups import grp, ids, opts

from trainer.config import SamplerConfig
from trainer.replay import Group
from trainer.samplers import (
    InOrderSampler,
    PromptGroupSampler,
    ReadyFirstSampler,
    WeightFifoSampler,
    WindowedSampler,
    make_sampler,
)

GATED = [WeightFifoSampler, InOrderSampler, ReadyFirstSampler]
ALL = [WindowedSampler, *GATED]


# -- custom samplers loaded by make_sampler("custom") from this very module -------------------


class MySampler(PromptGroupSampler):
    """Gated; trains on the newest group ids first."""

    name = "mine"
    gated = True

    def __init__(self, config: SamplerConfig | None = None) -> None:
        super().__init__(config)
        self.config = config

    def select(self, ready: list[Group], trainer_version: int, count: int) -> list[Group]:
        return sorted(ready, key=lambda g: -g.group_id)[:count]


class InheritsAName(WindowedSampler):
    """Keeps the built-in's name, so make_sampler renames it."""


class NotASampler:
    name = "nope"


NOT_A_CLASS = MySampler(None)


# -- construction, admission and the dispatch index -------------------------------------------


@pytest.mark.parametrize("cls", ALL)
def test_defaults_are_the_config_s(cls: type[PromptGroupSampler]) -> None:
    sampler = cls()
    defaults = SamplerConfig()
    assert sampler.dispatch_index == -1
    assert sampler.max_staleness_versions == defaults.max_staleness_versions
    assert sampler.gate_window == defaults.gate_window
    assert sampler.gated is (cls is not WindowedSampler)


@pytest.mark.parametrize("cls", ALL)
def test_admit_counts_batches_from_minus_one(cls: type[PromptGroupSampler]) -> None:
    sampler = cls(opts(gate_window=100))
    stamps = [sampler.admit(0) for _ in range(4)]
    assert sampler.dispatch_index == 3
    if cls is InOrderSampler:
        assert stamps == [0, 1, 2, 3]
    else:
        assert stamps == [None] * 4


@pytest.mark.parametrize("cls", GATED)
@pytest.mark.parametrize("gate_window", [1, 2, 3])
@pytest.mark.parametrize("version", [0, 4])
def test_gated_samplers_wait_gate_window_batches_ahead(
    cls: type[PromptGroupSampler], gate_window: int, version: int
) -> None:
    sampler = cls(opts(gate_window=gate_window))
    admitted = 0
    while sampler.can_admit(version) and admitted < 100:
        sampler.admit(version)
        admitted += 1
        # Never admitted past the gate: the index of the last admitted batch <= v + window.
        assert sampler.dispatch_index <= version + gate_window
    # Batches 0 .. v + gate_window were admitted; it waits while dispatch_index >= v + window.
    assert admitted == version + gate_window + 1
    assert sampler.dispatch_index == version + gate_window
    assert not sampler.can_admit(version)
    assert not sampler.can_admit(version - 1)
    # One train step later, exactly one more batch may go.
    assert sampler.can_admit(version + 1)
    sampler.admit(version + 1)
    assert not sampler.can_admit(version + 1)


@pytest.mark.parametrize("cls", GATED)
def test_gate_boundary_is_exact(cls: type[PromptGroupSampler]) -> None:
    sampler = cls(opts(gate_window=2))
    for index, expected in [(-1, True), (3, True), (4, True), (5, False), (6, False)]:
        sampler.dispatch_index = index
        assert sampler.can_admit(3) is expected, index


@pytest.mark.parametrize("gate_window", [1, 5])
def test_windowed_is_never_gated(gate_window: int) -> None:
    sampler = WindowedSampler(opts(gate_window=gate_window, max_staleness_versions=0))
    for _ in range(50):
        assert sampler.can_admit(0)
        assert sampler.admit(0) is None
    assert sampler.dispatch_index == 49
    assert sampler.can_admit(0)


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("step", [0, 1, 7])
def test_set_dispatch_index_resumes_at_the_step(cls: type[PromptGroupSampler], step: int) -> None:
    sampler = cls(opts(gate_window=1))
    sampler.admit(0)
    sampler.admit(0)
    sampler.set_dispatch_index(step)
    assert sampler.dispatch_index == step - 1
    stamp = sampler.admit(step)
    # The next admitted batch is batch ``step``.
    assert sampler.dispatch_index == step
    assert stamp == (step if cls is InOrderSampler else None)


@pytest.mark.parametrize("cls", GATED)
def test_resumed_gate_lets_the_window_through(cls: type[PromptGroupSampler]) -> None:
    sampler = cls(opts(gate_window=2))
    sampler.set_dispatch_index(5)
    admitted = []
    while sampler.can_admit(5):
        sampler.admit(5)
        admitted.append(sampler.dispatch_index)
    assert admitted == [5, 6, 7]


# -- make_sampler (the name and the ranges are async_rl.sampler's to check: test_config) --------


def custom(target: str, **options: Any) -> SamplerConfig:
    return SamplerConfig(name="custom", custom_class=target, **options)


@pytest.mark.parametrize("cls", ALL)
def test_make_sampler_builds_the_builtins_with_their_options(cls: type[PromptGroupSampler]) -> None:
    sampler = make_sampler(SamplerConfig(name=cls.name, max_staleness_versions=3, gate_window=5))
    assert type(sampler) is cls
    assert sampler.name == cls.name
    assert (sampler.max_staleness_versions, sampler.gate_window) == (3, 5)


def test_make_sampler_loads_a_custom_sampler() -> None:
    config = custom("test_samplers:MySampler", gate_window=3)
    sampler = make_sampler(config)
    assert type(sampler) is MySampler
    assert sampler.name == "mine"
    assert sampler.gate_window == 3
    assert sampler.config is config
    # It works like any sampler: gated by its window, selecting its own way.
    admitted = 0
    while sampler.can_admit(0):
        assert sampler.admit(0) is None
        admitted += 1
    assert admitted == 4
    assert ids(sampler.select([grp(1, 0), grp(3, 0), grp(2, 0)], 0, 2)) == [3, 2]
    assert sampler.evict([grp(1, -50)], 0) == []


def test_a_custom_sampler_with_a_builtin_name_is_renamed() -> None:
    sampler = make_sampler(custom("test_samplers:InheritsAName"))
    assert type(sampler) is InheritsAName
    assert sampler.name == "custom:test_samplers:InheritsAName"
    assert InheritsAName.name == "windowed"  # the class itself is untouched


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ("no_such_module_xyz:MySampler", r"cannot load custom sampler .*no_such_module_xyz"),
        ("test_samplers:NoSuchClass", r"cannot load custom sampler .*NoSuchClass"),
        ("test_samplers:", r"cannot load custom sampler"),
        (":MySampler", r"cannot load custom sampler"),
        (".relative:MySampler", r"cannot load custom sampler"),
    ],
)
def test_make_sampler_refuses_a_class_it_cannot_load(target: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_sampler(custom(target))


@pytest.mark.parametrize("target", ["test_samplers:NotASampler", "test_samplers:NOT_A_CLASS"])
def test_make_sampler_refuses_what_is_not_a_sampler_class(target: str) -> None:
    with pytest.raises(TypeError, match=rf"custom sampler {target!r} is not a PromptGroupSampler"):
        make_sampler(custom(target))
