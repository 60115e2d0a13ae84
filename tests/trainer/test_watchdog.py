"""The watchdog (trainer/watchdog.py): a run whose pumps wait on each other stops with one line
naming what each waits for, instead of hanging silently; its limit is a multiple of the median
time between steps, never below its floor."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from trainer_helpers import small_overrides

from trainer.grpo import main
from trainer.replay import Group
from trainer.samplers import WindowedSampler
from trainer.watchdog import Watchdog


class NeverSelects(WindowedSampler):
    """A custom sampler with a bug: it never selects a group, so no step can ever be taken."""

    def select(self, ready: list[Group], trainer_version: int, count: int) -> list[Group]:
        return []


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_limit_is_a_multiple_of_the_median_step_never_below_the_floor() -> None:
    clock = Clock()
    watchdog = Watchdog(factor=20, min_seconds=30, clock=clock)
    assert watchdog.limit() == 30  # no step yet: the floor
    for interval in (1.0, 5.0, 2.0):  # one slow step does not move the median
        clock.now += interval
        watchdog.stepped()
    assert watchdog.median() == 2.0
    assert watchdog.limit() == 40  # 20 x 2 s
    assert Watchdog(factor=5, min_seconds=30, clock=clock).limit() == 30


@pytest.mark.timeout(120)
def test_a_stalled_run_stops_with_one_line_naming_what_each_pump_waits_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = small_overrides(
        tmp_path,
        backend="local",
        **{
            "async_rl.sampler.name": "custom",
            "async_rl.sampler.custom_class": "test_watchdog:NeverSelects",
            "watchdog.min_seconds": 2,
        },
    )
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("error: no train step for ")
    assert "in run 't' at step 0" in line
    assert "the train pump waits for 2 groups that sampler 'custom:" in line
    assert re.search(r"\(0 selectable of \d+ ready", line)
    assert "the rollout pump waits for capacity permits" in line
    assert "async_rl.max_buffered_rollouts=8" in line
