"""The exit codes of ``ckptstore``, and what each means (``ckptstore --help`` prints them)."""

from __future__ import annotations

#: Success.
EXIT_OK = 0
#: A check ran and found problems (``verify``, ``db current`` not at head).
EXIT_PROBLEMS = 1
#: A usage or configuration error: a malformed argument, a refused query, a missing database or
#: store.
EXIT_USAGE = 2
#: What was asked for does not exist (an unknown run or step), or a store, database or integrity
#: error: an unreachable server, a blob that fails its digest.
EXIT_ERROR = 3

#: Each code and when a script sees it.
MEANINGS = {
    EXIT_OK: "success",
    EXIT_PROBLEMS: "a check found problems (verify, db current)",
    EXIT_USAGE: "usage or configuration error (a malformed argument, a refused query, a wrong "
    "--db/--store)",
    EXIT_ERROR: "not found (an unknown run or step), or a store, database or integrity error",
}
