"""How ``python -m trainer.grpo`` reports a failure: one ``error:`` line and an exit status.

Exit statuses: 0 finished or stopped early; 2 the configuration or the run must be fixed
before a re-run helps (a :class:`~trainer.errors.ConfigurationError` or
:class:`~trainer.errors.ResumeError`; ckptstore's ``ConfigError``, a store or database location
it cannot use; its ``SchemaError``, a database to upgrade); 1 a failure at run time (a save,
the store or the database failing, a stall, a lost worker, rollouts failing, anything
unexpected): a re-run resumes from the newest committed checkpoint. The traceback is printed
only with ``--traceback``.
"""

from __future__ import annotations

from ckptstore.errors import CkptStoreError, ConfigError, SchemaError
from trainer.errors import TrainerError

__all__ = ["error_line", "exit_code", "known_error"]


def known_error(exc: BaseException) -> BaseException | None:
    """A TrainerError or ckptstore error, also when Ray wrapped it (RayTaskError keeps it as
    its cause); None for anything else."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return None
        # Ray's wrapper first: it is also an instance of the error it wraps, but its message is
        # the remote traceback, not the error's own.
        cause = getattr(seen, "cause", None)
        if isinstance(cause, BaseException):
            seen = cause
            continue
        if isinstance(seen, TrainerError | CkptStoreError):
            return seen
        seen = seen.__cause__
    return None


def exit_code(known: BaseException | None) -> int:
    """2 for what the user must fix (configuration, resume, a location, the database's
    schema), else 1."""
    if isinstance(known, TrainerError):
        return known.exit_code
    return 2 if isinstance(known, ConfigError | SchemaError) else 1


def error_line(exc: BaseException, known: BaseException | None) -> str:
    """The failure on one line: a known error's own message; anything else its type, its
    first line and where to get more."""
    if known is not None:
        return " ".join(str(known).split())
    unwrapped = _unwrap(exc)
    lines = [line.strip() for line in str(unwrapped).splitlines() if line.strip()]
    first = lines[0] if lines else "(no message)"
    return (
        f"{type(unwrapped).__name__}: {first} (an unexpected failure; re-run with --traceback "
        "to see where; a re-run resumes from the newest committed checkpoint)"
    )


def _unwrap(exc: BaseException) -> BaseException:
    """The error Ray wrapped (its ``cause``), else ``exc``."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc
