"""The exit codes of ``ckptstore`` (documented in :mod:`ckptstore.cli.main`)."""

from __future__ import annotations

#: Success.
EXIT_OK = 0
#: A check ran and found problems (``verify``, ``db current`` not at head).
EXIT_PROBLEMS = 1
#: A usage or configuration error: a malformed argument, a missing database or store.
EXIT_USAGE = 2
#: A store, database or integrity error: an unknown run, an unreachable server.
EXIT_ERROR = 3
