"""The watchdog: a run whose pumps wait on each other stops with a line that says why.

Both pumps wait on conditions (ready groups the sampler selects, capacity permits, the sampler's
gate, the in-flight limit). A state that satisfies none of them would stall silently and burn the
allocation. When no train step has finished for ``watchdog.factor`` times the median time between
steps, and at least ``watchdog.min_seconds`` (the floor covers the first steps, a resume's
re-dispatch and slow saves), the controller stops with a :class:`StallError` naming what each
pump waits for; the pending save is flushed as at any other exit, and a re-run resumes from the
newest committed checkpoint.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from trainer.config import TrainerConfig
from trainer.errors import TrainerError
from trainer.ledger import PromptLedger
from trainer.replay import ReplayBuffer
from trainer.samplers import PromptGroupSampler

__all__ = ["PumpState", "StallError", "Watchdog", "diagnose"]

#: How many recent intervals between steps the median is taken over.
WINDOW = 101


class PumpState(Protocol):
    """What the diagnosis reads of the pumps (the controller provides it)."""

    cfg: TrainerConfig
    train_steps: int
    prompts_per_step: int
    capacity: int
    buffer: ReplayBuffer
    sampler: PromptGroupSampler
    ledger: PromptLedger
    exhausted: bool
    #: What the train pump waits for ("groups": groups the sampler selects).
    train_wait: str
    #: > 0: the rollout pump waits for that many capacity permits.
    permits_wanted: int

    @property
    def run_name(self) -> str:
        """The run being trained."""


class StallError(TrainerError):
    """No train step for too long: the message names what each pump waits for."""


class Watchdog:
    """Times the intervals between train steps and calls back once the current one is overdue."""

    def __init__(
        self, factor: float, min_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.factor = factor
        self.min_seconds = min_seconds
        self.clock = clock
        self.intervals: deque[float] = deque(maxlen=WINDOW)
        self.last = clock()

    def restart(self) -> None:
        """Start timing now (once the pumps start)."""
        self.last = self.clock()

    def stepped(self) -> None:
        """A train step finished."""
        now = self.clock()
        self.intervals.append(now - self.last)
        self.last = now

    def median(self) -> float | None:
        return statistics.median(self.intervals) if self.intervals else None

    def limit(self) -> float:
        """Seconds without a step that count as a stall."""
        return max(self.min_seconds, self.factor * (self.median() or 0.0))

    async def watch(self, on_stall: Callable[[float], None]) -> None:
        """Call ``on_stall(idle seconds)`` once the wait for the next step is overdue; returns
        at once when the watchdog is off (factor 0)."""
        if self.factor <= 0:
            return
        while True:
            await asyncio.sleep(min(5.0, max(0.05, self.min_seconds / 10)))
            idle = self.clock() - self.last
            if idle >= self.limit():
                on_stall(idle)
                return


def diagnose(controller: PumpState, watchdog: Watchdog, idle: float) -> str:
    """One line: how long, the limit, and what each pump waits for."""
    median = watchdog.median()
    limit = f"watchdog.min_seconds={watchdog.min_seconds:g}"
    if median is not None:
        limit = f"watchdog.factor={watchdog.factor:g} x the median {median:.2f} s, at least {limit}"
    return (
        f"no train step for {idle:.0f} s in run {controller.run_name!r} at step "
        f"{controller.train_steps} ({limit}): the train pump waits for "
        f"{_train_wait(controller)}; the rollout pump waits for {_rollout_wait(controller)}. "
        "Stopping (exit 1); a re-run resumes from the newest committed checkpoint"
    )


def _train_wait(c: PumpState) -> str:
    if c.train_wait != "groups":
        return c.train_wait
    ready = c.buffer.ready_groups()
    selectable = c.sampler.select(ready, c.train_steps, c.prompts_per_step)
    return (
        f"{c.cfg.min_groups} groups that sampler {c.sampler.name!r} selects at version "
        f"{c.train_steps} ({len(selectable)} selectable of {len(ready)} ready, "
        f"{c.ledger.inflight} prompts in flight, {len(c.ledger.redispatch)} to dispatch again)"
    )


def _rollout_wait(c: PumpState) -> str:
    if c.permits_wanted > 0:
        return (
            f"capacity permits for {c.permits_wanted} more prompts (all "
            f"async_rl.max_buffered_rollouts={c.capacity} are held by buffered or in-flight "
            "groups)"
        )
    if c.exhausted:
        return "nothing: the prompt data is exhausted (grpo.max_num_epochs)"
    if not c.sampler.can_admit(c.train_steps):
        return (
            f"sampler {c.sampler.name!r}'s gate (dispatch index {c.sampler.dispatch_index} is "
            f"async_rl.sampler.gate_window={c.sampler.gate_window} batches ahead of version "
            f"{c.train_steps})"
        )
    return (
        f"rollouts to finish ({c.ledger.inflight} prompts in flight, "
        f"async_rl.max_inflight_prompts={c.cfg.async_rl.max_inflight_prompts})"
    )
