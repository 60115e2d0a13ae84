"""Per-step metrics (``step_metrics``, migration 0008): writing a batch, reading the curves.

A checkpoint's ``metrics`` are the values at saves; this table holds a value per training step
(the loss curve), written by ``Run.log_metrics`` in batches: :func:`record` writes one batch in
the caller's transaction, with one statement. Logging a step again replaces its value (a run
resumed from an earlier checkpoint trains those steps again). NaN is stored as NULL (SQLite
keeps no NaN in a REAL column), on both databases alike.

As plain SQL (``ckptstore sql``)::

    SELECT m.step, m.value FROM step_metrics m JOIN runs r ON r.id = m.run_id
    WHERE r.name = 'base' AND m.name = 'loss' ORDER BY m.step
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import DateTime, Float, column, func, select, table
from sqlalchemy.engine import Connection

#: The table as a light Core clause (no ORM: readers import this).
step_metrics = table(
    "step_metrics",
    column("run_id"),
    column("name"),
    column("step"),
    column("value", Float()),
    column("recorded_at", DateTime(timezone=True)),
)
#: The longest metric name the table holds.
MAX_NAME = 255


def record(
    conn: Any, run_id: int, values: Iterable[tuple[int, str, float]], at: dt.datetime
) -> int:
    """Write ``(step, name, value)`` rows of run ``run_id`` in one statement on ``conn`` (a
    Connection or Session, in the caller's transaction), replacing a step's earlier value;
    how many rows."""
    rows = [
        {
            "run_id": run_id,
            "name": name,
            "step": step,
            "value": None if math.isnan(value) else value,
            "recorded_at": at,
        }
        for step, name, value in values
    ]
    if not rows:
        return 0
    dialect = conn.get_bind().dialect.name if hasattr(conn, "get_bind") else conn.dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    statement = insert(step_metrics)
    statement = statement.on_conflict_do_update(
        index_elements=["run_id", "name", "step"],
        set_={"value": statement.excluded.value, "recorded_at": statement.excluded.recorded_at},
    )
    conn.execute(statement, rows)
    return len(rows)


def metric_names(conn: Connection, run_id: int) -> list[str]:
    """The names of the metrics run ``run_id`` logged per step, sorted."""
    query = (
        select(step_metrics.c.name)
        .where(step_metrics.c.run_id == run_id)
        .group_by(step_metrics.c.name)
        .order_by(step_metrics.c.name)
    )
    return [str(name) for name in conn.scalars(query)]


def curves(
    conn: Connection, run_id: int, names: Sequence[str], max_points: int
) -> dict[str, list[tuple[int, float]]]:
    """Each of ``names``' (step, value) points in step order (NaN steps left out), thinned
    evenly to at most ``max_points`` (the first and the last kept)."""
    found: dict[str, list[tuple[int, float]]] = {}
    for name in names:
        query = (
            select(step_metrics.c.step, step_metrics.c.value)
            .where(
                step_metrics.c.run_id == run_id,
                step_metrics.c.name == name,
                step_metrics.c.value.is_not(None),
            )
            .order_by(step_metrics.c.step)
        )
        points = [(int(step), float(value)) for step, value in conn.execute(query)]
        found[name] = thin(points, max_points)
    return found


def thin(points: list[tuple[int, float]], max_points: int) -> list[tuple[int, float]]:
    """At most ``max_points`` of ``points``, evenly spaced, the first and the last kept."""
    if len(points) <= max_points or max_points < 2:
        return points
    stride = (len(points) - 1) / (max_points - 1)
    return [points[round(i * stride)] for i in range(max_points)]


def count(conn: Connection, run_id: int) -> int:
    """How many per-step values run ``run_id`` has."""
    query = select(func.count()).select_from(step_metrics).where(step_metrics.c.run_id == run_id)
    return int(conn.scalar(query) or 0)
