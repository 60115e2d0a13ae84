"""Runs and checkpoints looked up by name, step or recency, in SQLAlchemy Core.

``select_*`` builds a statement over the light tables (:mod:`.tables`); ``fetch_*`` runs one on
a Core connection (:meth:`Database.connect <ckptstore.manifest.db.Database.connect>`) and
returns records. Each query is written once, here: the public reads run it on a connection;
writers in an ORM session either take the same rows (a Session executes Core statements too) or
load their models from the same statement (``select(RunRow).from_statement(...)``, in
:mod:`ckptstore.manifest._orm`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Select, func, select
from sqlalchemy.engine import Connection, Row
from sqlalchemy.sql.expression import ScalarSelect

from ckptstore.errors import CheckpointNotFoundError, IntegrityError
from ckptstore.manifest._sql.tables import (
    BATCH,
    blob_copies,
    checkpoint_blobs,
    checkpoints,
    components,
    fetch_rows,
    runs,
    to_record,
)
from ckptstore.manifest.records import CheckpointInfo, ComponentInfo, RunInfo
from ckptstore.manifest.statuses import Status

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


# -- runs ---------------------------------------------------------------------------------------


def select_run(name: str) -> Select[Any]:
    """The row of the run named ``name`` (every column)."""
    return select(runs).where(runs.c.name == name)


def fetch_run(conn: Connection, name: str) -> RunInfo | None:
    """The run named ``name``, or None."""
    rows = fetch_rows(conn, select_run(name))
    return to_record(RunInfo, runs, rows[0]) if rows else None


# -- checkpoints --------------------------------------------------------------------------------


def select_newest_committed(run_id: int, *, before_step: int | None = None) -> Select[Any]:
    """The row of the run's newest committed checkpoint (below ``before_step`` if given): one
    indexed lookup, whatever the history's length."""
    query = select(checkpoints).where(
        checkpoints.c.run_id == run_id, checkpoints.c.status == Status.COMMITTED
    )
    if before_step is not None:
        query = query.where(checkpoints.c.step < before_step)
    return query.order_by(checkpoints.c.step.desc(), checkpoints.c.id.desc()).limit(1)


def select_newest_committed_id(run_id: int) -> ScalarSelect[Any]:
    """A scalar subquery: the id of the run's newest committed checkpoint."""
    return select_newest_committed(run_id).with_only_columns(checkpoints.c.id).scalar_subquery()


def select_checkpoints_of(run_id: int, statuses: Sequence[str] | None = None) -> Select[Any]:
    """The rows of a run's checkpoints, oldest first: all of them (``statuses`` None) or those
    in ``statuses`` (none for an empty sequence)."""
    query = select(checkpoints).where(checkpoints.c.run_id == run_id)
    if statuses is not None:
        query = query.where(checkpoints.c.status.in_(list(statuses)))
    return query.order_by(checkpoints.c.step, checkpoints.c.id)


def fetch_latest(conn: Connection, run_id: int, run: str) -> CheckpointInfo | None:
    """The run's newest committed checkpoint and its components in one statement: the indexed
    lookup of the newest row, joined with its components by primary key."""
    rows = fetch_rows(
        conn,
        select(checkpoints, components)
        .outerjoin(components, components.c.checkpoint_id == checkpoints.c.id)
        .where(checkpoints.c.id == select_newest_committed_id(run_id))
        .order_by(components.c.name),
    )
    if not rows:
        return None
    parts = tuple(
        to_record(ComponentInfo, components, row)
        for row in rows
        if row._mapping[components.c.checkpoint_id] is not None
    )
    return to_record(CheckpointInfo, checkpoints, rows[0], run=run, components=parts)


def fetch_committed_at_step(conn: Connection | Session, run_id: int, step: int) -> Row[Any]:
    """The row of the committed checkpoint at ``step``; an error saying why if there is none."""
    at_step = (
        select(checkpoints)
        .where(checkpoints.c.run_id == run_id, checkpoints.c.step == step)
        .order_by(checkpoints.c.id.desc())
        .limit(1)
    )
    rows = fetch_rows(conn, at_step.where(checkpoints.c.status == Status.COMMITTED))
    if rows:
        return rows[0]
    others = fetch_rows(conn, at_step)
    other = others[0] if others else None
    if other is not None and other.status == Status.CORRUPT:
        raise IntegrityError(
            f"the checkpoint at step {step} is marked corrupt: {other.error}; load another step"
        )
    if other is not None:
        raise CheckpointNotFoundError(
            f"the checkpoint at step {step} is {other.status}, not committed"
            + (f" ({other.error})" if other.error else "")
        )
    raise CheckpointNotFoundError(f"no checkpoint at step {step}")


def fetch_with_components(
    conn: Connection | Session, query: Select[Any], run: str | None = None
) -> list[CheckpointInfo]:
    """The checkpoints ``query`` selects as records with their components: two statements
    (more only past :data:`BATCH` checkpoints). ``query`` selects rows of
    ``checkpoints`` of the run named ``run``, or, without ``run``, also each one's run name as
    ``run_name``.

    The second statement asks for the components of the ids the first one returned, never
    runs ``query`` again: on PostgreSQL each statement of a transaction sees the commits made
    before it started, so a query run twice ("the newest committed checkpoint") can select a
    checkpoint committed in between, whose components would not be the first row's."""
    rows = fetch_rows(conn, query)
    found = fetch_components(conn, [row.id for row in rows])
    return [
        to_record(
            CheckpointInfo,
            checkpoints,
            row,
            run=run if run is not None else row.run_name or "?",
            components=tuple(found.get(row.id, ())),
        )
        for row in rows
    ]


def fetch_components(
    conn: Connection | Session, checkpoint_ids: Sequence[int]
) -> dict[int, list[ComponentInfo]]:
    """The components of the checkpoints with these ids, each checkpoint's by name (one
    statement per :data:`BATCH` ids)."""
    found: dict[int, list[ComponentInfo]] = {}
    for i in range(0, len(checkpoint_ids), BATCH):
        query = (
            select(components)
            .where(components.c.checkpoint_id.in_(checkpoint_ids[i : i + BATCH]))
            .order_by(components.c.checkpoint_id, components.c.name)
        )
        for row in fetch_rows(conn, query):
            found.setdefault(row.checkpoint_id, []).append(
                to_record(ComponentInfo, components, row)
            )
    return found


def fetch_checkpoint_of_row(conn: Connection, row: Row[Any], run: str) -> CheckpointInfo:
    """A ``checkpoints`` row as its record, with its components."""
    parts = fetch_components(conn, [row.id]).get(row.id, [])
    return to_record(CheckpointInfo, checkpoints, row, run=run, components=tuple(parts))


def _with_run_name() -> Select[Any]:
    return select(checkpoints, runs.c.name.label("run_name"))


def select_checkpoint_by_id(checkpoint_id: int) -> Select[Any]:
    """The row of one checkpoint by id, with its run's name (None if the run row is gone)."""
    return (
        _with_run_name()
        .outerjoin(runs, runs.c.id == checkpoints.c.run_id)
        .where(checkpoints.c.id == checkpoint_id)
    )


def select_in_status(status: str, *, run: str | None, step: int | None) -> Select[Any]:
    """The rows of the checkpoints in ``status`` (of the run named ``run``, at ``step``), with
    their run's name, by run name and step."""
    query = (
        _with_run_name()
        .join(runs, runs.c.id == checkpoints.c.run_id)
        .where(checkpoints.c.status == status)
    )
    if run is not None:
        query = query.where(runs.c.name == run)
    if step is not None:
        query = query.where(checkpoints.c.step == step)
    return query.order_by(runs.c.name, checkpoints.c.step)


# -- copies on node-local tiers ------------------------------------------------------------------


def fetch_replica_counts(conn: Connection, checkpoint_ids: Sequence[int]) -> dict[int, int]:
    """Each checkpoint -> the fewest node-local tier copies any of its blobs has (0 when a blob
    has none; absent for a checkpoint that references no blob): two grouped statements per
    :data:`BATCH` checkpoints."""
    found: dict[int, int] = {}
    for i in range(0, len(checkpoint_ids), BATCH):
        ids = list(checkpoint_ids[i : i + BATCH])
        per_blob = (
            select(
                checkpoint_blobs.c.checkpoint_id.label("checkpoint_id"),
                func.count(blob_copies.c.node).label("copies"),
            )
            .select_from(checkpoint_blobs)
            .outerjoin(blob_copies, blob_copies.c.digest == checkpoint_blobs.c.digest)
            .where(checkpoint_blobs.c.checkpoint_id.in_(ids))
            .group_by(checkpoint_blobs.c.checkpoint_id, checkpoint_blobs.c.digest)
            .subquery()
        )
        rows = conn.execute(
            select(per_blob.c.checkpoint_id, func.min(per_blob.c.copies)).group_by(
                per_blob.c.checkpoint_id
            )
        )
        found.update({int(cid): int(count) for cid, count in rows})
    return found
