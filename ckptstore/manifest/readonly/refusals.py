"""What ``ckptstore sql`` accepts, and the one-line refusals and timeouts both backends report."""

from __future__ import annotations

import re

from ckptstore.errors import ConfigError, DatabaseError

PG_ACCEPTED = "SELECT, WITH ... SELECT, VALUES, TABLE, or EXPLAIN of one of them (no ANALYZE)"
SQLITE_ACCEPTED = "SELECT, WITH ... SELECT, VALUES, or EXPLAIN [QUERY PLAN] of one of them"
ANALYZE = frozenset({"ANALYZE", "ANALYSE"})


def refuse_kind(keyword: str, accepted: str) -> ConfigError:
    """The refusal of a statement that starts with ``keyword`` (layer 1)."""
    if keyword.upper() in ANALYZE:
        return ConfigError(
            f"`ckptstore sql` is read-only and does not run EXPLAIN ANALYZE; it accepts {accepted}"
        )
    if not keyword:
        got = "got no statement"
    elif re.fullmatch(r"[A-Za-z_]+", keyword):
        got = f"got {keyword.upper()}"
    else:
        got = f"got {keyword[:20]!r}"
    return ConfigError(f"`ckptstore sql` runs one read-only query: {accepted}; {got}")


def one_statement_only(accepted: str) -> ConfigError:
    """The refusal of a second statement after a ``;``."""
    return ConfigError(
        f"`ckptstore sql` runs one read-only statement; remove what follows the ';' (it accepts "
        f"{accepted})"
    )


def timed_out(timeout: float) -> DatabaseError:
    """The error of a query cancelled at its deadline."""
    return DatabaseError(
        f"query timed out after {timeout:g} s and was cancelled; allow longer with "
        "--timeout SECONDS"
    )
