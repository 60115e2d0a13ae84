"""Retries with exponential backoff and full jitter for transient object-store faults."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ckptstore.errors import ConfigError

T = TypeVar("T")
log = logging.getLogger("ckptstore.objectstore")


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How often and how patiently transient faults are retried."""

    #: Total attempts per request, the first included.
    max_attempts: int = 8
    #: Backoff before the second attempt, in seconds; doubles each time up to ``max_delay``.
    base_delay: float = 0.1
    #: Cap on one backoff, in seconds.
    max_delay: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("RetryPolicy.max_attempts must be >= 1")
        if self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ConfigError("RetryPolicy needs 0 <= base_delay <= max_delay")

    def delay(self, attempt: int) -> float:
        """Full-jitter backoff before attempt number ``attempt + 1`` (``attempt`` >= 1)."""
        return random.uniform(0.0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1)))


def call_with_retries(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    describe: Callable[[], str],
    redact: Callable[[str], str] = str,
) -> T:
    """Call ``fn`` until it succeeds, a fault is not transient, or attempts run out.

    Each retry is logged at DEBUG only: a fault that outlasts the retries reaches the caller
    as the one error to report, and one that heals is noted once, at INFO, when it does.
    ``redact`` cleans a fault's text before it is logged (e.g. of credentials in a URL).
    """
    attempt = 1
    while True:
        try:
            result = fn()
        except Exception as exc:
            if attempt >= policy.max_attempts or not is_transient(exc):
                raise
            pause = policy.delay(attempt)
            log.debug(
                "%s: transient fault (%s: %s), attempt %d/%d, retrying in %.2fs",
                describe(),
                type(exc).__name__,
                redact(str(exc)),
                attempt,
                policy.max_attempts,
                pause,
            )
            time.sleep(pause)
            attempt += 1
        else:
            if attempt > 1:
                log.info("%s: succeeded on attempt %d after transient faults", describe(), attempt)
            return result
