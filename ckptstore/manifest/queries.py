"""The manifest's reads and writes. Each function works inside a session the caller opened
(``Database.read()`` or ``Database.write(fn)``); none knows about tensors."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from ckptstore.errors import CheckpointNotFoundError, ConfigError, FencedError, IntegrityError
from ckptstore.manifest.models import (
    Blob,
    BlobState,
    Checkpoint,
    CheckpointBlob,
    Component,
    Run,
    Status,
    utcnow,
)

#: PostgreSQL advisory lock: commits hold it shared, a GC sweep exclusively, so a sweep never
#: deletes a blob that a commit is claiming. (SQLite writers are serialized anyway.)
GC_LOCK_KEY = 0x636B7067  # "ckpg"
_BATCH = 500


@dataclass(frozen=True, slots=True)
class BlobClaim:
    """One blob a checkpoint references, as reported by the writer that stored it."""

    digest: str
    kind: str
    logical_bytes: int
    stored_bytes: int
    codec: str | None
    #: The writer stored the object itself during this save.
    uploaded: bool


@dataclass(frozen=True, slots=True)
class ComponentRow:
    """One component of a checkpoint, as the ``components`` table holds it."""

    name: str
    kind: str
    index_digest: str
    logical_bytes: int
    stored_bytes: int
    entries: int

    @classmethod
    def of(cls, row: Component) -> ComponentRow:
        return cls(
            row.name, row.kind, row.index_digest, row.logical_bytes, row.stored_bytes, row.entries
        )

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}


def find_run(session: Session, name: str) -> Run | None:
    return session.scalars(select(Run).where(Run.name == name)).one_or_none()


def create_run(
    session: Session,
    name: str,
    *,
    config: dict[str, Any] | None,
    fingerprint: str | None,
    parent_checkpoint_id: int | None,
    metric_name: str | None,
    higher_is_better: bool,
) -> Run:
    run = Run(
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
    session.execute(update(Run).where(Run.id == run_id).values(writer_epoch=Run.writer_epoch + 1))
    return int(session.scalar(select(Run.writer_epoch).where(Run.id == run_id)) or 0)


def abandon_pending(session: Session, run_id: int, epoch: int) -> int:
    """Mark ``failed`` the run's pending checkpoints of writers older than ``epoch``: they can
    never commit (fencing), and history should not show them as in progress for ever."""
    result = session.execute(
        update(Checkpoint)
        .where(
            Checkpoint.run_id == run_id,
            Checkpoint.status == Status.PENDING,
            Checkpoint.writer_epoch < epoch,
        )
        .values(
            status=Status.FAILED,
            error=f"abandoned: its writer was replaced by writer epoch {epoch} before it committed",
        )
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def lock_run(session: Session, run_id: int, epoch: int) -> Run:
    """Lock the run row and check that ``epoch`` is still its writer's."""
    run = session.scalars(select(Run).where(Run.id == run_id).with_for_update()).one()
    if run.writer_epoch != epoch:
        raise FencedError(
            f"run {run.name!r} was opened for writing by a newer writer (epoch "
            f"{run.writer_epoch}, this writer has {epoch}); this stale writer may not commit. "
            "Stop the old job, or open the run again to take over"
        )
    return run


def hold_gc_lock_shared(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock_shared(:k)"), {"k": GC_LOCK_KEY})


def hold_gc_lock_exclusive(session: Session) -> None:
    """No commit runs while this transaction lasts (SQLite: its write lock already does that)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": GC_LOCK_KEY})


def begin_checkpoint(session: Session, run_id: int, step: int, epoch: int, trigger: str) -> int:
    row = Checkpoint(
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
    condition = [Checkpoint.id == checkpoint_id]
    if only_if is not None:
        condition.append(Checkpoint.status == only_if)
    result = session.execute(
        update(Checkpoint)
        .where(*condition)
        .values(status=status, error=(error or "")[:4000] or None)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0))


def blob_state(session: Session, digest: str) -> str | None:
    return session.scalar(select(Blob.state).where(Blob.digest == digest))


def condemn_blob(session: Session, digest: str) -> None:
    """Take a damaged blob out of service: the next save that needs it uploads it again."""
    session.execute(
        update(Blob)
        .where(Blob.digest == digest)
        .values(state=BlobState.CONDEMNED, condemned_at=utcnow())
    )


def blob_rows(session: Session, digests: Sequence[str], *, lock: bool = True) -> dict[str, Blob]:
    """Rows of ``digests``, whatever their state (locked for update on PostgreSQL unless ``lock``
    is False)."""
    found: dict[str, Blob] = {}
    for i in range(0, len(digests), _BATCH):
        chunk = digests[i : i + _BATCH]
        query = select(Blob).where(Blob.digest.in_(chunk))
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
        session.execute(insert_ignoring_duplicates(session, Blob), new_rows)
    digests = list(unique)
    for i in range(0, len(digests), _BATCH):
        session.execute(
            update(Blob)
            .where(Blob.digest.in_(digests[i : i + _BATCH]))
            .values(last_claimed_at=now, state=BlobState.LIVE)
        )
    if unique:
        session.execute(
            insert(CheckpointBlob),
            [{"checkpoint_id": checkpoint_id, "digest": d} for d in unique],
        )


def insert_ignoring_duplicates(session: Session, table: type[Any]) -> Any:
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return pg_insert(table).on_conflict_do_nothing()
    if dialect == "sqlite":
        return sqlite_insert(table).on_conflict_do_nothing()
    return insert(table)


def record_components(
    session: Session, checkpoint_id: int, components: Iterable[ComponentRow]
) -> None:
    rows = [{"checkpoint_id": checkpoint_id, **c.as_dict()} for c in components]
    if rows:
        session.execute(insert(Component), rows)


def finish_commit(session: Session, checkpoint_id: int, values: dict[str, Any]) -> None:
    current = session.scalar(select(Checkpoint.status).where(Checkpoint.id == checkpoint_id))
    if current != Status.PENDING:
        raise ConfigError(
            f"checkpoint {checkpoint_id} is {current}, not pending; it cannot be committed"
        )
    session.execute(
        update(Checkpoint)
        .where(Checkpoint.id == checkpoint_id)
        .values(status=Status.COMMITTED, committed_at=utcnow(), **values)
    )


def latest_committed(
    session: Session, run_id: int, *, before_step: int | None = None
) -> Checkpoint | None:
    """The newest committed checkpoint: one indexed query, whatever the history's length."""
    query = select(Checkpoint).where(
        Checkpoint.run_id == run_id, Checkpoint.status == Status.COMMITTED
    )
    if before_step is not None:
        query = query.where(Checkpoint.step < before_step)
    return session.scalars(
        query.order_by(Checkpoint.step.desc(), Checkpoint.id.desc()).limit(1)
    ).one_or_none()


def latest_with_components(
    session: Session, run_id: int
) -> tuple[Checkpoint, list[Component]] | None:
    """The newest committed checkpoint and its components in one statement: the indexed
    lookup of the newest row, joined with its components by primary key."""
    newest = (
        select(Checkpoint.id)
        .where(Checkpoint.run_id == run_id, Checkpoint.status == Status.COMMITTED)
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        .limit(1)
        .scalar_subquery()
    )
    rows = session.execute(
        select(Checkpoint, Component)
        .outerjoin(Component, Component.checkpoint_id == Checkpoint.id)
        .where(Checkpoint.id == newest)
        .order_by(Component.name)
    ).all()
    if not rows:
        return None
    return rows[0][0], [component for _, component in rows if component is not None]


def committed_at_step(session: Session, run_id: int, step: int) -> Checkpoint:
    row = session.scalars(
        select(Checkpoint)
        .where(
            Checkpoint.run_id == run_id,
            Checkpoint.status == Status.COMMITTED,
            Checkpoint.step == step,
        )
        .order_by(Checkpoint.id.desc())
        .limit(1)
    ).one_or_none()
    if row is not None:
        return row
    other = session.scalars(
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id, Checkpoint.step == step)
        .order_by(Checkpoint.id.desc())
        .limit(1)
    ).one_or_none()
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


def components_of(session: Session, checkpoint_id: int) -> list[Component]:
    return list(
        session.scalars(
            select(Component)
            .where(Component.checkpoint_id == checkpoint_id)
            .order_by(Component.name)
        )
    )


def checkpoints_of(
    session: Session, run_id: int, statuses: Sequence[str] | None = None
) -> list[Checkpoint]:
    query = select(Checkpoint).where(Checkpoint.run_id == run_id)
    if statuses:
        query = query.where(Checkpoint.status.in_(statuses))
    return list(session.scalars(query.order_by(Checkpoint.step, Checkpoint.id)))


def checkpoint_digests(session: Session, checkpoint_id: int, *, limit: int) -> list[str]:
    """Up to ``limit`` digests the checkpoint references."""
    return list(
        session.scalars(
            select(CheckpointBlob.digest)
            .where(CheckpointBlob.checkpoint_id == checkpoint_id)
            .order_by(CheckpointBlob.digest)
            .limit(limit)
        )
    )


def mark_deleted(session: Session, ids: Iterable[int]) -> None:
    ids = list(ids)
    for i in range(0, len(ids), _BATCH):
        session.execute(
            update(Checkpoint)
            .where(Checkpoint.id.in_(ids[i : i + _BATCH]), Checkpoint.status == Status.COMMITTED)
            .values(status=Status.DELETED)
        )


def as_utc(value: dt.datetime) -> dt.datetime:
    """SQLite returns naive datetimes; every time we store is UTC."""
    if value.tzinfo is not None:
        return value
    return value.replace(tzinfo=dt.UTC)
