"""Reports over the manifest for people: a ``Database`` and plain arguments in, dataclasses out.

What ``ckptstore runs``, ``plot`` and ``du`` show, beyond the single-row lookups of
:mod:`ckptstore.manifest.reads`. Each report is one dataclass declared next to the statement
that fills it, so a new field is one line here and appears in the CLI's ``--json`` at once.

The statements run on SQLAlchemy Core over the light tables of
:mod:`ckptstore.manifest.lookups` (:meth:`Database.connect
<ckptstore.manifest.db.Database.connect>`), so ``ckptstore runs`` and ``du`` never import the
ORM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import column, func, select, table
from sqlalchemy.engine import Connection

from ckptstore.manifest import lookups
from ckptstore.manifest.db import Database
from ckptstore.manifest.lookups import blobs, checkpoint_blobs, checkpoints, runs
from ckptstore.manifest.records import field_names
from ckptstore.manifest.statuses import Status


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One row of the ``run_summary`` view: a run's counts, newest step, best metric and bytes
    (of its committed checkpoints)."""

    run: str
    checkpoints: int
    committed: int
    failed: int
    latest_step: int | None
    metric_name: str | None
    #: The best value of the run's metric over its committed checkpoints.
    best_metric: float | None
    logical_bytes: int | None
    stored_bytes: int | None
    #: Logical bytes per byte stored for them (deduplication and compression together).
    dedup_ratio: float | None


def run_summaries(db: Database) -> list[RunSummary]:
    """Every run's summary, by run name."""
    # The view's columns are named after the record's fields: a new field selects its column.
    view = table("run_summary", *(column(name) for name in field_names(RunSummary)))
    with db.connect() as conn:
        rows = conn.execute(select(*view.c).order_by(view.c.run))
        return [RunSummary(**row._asdict()) for row in rows]


@dataclass(frozen=True, slots=True)
class MetricPoint:
    """A checkpoint's value of one metric."""

    step: int
    value: float
    status: str


def metric_points(
    db: Database,
    run_id: int,
    metric: str,
    statuses: Sequence[str] = (Status.COMMITTED, Status.DELETED),
) -> list[MetricPoint]:
    """The numeric values of ``metric`` in the run's checkpoints in ``statuses``, by step
    (a checkpoint without the metric, or with a value that is not a number, has no point)."""
    query = lookups.of_run(run_id, statuses).with_only_columns(
        checkpoints.c.step, checkpoints.c.status, checkpoints.c.metrics
    )
    with db.connect() as conn:
        rows = conn.execute(query).all()
    points = []
    for step, status, metrics in rows:
        value = metrics.get(metric) if isinstance(metrics, dict) else None
        # bool is an int to Python, but True is no loss value.
        if isinstance(value, int | float) and not isinstance(value, bool):
            points.append(MetricPoint(step, float(value), status))
    return points


@dataclass(frozen=True, slots=True)
class Usage:
    """Bytes of a run's committed checkpoints (or of all of them: ``TOTAL``)."""

    name: str
    checkpoints: int
    #: Bytes of state the committed checkpoints hold, as if each were stored on its own.
    logical_bytes: int
    #: Raw bytes of the distinct blobs they reference (after deduplication).
    unique_bytes: int
    #: Bytes those blobs occupy in the store (after compression).
    stored_bytes: int

    @property
    def dedup_ratio(self) -> float | None:
        """Logical bytes per unique byte (None without blobs)."""
        return self.logical_bytes / self.unique_bytes if self.unique_bytes else None

    @property
    def compression_ratio(self) -> float | None:
        """Unique bytes per stored byte (None without blobs)."""
        return self.unique_bytes / self.stored_bytes if self.stored_bytes else None


@dataclass(frozen=True, slots=True)
class UsageReport:
    """Usage per run (by name), over all committed checkpoints, and of every blob row."""

    runs: tuple[Usage, ...]
    total: Usage
    #: Stored bytes of every blob row, referenced or not (what a GC may still free).
    all_blob_rows_stored_bytes: int


def usage(db: Database) -> UsageReport:
    """Logical versus stored bytes, per run and overall."""
    with db.connect() as conn:
        named = conn.execute(select(runs.c.id, runs.c.name).order_by(runs.c.name)).all()
        all_rows = conn.scalar(select(func.coalesce(func.sum(blobs.c.stored_bytes), 0)))
        return UsageReport(
            runs=tuple(_usage(conn, name, run_id) for run_id, name in named),
            total=_usage(conn, "TOTAL", None),
            all_blob_rows_stored_bytes=int(all_rows or 0),
        )


def _usage(conn: Connection, name: str, run_id: int | None) -> Usage:
    committed = select(checkpoints.c.id).where(checkpoints.c.status == Status.COMMITTED)
    if run_id is not None:
        committed = committed.where(checkpoints.c.run_id == run_id)
    digests = (
        select(checkpoint_blobs.c.digest)
        .where(checkpoint_blobs.c.checkpoint_id.in_(committed))
        .distinct()
    )
    count, logical = conn.execute(
        select(func.count(), func.coalesce(func.sum(checkpoints.c.logical_bytes), 0)).where(
            checkpoints.c.id.in_(committed)
        )
    ).one()
    unique, stored = conn.execute(
        select(
            func.coalesce(func.sum(blobs.c.logical_bytes), 0),
            func.coalesce(func.sum(blobs.c.stored_bytes), 0),
        ).where(blobs.c.digest.in_(digests))
    ).one()
    return Usage(name, int(count), int(logical), int(unique), int(stored))
