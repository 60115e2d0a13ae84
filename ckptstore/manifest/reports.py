"""Reports over the manifest for people: a ``Database`` and plain arguments in, dataclasses out.

What ``ckptstore runs``, ``plot`` and ``du`` show, beyond the single-row lookups of
:mod:`ckptstore.manifest.reads`. Each report is one dataclass declared next to the statement
that fills it, so a new field is one line here and appears in the CLI's ``--json`` at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import column, func, select, table

from ckptstore.manifest.db import Database
from ckptstore.manifest.models import BlobRow, CheckpointBlobRow, CheckpointRow, RunRow, Status
from ckptstore.manifest.records import field_names


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
    with db.read() as session:
        rows = session.execute(select(*view.c).order_by(view.c.run))
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
    with db.read() as session:
        rows = session.execute(
            select(CheckpointRow.step, CheckpointRow.status, CheckpointRow.metrics)
            .where(CheckpointRow.run_id == run_id, CheckpointRow.status.in_(statuses))
            .order_by(CheckpointRow.step)
        ).all()
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
    with db.read() as session:
        runs = session.execute(select(RunRow.id, RunRow.name).order_by(RunRow.name)).all()
        all_rows = session.scalar(select(func.coalesce(func.sum(BlobRow.stored_bytes), 0)))
    return UsageReport(
        runs=tuple(_usage(db, name, run_id) for run_id, name in runs),
        total=_usage(db, "TOTAL", None),
        all_blob_rows_stored_bytes=int(all_rows or 0),
    )


def _usage(db: Database, name: str, run_id: int | None) -> Usage:
    committed = select(CheckpointRow.id).where(CheckpointRow.status == Status.COMMITTED)
    if run_id is not None:
        committed = committed.where(CheckpointRow.run_id == run_id)
    digests = (
        select(CheckpointBlobRow.digest)
        .where(CheckpointBlobRow.checkpoint_id.in_(committed))
        .distinct()
    )
    with db.read() as session:
        count, logical = session.execute(
            select(func.count(), func.coalesce(func.sum(CheckpointRow.logical_bytes), 0)).where(
                CheckpointRow.id.in_(committed)
            )
        ).one()
        unique, stored = session.execute(
            select(
                func.coalesce(func.sum(BlobRow.logical_bytes), 0),
                func.coalesce(func.sum(BlobRow.stored_bytes), 0),
            ).where(BlobRow.digest.in_(digests))
        ).one()
    return Usage(name, int(count), int(logical), int(unique), int(stored))
