"""``Run.log_metrics``: per-step metrics kept in memory and written in batches.

A training loop logs a few numbers every step; a database write per step would cost a
transaction (an fsync on SQLite) each time. :class:`StepLog` keeps them and writes every
buffered value in one transaction (:func:`ckptstore.manifest.step_metrics.record`) once
``every_steps`` steps are buffered or ``every_seconds`` have passed since the last write, and
when the run saves or closes (so a checkpoint's steps are on the curve by the time it commits).
"""

from __future__ import annotations

import datetime as dt
import numbers
import time
from collections.abc import Callable, Mapping
from typing import Any

from ckptstore.errors import ConfigError
from ckptstore.manifest.db import Database
from ckptstore.manifest.step_metrics import MAX_NAME, record
from ckptstore.names import check_step

#: Steps buffered before a write (default).
EVERY_STEPS = 100
#: Seconds between writes while steps are logged (default).
EVERY_SECONDS = 30.0


class StepLog:
    """Buffered per-step metrics of one run (not thread-safe: log from the training loop)."""

    def __init__(
        self,
        db: Database,
        run_id: int,
        *,
        every_steps: int = EVERY_STEPS,
        every_seconds: float = EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """A buffer writing to run ``run_id``'s rows of ``db``."""
        if every_steps < 1 or not every_seconds > 0:
            raise ConfigError("metrics are written every >= 1 steps and > 0 seconds")
        self._db = db
        self._run_id = run_id
        self._every_steps = every_steps
        self._every_seconds = every_seconds
        self._clock = clock
        self._pending: dict[tuple[int, str], float] = {}
        self._steps: set[int] = set()
        self._last_write = clock()
        #: Transactions written so far (each holds every value buffered at the time).
        self.writes = 0

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Keep ``metrics`` (name -> number) at ``step``; write the buffer when it is due."""
        check_step(step)
        for name, value in metrics.items():
            self._pending[step, _name(name)] = _number(name, value)
        self._steps.add(step)
        due = self._clock() - self._last_write >= self._every_seconds
        if len(self._steps) >= self._every_steps or due:
            self.flush()

    def flush(self) -> int:
        """Write every buffered value in one transaction; how many (0: nothing was written)."""
        self._last_write = self._clock()
        if not self._pending:
            return 0
        rows = [(step, name, value) for (step, name), value in self._pending.items()]
        at = dt.datetime.now(dt.UTC)
        written = self._db.write(
            lambda session: record(session, self._run_id, rows, at), what="writing step metrics"
        )
        self.writes += 1
        self._pending.clear()
        self._steps.clear()
        return written

    @property
    def pending(self) -> int:
        """Values buffered, not written yet."""
        return len(self._pending)


def _name(name: object) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
        raise ConfigError(f"metric name {name!r}: use a string of 1 to {MAX_NAME} characters")
    return name


def _number(name: str, value: Any) -> float:
    """A metric value as a float: a real number, or anything ``float()`` takes that is no text
    or bool (a numpy scalar, a one-element tensor)."""
    if isinstance(value, bool | str | bytes) or value is None:
        raise ConfigError(f"metric {name!r} is {value!r}: log_metrics takes numbers only")
    if isinstance(value, numbers.Real):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"metric {name!r} is a {type(value).__name__}: log_metrics takes numbers only"
        ) from exc
