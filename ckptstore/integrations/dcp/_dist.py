"""What the save and load wrappers share: where this process stands in its group, DCP's
failures turned into one message, and DCP's single-process warning silenced."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException


def distributed() -> bool:
    """Whether torch.distributed is initialized (else this is one process)."""
    return dist.is_available() and dist.is_initialized()


def rank(process_group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``process_group`` (the default group when None); 0 alone."""
    return dist.get_rank(process_group) if distributed() else 0


def failures(exc: CheckpointException) -> list[tuple[int, BaseException]]:
    """Each failed rank and its error, by rank."""
    found = []
    for failed, failure in sorted(exc.failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        found.append((failed, error if isinstance(error, BaseException) else RuntimeError(error)))
    return found


def summary(exc: CheckpointException) -> tuple[str, BaseException]:
    """Which ranks failed and the first rank's error, for a message; and that error."""
    found = failures(exc)
    first_rank, first = found[0] if found else (-1, exc)
    ranks = [r for r, _ in found]
    return f"rank(s) {ranks}; rank {first_rank}: {type(first).__name__}: {first}", first


@contextlib.contextmanager
def single_process_ok() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialized; in a
    single process that is what the caller means, so the warning is only noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
