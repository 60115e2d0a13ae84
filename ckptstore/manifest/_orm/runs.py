"""Run rows, the writer epoch (fencing) and the locks that order commits and GC."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from ckptstore.errors import FencedError
from ckptstore.manifest._sql.lookups import select_run
from ckptstore.manifest.models import CheckpointRow, RunRow, Status

#: What commits and GC exclude each other on (PostgreSQL): a table lock on ``gc_lease``, ROW SHARE
#: by commits (they do not exclude each other), EXCLUSIVE by GC's mark and sweep and by marking
#: corrupt. Not an advisory lock: any login may take any advisory lock, so a read-only user could
#: hold GC's and stall every commit. Every mode that conflicts with these needs UPDATE, DELETE or
#: TRUNCATE on the table, which only writers have; a reader's SELECT takes ACCESS SHARE, which
#: conflicts with neither. (SQLite writers are serialized anyway.)
GC_LOCK_TABLE = "gc_lease"


def hold_gc_lock_shared(session: Session) -> None:
    """Hold off GC sweeps while this (commit) transaction lasts (PostgreSQL)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"LOCK TABLE {GC_LOCK_TABLE} IN ROW SHARE MODE"))


def hold_gc_lock_exclusive(session: Session) -> None:
    """No commit runs while this transaction lasts (SQLite: its write lock already does that)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"LOCK TABLE {GC_LOCK_TABLE} IN EXCLUSIVE MODE"))


def load_run_row(session: Session, name: str) -> RunRow | None:
    """The run row named ``name`` (to change it), or None."""
    return session.scalars(select(RunRow).from_statement(select_run(name))).one_or_none()


def insert_run(
    session: Session,
    name: str,
    *,
    config: dict[str, Any] | None,
    fingerprint: str | None,
    parent_checkpoint_id: int | None,
    metric_name: str | None,
    higher_is_better: bool,
) -> RunRow:
    """Insert a new run row (writer epoch 0)."""
    run = RunRow(
        name=name,
        config=config,
        config_fingerprint=fingerprint,
        parent_checkpoint_id=parent_checkpoint_id,
        metric_name=metric_name,
        higher_is_better=higher_is_better,
        writer_epoch=0,
    )
    session.add(run)
    session.flush()
    return run


def bump_epoch(session: Session, run_id: int) -> int:
    """Make the caller the run's only writer; returns the new epoch."""
    session.execute(
        update(RunRow).where(RunRow.id == run_id).values(writer_epoch=RunRow.writer_epoch + 1)
    )
    return int(session.scalar(select(RunRow.writer_epoch).where(RunRow.id == run_id)) or 0)


def abandon_pending(session: Session, run_id: int, epoch: int) -> int:
    """Mark ``failed`` the run's pending checkpoints of writers older than ``epoch``: they can
    never commit (fencing), and history should not show them as in progress for ever."""
    result = session.execute(
        update(CheckpointRow)
        .where(
            CheckpointRow.run_id == run_id,
            CheckpointRow.status == Status.PENDING,
            CheckpointRow.writer_epoch < epoch,
        )
        .values(
            status=Status.FAILED,
            error=f"abandoned: its writer was replaced by writer epoch {epoch} before it committed",
        )
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def lock_run(session: Session, run_id: int, epoch: int) -> RunRow:
    """Lock the run row and check that ``epoch`` is still its writer's."""
    run = session.scalars(select(RunRow).where(RunRow.id == run_id).with_for_update()).one()
    if run.writer_epoch != epoch:
        raise FencedError(
            f"run {run.name!r} was opened for writing by a newer writer (epoch "
            f"{run.writer_epoch}, this writer has {epoch}); this stale writer may not commit. "
            "Stop the old job, or open the run again to take over"
        )
    return run


def as_utc(value: dt.datetime) -> dt.datetime:
    """SQLite returns naive datetimes; every time we store is UTC."""
    if value.tzinfo is not None:
        return value
    return value.replace(tzinfo=dt.UTC)
