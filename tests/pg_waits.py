"""Waiting, in a test, until PostgreSQL shows that a backend is blocked on a lock.

A race test holds one transaction open and starts a second that must queue behind it; the
test may only release the first once the second is really waiting, or it tests nothing.
``pg_stat_activity`` says so: ``wait_event_type = 'Lock'`` for a backend of this database.
"""

from __future__ import annotations

import time

from sqlalchemy import Engine, text

#: Backends of the engine's database that wait on a heavyweight lock (a row, a table).
LOCK_WAITERS = text(
    "SELECT count(*) FROM pg_stat_activity "
    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
)


def wait_for_a_lock_waiter(
    engine: Engine, waiting_for: str, *, timeout: float = 30.0, interval: float = 0.02
) -> None:
    """Poll until a backend of ``engine``'s database waits on a lock; fail the test after
    ``timeout`` seconds with ``waiting_for`` (what should have blocked) in the message."""
    deadline = time.monotonic() + timeout
    with engine.connect() as conn:
        while True:
            waiting = conn.scalar(LOCK_WAITERS)
            # A new snapshot for the next poll (pg_stat_activity is read once per transaction).
            conn.rollback()
            if waiting:
                return
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"no backend waited on a lock within {timeout:g}s: {waiting_for}"
                )
            time.sleep(interval)
