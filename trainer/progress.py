"""Progress lines: what a long start-up phase of the trainer is doing, with the time so far.

Starting Ray, the warm-up, opening the run and its newest checkpoint and waiting for the first
rollouts take from a few seconds to a minute under load; each phase is one short line,
``[  12.3s] starting ...`` (seconds since process start). ``python -m trainer.grpo`` prints them
on stderr when stderr is a terminal or with ``--progress``, never into a log by default.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["progress_line", "wanted"]


def progress_line(process_start: float, what: str) -> str:
    """``what`` begins now: one line with the seconds since ``process_start``."""
    return f"[{time.time() - process_start:7.1f}s] {what}"


def wanted(forced: bool, stream: TextIO | None = None) -> bool:
    """Whether progress lines are printed: ``--progress``, or ``stream`` (stderr) is a TTY."""
    stream = sys.stderr if stream is None else stream
    return forced or stream.isatty()
