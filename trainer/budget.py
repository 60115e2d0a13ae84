"""When one start of the trainer stops early: its time budget and its step budget.

``checkpointing.checkpoint_must_save_by`` is a deadline counted from process start (a job's time
limit): it is never overrun. Before every train step, and after it, the time left must hold one
more step (the mean step time of this start) and a save (the longest save seen, or the saved
checkpoint's when resuming); when it does not, the trainer saves what it has not saved yet and
stops at once. A deadline already passed before the first step (start-up ate the budget) stops
the start without training: nothing new exists to save. ``checkpointing.stop_after_steps=N``
counts train steps instead: each start trains N steps, saves and stops, however long start-up
took (the demo's budget).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["StopBudget"]


class StopBudget:
    """The time and step budgets of one start, and the line saying why it stopped."""

    def __init__(
        self,
        seconds: float | None,
        process_start: float,
        steps: int | None,
        clock: Callable[[], float],
    ) -> None:
        #: checkpoint_must_save_by as seconds from ``process_start`` (wall clock), or None.
        self.seconds = seconds
        self.process_start = process_start
        #: stop_after_steps: train steps per start, or None.
        self.steps = steps
        self.clock = clock
        #: The longest save (snapshot to commit) seen so far; a stop must leave room for one.
        self.save_seconds = 0.0
        self.fired = False

    def elapsed(self) -> float:
        """Seconds since process start."""
        return self.clock() - self.process_start

    def remaining(self) -> float | None:
        """Seconds left of the time budget (negative once overrun), or None without one."""
        if self.seconds is None:
            return None
        return self.seconds - self.elapsed()

    def monotonic_end(self) -> float | None:
        """The time budget's end as a ``time.monotonic()`` instant, or None."""
        remaining = self.remaining()
        return None if remaining is None else time.monotonic() + remaining

    def saved(self, seconds: float | None) -> None:
        """A save took ``seconds`` (snapshot to commit): the estimate of the next one."""
        if seconds is not None:
            self.save_seconds = max(self.save_seconds, seconds)

    def _needed(self, mean_step: float | None) -> float:
        return (mean_step or 0.0) + self.save_seconds

    def out_of_time(self, mean_step: float | None) -> bool:
        """Whether the time left cannot hold one more step and its save (with no step timed
        yet: whether it cannot hold a save, so a deadline already passed always counts)."""
        remaining = self.remaining()
        return remaining is not None and remaining <= self._needed(mean_step)

    def left_to_wait(self, mean_step: float | None) -> float | None:
        """How long the next step may wait for its groups before the time left cannot hold
        it and a save (0 when it already cannot), or None without a time budget."""
        remaining = self.remaining()
        return None if remaining is None else max(0.0, remaining - self._needed(mean_step))

    def after_step(self, steps_done: int, mean_step: float | None) -> str | None:
        """Once per start: ``"steps"`` or ``"time"`` when the step just taken (the
        ``steps_done``-th of this start) must be saved and the start must stop; else None."""
        if self.fired:
            return None
        if self.steps is not None and steps_done >= self.steps:
            self.fired = True
            return "steps"
        if self.out_of_time(mean_step):
            self.fired = True
            return "time"
        return None

    def stop_line(self, why: str, run: str, step: int, mean_step: float | None, saved: bool) -> str:
        """The line that says truthfully why this start stops and what it saved."""
        if why == "steps":
            plural = "" if self.steps == 1 else "s"
            head = f"checkpointing.stop_after_steps={self.steps}: this start trained "
            head += f"{self.steps} step{plural}"
        else:
            assert self.seconds is not None
            left = self.seconds - self.elapsed()
            when = f"{-left:.0f} s ago" if left < 0 else f"in {left:.1f} s"
            need = f"a save ({self.save_seconds:.2f} s)"
            if mean_step is not None:
                need = f"another step ({mean_step:.2f} s) and {need}"
            head = (
                f"checkpoint_must_save_by: the time budget ({self.seconds:.0f} s from process "
                f"start) runs out {when}, too soon for {need}"
            )
        if saved:
            tail = f"saved step {step} of run {run!r} and stopping early"
        else:
            tail = f"nothing new to save (run {run!r} stays at step {step}); stopping early"
        return f"{head}; {tail}. Re-run the same command to resume."

    def startup_line(self, run: str, step: int, new_run: bool) -> str:
        """The line for a start whose time budget ran out before its first step."""
        assert self.seconds is not None
        where = (
            f"run {run!r} is new: nothing trained yet (the warm-up model is stored)"
            if new_run
            else f"run {run!r} stays at its checkpoint of step {step}"
        )
        return (
            f"checkpoint_must_save_by: the time budget ({self.seconds:.0f} s from process start) "
            f"ran out before the first step of this start (start-up took {self.elapsed():.0f} s); "
            f"nothing new to save: {where}. Stopping early; give it a later deadline, or use "
            "checkpointing.stop_after_steps=N to train N steps per start."
        )
