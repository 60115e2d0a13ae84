"""Asynchronous saves: the handle a save returns, and the one-save-in-flight rule.

A writer has at most one save in flight. The next save first waits for the previous one, and a
failure nobody has seen yet surfaces there (or at ``finalize()``/``close()``), never silently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ckptstore.errors import CkptStoreError, FencedError, SaveError
from ckptstore.manifest.records import CheckpointInfo

log = logging.getLogger("ckptstore.checkpointer")


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


class SaveHandle:
    """An asynchronous save. ``wait()`` returns the committed checkpoint or raises SaveError."""

    def __init__(self, step: int, future: Future[CheckpointInfo], blocked_seconds: float) -> None:
        self.step = step
        self.blocked_seconds = blocked_seconds
        self._future = future
        self._reported = False

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """The committed checkpoint. Raises ``TimeoutError`` (the save goes on) if ``timeout``
        seconds pass first, ``SaveError`` (or ``FencedError``) if the save failed."""
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise  # still running: neither a failure nor reported
        except CkptStoreError as exc:
            self._reported = True
            if isinstance(exc, SaveError | FencedError):
                raise
            raise SaveError(f"checkpoint save at step {self.step} failed: {exc}") from exc
        except Exception as exc:
            self._reported = True
            raise SaveError(
                f"checkpoint save at step {self.step} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _unreported_error(self) -> BaseException | None:
        if self._reported or not self._future.done():
            return None
        return self._future.exception()


class SaveQueue:
    """One background thread and at most one save in flight for one writer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-save-{name}")
        self._pending: SaveHandle | None = None

    def submit(
        self, step: int, job: Callable[[], CheckpointInfo], blocked_seconds: float
    ) -> SaveHandle:
        """Run ``job`` in the background; the caller has waited for the previous save."""
        handle = SaveHandle(step, self._executor.submit(job), blocked_seconds)
        self._pending = handle
        return handle

    def wait_previous(self) -> None:
        """Wait for the save in flight; raise its failure if nobody has seen it yet."""
        previous = self._pending
        if previous is None:
            return
        try:
            previous._future.exception()  # wait, without raising yet
        finally:
            self._pending = None if previous.done() else previous
        error = previous._unreported_error()
        if error is not None:
            previous._reported = True
            raise SaveError(
                f"the previous checkpoint save (step {previous.step}) of run {self.name!r} "
                f"failed: {error}; nothing from it was committed"
            ) from error

    def finalize(self) -> CheckpointInfo | None:
        """Wait for the save in flight; its record, or its unreported error raised."""
        handle = self._pending
        if handle is None:
            return None
        self.wait_previous()
        return handle._future.result() if handle._future.exception() is None else None

    def shutdown(self) -> None:
        """Stop the background thread (after the save in flight)."""
        self._executor.shutdown(wait=True)
