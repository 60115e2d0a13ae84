"""Reports over the manifest for people: a ``Database`` and plain arguments in, dataclasses out.

What ``ckptstore runs``, ``plot`` and ``du`` show, beyond the single-row lookups of
:mod:`ckptstore.manifest.reading`. Each report is one dataclass declared next to the statement
that fills it, so a new field is one line here and appears in the CLI's ``--json`` at once.

The statements run on SQLAlchemy Core over the light tables of
:mod:`ckptstore.manifest._sql.tables` (:meth:`Database.connect
<ckptstore.manifest.db.Database.connect>`), so ``ckptstore runs`` and ``du`` never import the
ORM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import ColumnElement, Select, Subquery, column, func, select, table
from sqlalchemy.engine import Connection

from ckptstore.manifest._sql import lookups
from ckptstore.manifest._sql.tables import blobs, checkpoint_blobs, checkpoints, runs
from ckptstore.manifest.db import Database
from ckptstore.manifest.statuses import Status


@dataclass(frozen=True, slots=True)
class RunSummary:
    """A run's line in ``ckptstore runs``: its counts, newest step and best metric (the
    ``run_summary`` view's columns of those names) and the bytes of its committed checkpoints
    (:class:`Usage`, the same figures as ``du``)."""

    run: str
    checkpoints: int
    committed: int
    failed: int
    #: Checkpoints marked corrupt (damage found by a load or ``verify``, until repaired).
    corrupt: int
    #: Checkpoints deleted by retention (their rows stay, for history and ``plot``).
    deleted: int
    latest_step: int | None
    metric_name: str | None
    #: The best value of the run's metric over its committed checkpoints.
    best_metric: float | None
    logical_bytes: int
    stored_bytes: int
    #: :attr:`Usage.dedup_ratio`.
    dedup_ratio: float | None
    #: :attr:`Usage.compression_ratio`.
    compression_ratio: float | None


#: What RunSummary takes from the run_summary view (the view's own ``dedup_ratio``, logical bytes
#: per stored byte, is not the CLI's: see :class:`Usage`).
_FROM_VIEW = (
    "run",
    "checkpoints",
    "committed",
    "failed",
    "latest_step",
    "metric_name",
    "best_metric",
)


def run_summaries(db: Database) -> list[RunSummary]:
    """Every run's summary, by run name."""
    view = table("run_summary", column("run_id"), *(column(name) for name in _FROM_VIEW))
    counted = (
        select(checkpoints.c.run_id, checkpoints.c.status, func.count())
        .where(checkpoints.c.status.in_([Status.CORRUPT, Status.DELETED]))
        .group_by(checkpoints.c.run_id, checkpoints.c.status)
    )
    with db.connect() as conn:
        rows = conn.execute(select(*view.c).order_by(view.c.run)).all()
        usage = _usage_by(conn, by_run=True)
        by_status: dict[tuple[Any, str], int] = {
            (run_id, str(status)): int(n) for run_id, status, n in conn.execute(counted)
        }
    summaries = []
    for row in rows:
        used = usage.get(row.run_id) or Usage(row.run, 0, 0, 0, 0, 0)
        summaries.append(
            RunSummary(
                **{name: getattr(row, name) for name in _FROM_VIEW},
                corrupt=by_status.get((row.run_id, Status.CORRUPT), 0),
                deleted=by_status.get((row.run_id, Status.DELETED), 0),
                logical_bytes=used.logical_bytes,
                stored_bytes=used.stored_bytes,
                dedup_ratio=used.dedup_ratio,
                compression_ratio=used.compression_ratio,
            )
        )
    return summaries


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
    query = lookups.select_checkpoints_of(run_id, statuses).with_only_columns(
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
    """Bytes of a run's committed checkpoints (or of all of them: ``TOTAL``).

    One definition for ``du`` and ``runs``: *dedup* is how many times over the stored blobs are
    used -- the blobs' raw bytes as each checkpoint references them, per raw byte of the
    distinct blobs (1.00x: no checkpoint shares a blob with another); *compression* is raw
    bytes per byte stored. Both count every blob, the indexes and pack tables that hold no
    tensor data included, so neither falls below 1 for want of them in ``logical_bytes``.
    """

    name: str
    checkpoints: int
    #: Bytes of state the committed checkpoints hold (tensor data), as if each were stored alone.
    logical_bytes: int
    #: Raw bytes of the blobs each checkpoint references, summed over the checkpoints (a blob
    #: three checkpoints share counts three times).
    referenced_bytes: int
    #: Raw bytes of the distinct blobs they reference (after deduplication).
    unique_bytes: int
    #: Bytes those blobs occupy in the store (after compression).
    stored_bytes: int

    @property
    def dedup_ratio(self) -> float | None:
        """Referenced bytes per unique byte (None without blobs)."""
        return self.referenced_bytes / self.unique_bytes if self.unique_bytes else None

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
        per_run = _usage_by(conn, by_run=True)
        total = _usage_by(conn, by_run=False).get(None)
    return UsageReport(
        runs=tuple(
            replace(per_run[run_id], name=name) if run_id in per_run else Usage(name, 0, 0, 0, 0, 0)
            for run_id, name in named
        ),
        total=replace(total, name="TOTAL") if total else Usage("TOTAL", 0, 0, 0, 0, 0),
        all_blob_rows_stored_bytes=int(all_rows or 0),
    )


def _usage_by(conn: Connection, *, by_run: bool) -> dict[Any, Usage]:
    """Usage of the committed checkpoints, by run id (``by_run``) or in all (key None), in three
    grouped statements whatever the number of runs; a Usage's name is set by the caller."""
    group = [checkpoints.c.run_id] if by_run else []
    committed = checkpoints.c.status == Status.COMMITTED
    counts = select(
        *group, func.count(), func.coalesce(func.sum(checkpoints.c.logical_bytes), 0)
    ).where(committed)
    # One row per (run,) checkpoint and blob; DISTINCT over (run,) digest for the unique bytes.
    refs = (
        select(*group, checkpoint_blobs.c.digest)
        .join_from(
            checkpoints, checkpoint_blobs, checkpoint_blobs.c.checkpoint_id == checkpoints.c.id
        )
        .where(committed)
    )
    referenced = _sum_blobs(refs.subquery(), by_run, blobs.c.logical_bytes)
    unique = _sum_blobs(
        refs.distinct().subquery(), by_run, blobs.c.logical_bytes, blobs.c.stored_bytes
    )
    found: list[dict[Any, tuple[int, ...]]] = []
    for statement in (counts.group_by(*group), referenced, unique):
        rows = conn.execute(statement).all()
        found.append({(row[0] if by_run else None): row[int(by_run) :] for row in rows})
    counted, summed, distinct = found

    def usage_of(key: Any, count: int, logical: int) -> Usage:
        (referenced,) = summed.get(key, (0,))
        unique, stored = distinct.get(key, (0, 0))
        numbers = (count, logical, referenced, unique, stored)
        return Usage("", *(int(n or 0) for n in numbers))

    return {key: usage_of(key, *row) for key, row in counted.items()}


def _sum_blobs(refs: Subquery, by_run: bool, *sums: ColumnElement[Any]) -> Select[Any]:
    """The sum of ``sums`` over the blobs ``refs`` lists, grouped by its run id if ``by_run``."""
    group = [refs.c.run_id] if by_run else []
    return (
        select(*group, *(func.coalesce(func.sum(s), 0) for s in sums))
        .join_from(refs, blobs, blobs.c.digest == refs.c.digest)
        .group_by(*group)
    )
