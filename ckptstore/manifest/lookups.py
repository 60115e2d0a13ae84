"""Runs and checkpoints looked up by name, step or recency, in SQLAlchemy Core.

Why Core: importing SQLAlchemy's ORM and declaring the models (:mod:`ckptstore.manifest.models`)
took about a third of the start-up of a process that only reads (``ckptstore latest RUN``:
~80 of ~250 ms here), and a lookup needs neither. So these statements name the tables as light
clauses (:func:`sqlalchemy.table`) whose columns are the records' fields (a new field selects
its column), typed only where a driver's value must be converted (JSON, times, booleans);
``tests/manifest/test_lookups.py`` holds them to the models. The reports
(:mod:`ckptstore.manifest.reports`: ``runs``, ``du``, ``plot``) read through the same light
tables, the blob tables among them, and the statuses come from
:mod:`ckptstore.manifest.statuses`, so no read command imports the ORM.

Each query is written once, here: readers run it on a Core connection
(:meth:`Database.connect <ckptstore.manifest.db.Database.connect>`) and get records; writers in
an ORM session either take the same rows (a Session executes Core statements too) or load
their models from the same statement (``select(RunRow).from_statement(...)``, in
:mod:`ckptstore.manifest.queries`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import JSON, Boolean, DateTime, Select, column, select, table
from sqlalchemy.engine import Connection, Row
from sqlalchemy.sql.expression import ColumnClause, ScalarSelect, TableClause

from ckptstore.errors import CheckpointNotFoundError, IntegrityError
from ckptstore.manifest.records import CheckpointInfo, ComponentInfo, RunInfo, field_names
from ckptstore.manifest.statuses import Status

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

R = TypeVar("R")

#: Values bound in one ``IN (...)`` list: statements over many ids or digests go in batches
#: (SQLite refuses more than 32,766 parameters in one statement).
BATCH = 500

#: The columns whose driver values SQLAlchemy converts: SQLite returns JSON and times as text
#: and booleans as integers. Every other column comes back as the driver gives it.
_TYPES: dict[str, Any] = {
    "config": JSON(),
    "training_info": JSON(),
    "metrics": JSON(),
    "created_at": DateTime(timezone=True),
    "committed_at": DateTime(timezone=True),
    "last_claimed_at": DateTime(timezone=True),
    "condemned_at": DateTime(timezone=True),
    "higher_is_better": Boolean(),
}


def _columns(record_type: type[Any], *, omit: Sequence[str] = ()) -> list[ColumnClause[Any]]:
    return [column(name, _TYPES.get(name)) for name in field_names(record_type) if name not in omit]


runs = table("runs", *_columns(RunInfo))
checkpoints = table(
    "checkpoints", column("run_id"), *_columns(CheckpointInfo, omit=("run", "components"))
)
components = table("components", column("checkpoint_id"), *_columns(ComponentInfo))
# Blob rows have no record: their columns by name (what ``du`` sums, in manifest.reports).
blobs = table(
    "blobs",
    *(
        column(name, _TYPES.get(name))
        for name in (
            "digest",
            "kind",
            "logical_bytes",
            "stored_bytes",
            "codec",
            "created_at",
            "last_claimed_at",
            "state",
            "condemned_at",
        )
    ),
)
checkpoint_blobs = table("checkpoint_blobs", column("checkpoint_id"), column("digest"))


def _record(record_type: type[R], source: TableClause, row: Row[Any], **given: Any) -> R:
    """The ``record_type`` made from ``row``'s columns of ``source`` and the ``given`` fields
    (those that are no column: a checkpoint's run name and components)."""
    mapping = row._mapping
    return record_type(
        **{name: mapping[col] for name, col in _fields(record_type, source)}, **given
    )


#: (record type, table name) -> each field of the record that is a column of the table, with
#: that column: worked out once, as ``ls`` makes a record of every row.
_FIELDS: dict[tuple[type[Any], str], list[tuple[str, ColumnClause[Any]]]] = {}


def _fields(record_type: type[Any], source: TableClause) -> list[tuple[str, ColumnClause[Any]]]:
    key = (record_type, source.name)
    if key not in _FIELDS:
        _FIELDS[key] = [(n, source.c[n]) for n in field_names(record_type) if n in source.c]
    return _FIELDS[key]


def _execute(conn: Connection | Session, statement: Select[Any]) -> list[Row[Any]]:
    return list(conn.execute(statement))


# -- runs ---------------------------------------------------------------------------------------


def run_named(name: str) -> Select[Any]:
    """The row of the run named ``name`` (every column)."""
    return select(runs).where(runs.c.name == name)


def find_run(conn: Connection, name: str) -> RunInfo | None:
    """The run named ``name``, or None."""
    rows = _execute(conn, run_named(name))
    return _record(RunInfo, runs, rows[0]) if rows else None


# -- checkpoints --------------------------------------------------------------------------------


def newest_committed(run_id: int, *, before_step: int | None = None) -> Select[Any]:
    """The row of the run's newest committed checkpoint (below ``before_step`` if given): one
    indexed lookup, whatever the history's length."""
    query = select(checkpoints).where(
        checkpoints.c.run_id == run_id, checkpoints.c.status == Status.COMMITTED
    )
    if before_step is not None:
        query = query.where(checkpoints.c.step < before_step)
    return query.order_by(checkpoints.c.step.desc(), checkpoints.c.id.desc()).limit(1)


def newest_committed_id(run_id: int) -> ScalarSelect[Any]:
    """A scalar subquery: the id of the run's newest committed checkpoint."""
    return newest_committed(run_id).with_only_columns(checkpoints.c.id).scalar_subquery()


def of_run(run_id: int, statuses: Sequence[str] | None = None) -> Select[Any]:
    """The rows of a run's checkpoints, oldest first: all of them (``statuses`` None) or those
    in ``statuses`` (none for an empty sequence)."""
    query = select(checkpoints).where(checkpoints.c.run_id == run_id)
    if statuses is not None:
        query = query.where(checkpoints.c.status.in_(list(statuses)))
    return query.order_by(checkpoints.c.step, checkpoints.c.id)


def latest(conn: Connection, run_id: int, run: str) -> CheckpointInfo | None:
    """The run's newest committed checkpoint and its components in one statement: the indexed
    lookup of the newest row, joined with its components by primary key."""
    rows = _execute(
        conn,
        select(checkpoints, components)
        .outerjoin(components, components.c.checkpoint_id == checkpoints.c.id)
        .where(checkpoints.c.id == newest_committed_id(run_id))
        .order_by(components.c.name),
    )
    if not rows:
        return None
    parts = tuple(
        _record(ComponentInfo, components, row)
        for row in rows
        if row._mapping[components.c.checkpoint_id] is not None
    )
    return _record(CheckpointInfo, checkpoints, rows[0], run=run, components=parts)


def committed_at_step(conn: Connection | Session, run_id: int, step: int) -> Row[Any]:
    """The row of the committed checkpoint at ``step``; an error saying why if there is none."""
    at_step = (
        select(checkpoints)
        .where(checkpoints.c.run_id == run_id, checkpoints.c.step == step)
        .order_by(checkpoints.c.id.desc())
        .limit(1)
    )
    rows = _execute(conn, at_step.where(checkpoints.c.status == Status.COMMITTED))
    if rows:
        return rows[0]
    others = _execute(conn, at_step)
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


def with_components(
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
    rows = _execute(conn, query)
    found = components_of(conn, [row.id for row in rows])
    return [
        _record(
            CheckpointInfo,
            checkpoints,
            row,
            run=run if run is not None else row.run_name or "?",
            components=tuple(found.get(row.id, ())),
        )
        for row in rows
    ]


def components_of(
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
        for row in _execute(conn, query):
            found.setdefault(row.checkpoint_id, []).append(_record(ComponentInfo, components, row))
    return found


def checkpoint_of_row(conn: Connection, row: Row[Any], run: str) -> CheckpointInfo:
    """A ``checkpoints`` row as its record, with its components."""
    parts = components_of(conn, [row.id]).get(row.id, [])
    return _record(CheckpointInfo, checkpoints, row, run=run, components=tuple(parts))


def _with_run_name() -> Select[Any]:
    return select(checkpoints, runs.c.name.label("run_name"))


def by_id(checkpoint_id: int) -> Select[Any]:
    """The row of one checkpoint by id, with its run's name (None if the run row is gone)."""
    return (
        _with_run_name()
        .outerjoin(runs, runs.c.id == checkpoints.c.run_id)
        .where(checkpoints.c.id == checkpoint_id)
    )


def in_status(status: str, *, run: str | None, step: int | None) -> Select[Any]:
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
