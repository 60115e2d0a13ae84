"""Bounds on one fuzz input: a wall-clock cap (a loop) and an address-space limit (an
allocation that a few bytes of input should not be able to ask for)."""

from __future__ import annotations

import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class InputTimeout(BaseException):
    """An input ran past its time cap. A BaseException, so that no ``except Exception`` in
    the code under test can swallow it."""


def _expired(signum: int, frame: FrameType | None) -> None:
    raise InputTimeout


@contextmanager
def time_cap(seconds: float) -> Iterator[None]:
    """Raise :class:`InputTimeout` in this (main) thread if the block runs past ``seconds``.
    Python code is interrupted at once; a C call, when it returns."""
    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def cap_address_space(headroom: int) -> int:
    """Limit this process's address space to what it maps now plus ``headroom`` bytes, so a
    larger allocation fails with MemoryError instead of succeeding; returns the limit."""
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = kib * 1024 + headroom
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit


def memory_error_in(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised from or during, a MemoryError."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, MemoryError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False
