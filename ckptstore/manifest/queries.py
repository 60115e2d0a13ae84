"""The manifest's reads and writes. Each function works inside a session the caller opened
(``Database.read()`` or ``Database.write(fn)``); none knows about tensors. Runs and checkpoints
are looked up with the statements of :mod:`ckptstore.manifest.lookups` (Core, shared with the
readers that do without the ORM)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import func, insert, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from ckptstore.errors import FencedError, RunStateError
from ckptstore.manifest import lookups

# A fork finds its parent checkpoint inside its write transaction with the readers' query.
from ckptstore.manifest.lookups import committed_at_step as committed_at_step
from ckptstore.manifest.models import (
    BlobRow,
    BlobState,
    CheckpointBlobRow,
    CheckpointRow,
    ComponentRow,
    RunRow,
    Status,
    utcnow,
)
from ckptstore.manifest.records import BlobClaim, ComponentInfo

#: What commits and GC exclude each other on (PostgreSQL): a table lock on ``gc_lease``, ROW SHARE
#: by commits (they do not exclude each other), EXCLUSIVE by GC's mark and sweep and by marking
#: corrupt. Not an advisory lock: any login may take any advisory lock, so a read-only user could
#: hold GC's and stall every commit. Every mode that conflicts with these needs UPDATE, DELETE or
#: TRUNCATE on the table, which only writers have; a reader's SELECT takes ACCESS SHARE, which
#: conflicts with neither. (SQLite writers are serialized anyway.)
GC_LOCK_TABLE = "gc_lease"


def find_run(session: Session, name: str) -> RunRow | None:
    """The run row named ``name`` (to change it), or None."""
    return session.scalars(select(RunRow).from_statement(lookups.run_named(name))).one_or_none()


def create_run(
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


def hold_gc_lock_shared(session: Session) -> None:
    """Hold off GC sweeps while this (commit) transaction lasts (PostgreSQL)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"LOCK TABLE {GC_LOCK_TABLE} IN ROW SHARE MODE"))


def hold_gc_lock_exclusive(session: Session) -> None:
    """No commit runs while this transaction lasts (SQLite: its write lock already does that)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"LOCK TABLE {GC_LOCK_TABLE} IN EXCLUSIVE MODE"))


def begin_checkpoint(session: Session, run_id: int, step: int, epoch: int, trigger: str) -> int:
    """Insert a pending checkpoint row; returns its id."""
    row = CheckpointRow(
        run_id=run_id, step=step, writer_epoch=epoch, trigger=trigger, status=Status.PENDING
    )
    session.add(row)
    session.flush()
    return row.id


def mark(
    session: Session,
    checkpoint_id: int,
    status: Status,
    error: str | None,
    *,
    only_if: Status | None = None,
) -> bool:
    """Set a checkpoint's status (if it is ``only_if``, when given); True if it changed."""
    condition = [CheckpointRow.id == checkpoint_id]
    if only_if is not None:
        condition.append(CheckpointRow.status == only_if)
    result = session.execute(
        update(CheckpointRow)
        .where(*condition)
        .values(status=status, error=(error or "")[:4000] or None)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0))


def condemn_blob(session: Session, digest: str) -> None:
    """Take a damaged blob out of service: the next save that needs it uploads it again."""
    session.execute(
        update(BlobRow)
        .where(BlobRow.digest == digest)
        .values(state=BlobState.CONDEMNED, condemned_at=utcnow())
    )


def mark_corrupt(session: Session, checkpoint_id: int, reason: str, digests: Iterable[str]) -> None:
    """The one mark-corrupt transaction body (load fallback and verify): the checkpoint becomes
    corrupt and its damaged blobs are condemned, with commits held off (GC lock exclusive) so
    no commit trusts a damaged object between this and the caller's quarantine of it.

    Corrupt is recoverable: the checkpoint's rows stay, GC keeps its blobs, and
    :func:`restore_committed` brings it back once every blob verifies again."""
    hold_gc_lock_exclusive(session)
    mark(session, checkpoint_id, Status.CORRUPT, reason)
    for digest in digests:
        condemn_blob(session, digest)


def corrupt_referencing(session: Session, digests: Sequence[str]) -> list[int]:
    """Ids of corrupt checkpoints that reference any of ``digests``."""
    found: set[int] = set()
    for i in range(0, len(digests), lookups.BATCH):
        found.update(
            session.scalars(
                select(CheckpointBlobRow.checkpoint_id)
                .join(CheckpointRow, CheckpointRow.id == CheckpointBlobRow.checkpoint_id)
                .where(
                    CheckpointBlobRow.digest.in_(digests[i : i + lookups.BATCH]),
                    CheckpointRow.status == Status.CORRUPT,
                )
            )
        )
    return sorted(found)


def checkpoint_blob_sizes(session: Session, checkpoint_id: int) -> dict[str, int | None]:
    """Every blob a checkpoint references and the raw length its row records (None: no row)."""
    rows = session.execute(
        select(CheckpointBlobRow.digest, BlobRow.logical_bytes)
        .outerjoin(BlobRow, BlobRow.digest == CheckpointBlobRow.digest)
        .where(CheckpointBlobRow.checkpoint_id == checkpoint_id)
    )
    return {row[0]: row[1] for row in rows}


def restore_committed(session: Session, checkpoint_id: int, digests: Sequence[str]) -> str | None:
    """A corrupt checkpoint whose blobs all verified again becomes committed (or deleted, if a
    newer save of the same step was committed meanwhile); its condemned blob rows are live
    again. Returns the new status, or None if it is no longer corrupt or a row is missing."""
    hold_gc_lock_exclusive(session)
    row = session.get(CheckpointRow, checkpoint_id, with_for_update=True)
    if row is None or row.status != Status.CORRUPT:
        return None
    rows = blob_rows(session, list(digests))
    if len(rows) != len(set(digests)):
        return None
    now = revive_blobs(session, digests)
    newer = session.scalar(
        select(CheckpointRow.id).where(
            CheckpointRow.run_id == row.run_id,
            CheckpointRow.step == row.step,
            CheckpointRow.status == Status.COMMITTED,
            CheckpointRow.id != row.id,
        )
    )
    status = Status.DELETED if newer is not None else Status.COMMITTED
    note = f"repaired: every blob verified again at {now:%Y-%m-%d %H:%M:%S} UTC"
    if newer is not None:
        note += f"; superseded by checkpoint {newer} of the same step"
    row.status = status
    row.error = f"{note} (was: {row.error})"[:4000] if row.error else note
    return status


def revive_blobs(session: Session, digests: Sequence[str]) -> dt.datetime:
    """Blob rows whose objects verified again are live (and freshly claimed); returns now."""
    now = utcnow()
    for i in range(0, len(digests), lookups.BATCH):
        session.execute(
            update(BlobRow)
            .where(BlobRow.digest.in_(digests[i : i + lookups.BATCH]))
            .values(state=BlobState.LIVE, condemned_at=None, last_claimed_at=now)
        )
    return now


def release_corrupt(session: Session) -> list[int]:
    """Every corrupt checkpoint becomes deleted: its owner gave up on repairing it, so GC may
    take its blobs and ``verify`` stops reporting it. Returns their ids."""
    hold_gc_lock_exclusive(session)
    rows = list(
        session.scalars(
            select(CheckpointRow).where(CheckpointRow.status == Status.CORRUPT).with_for_update()
        )
    )
    for row in rows:
        note = f"released by gc --release-corrupt at {utcnow():%Y-%m-%d %H:%M:%S} UTC"
        row.status = Status.DELETED
        row.error = f"{note} (was: {row.error})"[:4000] if row.error else note
    return [row.id for row in rows]


def supersede_step(session: Session, checkpoint_id: int) -> list[int]:
    """Saving a step again replaces it: older committed checkpoints of the same run and step
    become deleted (their blobs go to GC unless shared), in the commit's transaction."""
    row = session.get(CheckpointRow, checkpoint_id)
    assert row is not None
    older = list(
        session.scalars(
            select(CheckpointRow.id).where(
                CheckpointRow.run_id == row.run_id,
                CheckpointRow.step == row.step,
                CheckpointRow.status == Status.COMMITTED,
                CheckpointRow.id != checkpoint_id,
            )
        )
    )
    if older:
        session.execute(
            update(CheckpointRow)
            .where(CheckpointRow.id.in_(older))
            .values(
                status=Status.DELETED,
                error=f"superseded by checkpoint {checkpoint_id}, a newer save of step {row.step}",
            )
            .execution_options(synchronize_session=False)
        )
    return older


def blob_rows(session: Session, digests: Sequence[str], *, lock: bool = True) -> dict[str, BlobRow]:
    """Rows of ``digests``, whatever their state (locked for update on PostgreSQL unless ``lock``
    is False)."""
    found: dict[str, BlobRow] = {}
    for i in range(0, len(digests), lookups.BATCH):
        chunk = digests[i : i + lookups.BATCH]
        query = select(BlobRow).where(BlobRow.digest.in_(chunk))
        rows = session.scalars(query.with_for_update() if lock else query)
        found.update((row.digest, row) for row in rows)
    return found


def record_blobs(session: Session, checkpoint_id: int, claims: Iterable[BlobClaim]) -> None:
    """Insert rows for new blobs, claim existing ones, and reference them all."""
    now = utcnow()
    unique = {c.digest: c for c in claims}
    existing = blob_rows(session, list(unique))
    new_rows = [
        {
            "digest": c.digest,
            "kind": c.kind,
            "logical_bytes": c.logical_bytes,
            "stored_bytes": c.stored_bytes,
            "codec": c.codec,
            "created_at": now,
            "last_claimed_at": now,
            "state": BlobState.LIVE,
        }
        for c in unique.values()
        if c.digest not in existing
    ]
    if new_rows:
        # Another transaction may insert the same new blob concurrently (two runs saving
        # the same weights): its row wins, and is claimed below like any existing one.
        session.execute(insert_ignoring_duplicates(session, BlobRow), new_rows)
    digests = list(unique)
    for i in range(0, len(digests), lookups.BATCH):
        session.execute(
            update(BlobRow)
            .where(BlobRow.digest.in_(digests[i : i + lookups.BATCH]))
            .values(last_claimed_at=now, state=BlobState.LIVE)
        )
    if unique:
        session.execute(
            insert(CheckpointBlobRow),
            [{"checkpoint_id": checkpoint_id, "digest": d} for d in unique],
        )


def insert_ignoring_duplicates(session: Session, table: type[Any]) -> Any:
    """An INSERT that skips rows whose primary key exists (per dialect)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return pg_insert(table).on_conflict_do_nothing()
    if dialect == "sqlite":
        return sqlite_insert(table).on_conflict_do_nothing()
    return insert(table)


def record_components(
    session: Session, checkpoint_id: int, components: Iterable[ComponentInfo]
) -> None:
    """Insert a checkpoint's component rows."""
    rows = [{"checkpoint_id": checkpoint_id, **c.as_dict()} for c in components]
    if rows:
        session.execute(insert(ComponentRow), rows)


def finish_commit(session: Session, checkpoint_id: int, values: dict[str, Any]) -> None:
    """Flip a pending checkpoint to committed with its final values."""
    current = session.scalar(select(CheckpointRow.status).where(CheckpointRow.id == checkpoint_id))
    if current != Status.PENDING:
        raise RunStateError(
            f"checkpoint {checkpoint_id} is {current}, not pending; it cannot be committed"
        )
    session.execute(
        update(CheckpointRow)
        .where(CheckpointRow.id == checkpoint_id)
        .values(status=Status.COMMITTED, committed_at=utcnow(), **values)
    )


def live_digests_to_reuse(session: Session, run_id: int) -> set[str]:
    """The live blobs a new save of ``run_id`` most likely shares, in one statement: those of
    its newest committed checkpoint (for a run with none yet, of the checkpoint it was forked
    from)."""
    newest = lookups.newest_committed_id(run_id)
    parent = select(RunRow.parent_checkpoint_id).where(RunRow.id == run_id).scalar_subquery()
    source = func.coalesce(newest, parent)
    return set(
        session.scalars(
            select(CheckpointBlobRow.digest)
            .join(BlobRow, BlobRow.digest == CheckpointBlobRow.digest)
            .where(CheckpointBlobRow.checkpoint_id == source, BlobRow.state == BlobState.LIVE)
        )
    )


def checkpoint_digests(session: Session, checkpoint_id: int, *, limit: int) -> list[str]:
    """Up to ``limit`` digests the checkpoint references."""
    return list(
        session.scalars(
            select(CheckpointBlobRow.digest)
            .where(CheckpointBlobRow.checkpoint_id == checkpoint_id)
            .order_by(CheckpointBlobRow.digest)
            .limit(limit)
        )
    )


def mark_deleted(session: Session, ids: Iterable[int]) -> None:
    """Mark committed checkpoints deleted (retention)."""
    ids = list(ids)
    for i in range(0, len(ids), lookups.BATCH):
        session.execute(
            update(CheckpointRow)
            .where(
                CheckpointRow.id.in_(ids[i : i + lookups.BATCH]),
                CheckpointRow.status == Status.COMMITTED,
            )
            .values(status=Status.DELETED)
        )


def as_utc(value: dt.datetime) -> dt.datetime:
    """SQLite returns naive datetimes; every time we store is UTC."""
    if value.tzinfo is not None:
        return value
    return value.replace(tzinfo=dt.UTC)
