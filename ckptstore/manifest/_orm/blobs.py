"""Blob rows, a checkpoint's references to them, and its component rows."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, cast

from sqlalchemy import Table, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from ckptstore.manifest._sql.lookups import select_newest_committed_id
from ckptstore.manifest._sql.tables import BATCH
from ckptstore.manifest.models import (
    BlobRow,
    BlobState,
    CheckpointBlobRow,
    ComponentRow,
    RunRow,
    utcnow,
)
from ckptstore.manifest.records import BlobClaim, ComponentInfo


class BlobFacts(NamedTuple):
    """What a commit needs of a blob row (read as columns: no ORM object per row, so statements
    later in the session have nothing to synchronise)."""

    state: str  # a BlobState value
    logical_bytes: int
    stored_bytes: int


def blob_rows(
    session: Session, digests: Sequence[str], *, lock: bool = True
) -> dict[str, BlobFacts]:
    """Rows of ``digests``, whatever their state (locked for update on PostgreSQL unless ``lock``
    is False), in batches of ``BATCH`` per statement."""
    found: dict[str, BlobFacts] = {}
    columns = (BlobRow.digest, BlobRow.state, BlobRow.logical_bytes, BlobRow.stored_bytes)
    for i in range(0, len(digests), BATCH):
        query = select(*columns).where(BlobRow.digest.in_(digests[i : i + BATCH]))
        for digest, state, logical, stored in session.execute(
            query.with_for_update() if lock else query
        ):
            found[digest] = BlobFacts(state, logical, stored)
    return found


def condemn_blob_row(session: Session, digest: str) -> None:
    """Take a damaged blob out of service: the next save that needs it uploads it again."""
    session.execute(
        update(BlobRow)
        .where(BlobRow.digest == digest)
        .values(state=BlobState.CONDEMNED, condemned_at=utcnow())
    )


def revive_blob_rows(session: Session, digests: Sequence[str]) -> dt.datetime:
    """Blob rows whose objects verified again are live (and freshly claimed); returns now."""
    now = utcnow()
    for i in range(0, len(digests), BATCH):
        session.execute(
            update(BlobRow)
            .where(BlobRow.digest.in_(digests[i : i + BATCH]))
            .values(state=BlobState.LIVE, condemned_at=None, last_claimed_at=now)
            .execution_options(synchronize_session=False)
        )
    return now


def record_blobs(
    session: Session,
    checkpoint_id: int,
    claims: Iterable[BlobClaim],
    existing: Mapping[str, BlobFacts] | None = None,
) -> None:
    """Insert rows for new blobs, claim existing ones, and reference them all: a few set-based
    statements whatever the number of blobs (``existing``: their rows, if the caller has just
    read them under lock)."""
    now = utcnow()
    unique = {c.digest: c for c in claims}
    if existing is None:
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
        # the same weights): its row wins -- live and claimed just now, and GC cannot run
        # before we commit (the commit holds the GC lock shared) -- and is referenced below.
        session.execute(insert_ignoring_duplicates(session, BlobRow), new_rows)
    claimed = [d for d in unique if d in existing]
    for i in range(0, len(claimed), BATCH):
        session.execute(
            update(BlobRow)
            .where(BlobRow.digest.in_(claimed[i : i + BATCH]))
            .values(last_claimed_at=now, state=BlobState.LIVE)
            .execution_options(synchronize_session=False)
        )
    if unique:
        session.execute(
            insert(_core(CheckpointBlobRow)),
            [{"checkpoint_id": checkpoint_id, "digest": d} for d in unique],
        )


def _core(model: type[Any]) -> Table:
    """``model``'s Core table: bulk statements on it skip the ORM's per-row bookkeeping."""
    return cast(Table, model.__table__)


def insert_ignoring_duplicates(session: Session, table: type[Any]) -> Any:
    """An INSERT that skips rows whose primary key exists (per dialect)."""
    dialect = session.get_bind().dialect.name
    core = _core(table)
    if dialect == "postgresql":
        return pg_insert(core).on_conflict_do_nothing()
    if dialect == "sqlite":
        return sqlite_insert(core).on_conflict_do_nothing()
    return insert(core)


def record_components(
    session: Session, checkpoint_id: int, components: Iterable[ComponentInfo]
) -> None:
    """Insert a checkpoint's component rows."""
    fields = [f.name for f in dataclasses.fields(ComponentInfo)]  # flat: no asdict recursion
    rows = [
        {"checkpoint_id": checkpoint_id, **{f: getattr(c, f) for f in fields}} for c in components
    ]
    if rows:
        session.execute(insert(_core(ComponentRow)), rows)


def reusable_live_digests(session: Session, run_id: int) -> set[str]:
    """The live blobs a new save of ``run_id`` most likely shares, in one statement: those of
    its newest committed checkpoint (for a run with none yet, of the checkpoint it was forked
    from)."""
    newest = select_newest_committed_id(run_id)
    parent = select(RunRow.parent_checkpoint_id).where(RunRow.id == run_id).scalar_subquery()
    source = func.coalesce(newest, parent)
    return set(
        session.scalars(
            select(CheckpointBlobRow.digest)
            .join(BlobRow, BlobRow.digest == CheckpointBlobRow.digest)
            .where(CheckpointBlobRow.checkpoint_id == source, BlobRow.state == BlobState.LIVE)
        )
    )
