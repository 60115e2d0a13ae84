"""Asynchronous saves: the handle a save returns, and the one-save-in-flight rule, written once
for ``Run.save`` and ``ShardWriter.save``.

A writer has at most one save in flight. The next save first waits for the previous one, and a
failure nobody has seen yet surfaces there (or at ``finalize()``/``close()``), never silently.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from ckptstore.errors import CkptStoreError, FencedError, SaveError
from ckptstore.manifest.records import CheckpointInfo

log = logging.getLogger("ckptstore.checkpointer")
R = TypeVar("R")
T = TypeVar("T")


def close_on_exit(close: Callable[[], None], exc: BaseException | None, what: str) -> None:
    """Leaving a writer's ``with`` block: ``close()`` (flushing the pending save). If an
    exception is already propagating, a flush failure never masks it: it is logged and
    attached to that exception as a note naming ``what`` ("checkpoint save", ...)."""
    if exc is None:
        close()
        return
    try:
        close()
    except Exception as flush_error:
        log.exception("while handling %r, the pending %s failed too", exc, what)
        exc.add_note(f"ckptstore: the pending {what} also failed: {flush_error!r}")
        if flush_error.__cause__ is not None:
            exc.add_note(f"ckptstore: caused by {flush_error.__cause__!r}")


class Pending(abc.ABC, Generic[R]):
    """A save running in the background (a :class:`SaveHandle`, a shard writer's save): its
    future, and whether its failure has been reported. A subclass says what that failure is
    raised as (:meth:`_failure`); :class:`OneInFlight` raises an unseen one at the next save."""

    def __init__(self, future: Future[R]) -> None:
        self._future = future
        self._reported = False

    def done(self) -> bool:
        """True once the save finished or failed."""
        return self._future.done()

    @abc.abstractmethod
    def _failure(self, error: BaseException) -> BaseException:
        """What a caller waiting on this save gets when it failed with ``error``."""

    def _previous_failure(self, error: BaseException) -> BaseException:
        """What the next save (or ``finalize``) raises for this save's unseen failure."""
        return self._failure(error)

    def _result(self, timeout: float | None) -> R:
        """Wait for the result; raise the failure (counted as reported) if the save failed,
        ``TimeoutError`` (the save goes on, nothing reported) if ``timeout`` seconds pass."""
        error = self._future.exception(timeout)
        if error is None:
            return self._future.result()
        self._reported = True
        failure = self._failure(error)
        if failure is error:
            raise error
        raise failure from error

    def _take_unreported(self) -> BaseException | None:
        """The failure (once) of a finished save nobody has seen fail yet, else None."""
        if self._reported or not self.done():
            return None
        error = self._future.exception()
        if error is None:
            return None
        self._reported = True
        failure = self._previous_failure(error)
        if failure is not error:
            failure.__cause__ = error
        return failure

    def _outcome(self) -> R | None:
        """A finished save's result; None if it failed."""
        return None if self._future.exception() is not None else self._future.result()


H = TypeVar("H", bound=Pending[Any])


class OneInFlight(Generic[H]):
    """One background thread and at most one save in flight, for one writer (a run, a shard
    writer). The writer calls :meth:`settle` before each new save, which waits for the previous
    one and raises its failure if nobody has seen it yet."""

    def __init__(self, thread_name_prefix: str) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=thread_name_prefix)
        self._pending: H | None = None

    def submit(self, job: Callable[[], T], handle: Callable[[Future[T]], H]) -> H:
        """Run ``job`` in the background and return ``handle(its future)``; the caller has
        settled the previous save."""
        pending = handle(self._executor.submit(job))
        self._pending = pending
        return pending

    def settle(self) -> H | None:
        """Wait for the save in flight and forget it; raise its failure if nobody has seen it.
        Returns the finished save, or None if none was in flight."""
        pending = self._pending
        if pending is None:
            return None
        pending._future.exception()  # wait without raising; an interrupt leaves it pending
        self._pending = None
        failure = pending._take_unreported()
        if failure is not None:
            raise failure
        return pending

    def shutdown(self) -> None:
        """Stop the background thread (after the save in flight)."""
        self._executor.shutdown(wait=True)


class SaveHandle(Pending[CheckpointInfo]):
    """An asynchronous save. ``wait()`` returns the committed checkpoint or raises SaveError."""

    def __init__(
        self, step: int, future: Future[CheckpointInfo], blocked_seconds: float, *, run: str
    ) -> None:
        super().__init__(future)
        self.step = step
        self.blocked_seconds = blocked_seconds
        self.run = run

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """The committed checkpoint. Raises ``TimeoutError`` (the save goes on) if ``timeout``
        seconds pass first, ``SaveError`` (or ``FencedError``) if the save failed."""
        return self._result(timeout)

    def _failure(self, error: BaseException) -> BaseException:
        if isinstance(error, SaveError | FencedError):
            return error
        if isinstance(error, CkptStoreError):
            return SaveError(f"checkpoint save at step {self.step} failed: {error}")
        return SaveError(
            f"checkpoint save at step {self.step} failed: {type(error).__name__}: {error}"
        )

    def _previous_failure(self, error: BaseException) -> BaseException:
        return SaveError(
            f"the previous checkpoint save (step {self.step}) of run {self.run!r} "
            f"failed: {error}; nothing from it was committed"
        )
