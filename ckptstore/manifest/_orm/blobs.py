"""Blob rows, a checkpoint's references to them, and its component rows."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, cast

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Integer,
    String,
    Table,
    func,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from ckptstore.manifest._sql.lookups import select_newest_committed_id
from ckptstore.manifest._sql.sets import among, select_rows
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
    #: Whether the object store holds it (false: only node-local tiers, until a drain).
    in_store: bool = True


def blob_rows(
    session: Session, digests: Sequence[str], *, lock: bool = True
) -> dict[str, BlobFacts]:
    """Rows of ``digests``, whatever their state, in one statement (each row locked for update
    on PostgreSQL unless ``lock`` is False)."""
    columns = (
        BlobRow.digest,
        BlobRow.state,
        BlobRow.logical_bytes,
        BlobRow.stored_bytes,
        BlobRow.in_store,
    )
    if not digests:
        return {}
    query = select(*columns).where(among(BlobRow.digest, digests, dialect_of(session)))
    rows = session.execute(query.with_for_update() if lock else query)
    return {
        digest: BlobFacts(state, logical, stored, bool(in_store))
        for digest, state, logical, stored, in_store in rows
    }


def dialect_of(session: Session) -> str:
    """The name of the session's database dialect (``sqlite``, ``postgresql``)."""
    return session.get_bind().dialect.name


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
    if digests:
        session.execute(
            update(BlobRow)
            .where(among(BlobRow.digest, digests, dialect_of(session)))
            .values(state=BlobState.LIVE, condemned_at=None, last_claimed_at=now)
            .execution_options(synchronize_session=False)
        )
    return now


def record_blobs(
    session: Session,
    checkpoint_id: int,
    claims: Iterable[BlobClaim],
    existing: Mapping[str, BlobFacts],
    *,
    in_store: bool = True,
) -> None:
    """Insert rows for new blobs, claim existing ones, and reference them all: three statements
    whatever the number of blobs, each binding its whole set as one parameter
    (:mod:`ckptstore.manifest._sql.sets`). ``existing``: the rows of ``claims`` the caller has
    read in this transaction, holding the GC lock (so none is condemned or deleted since).

    ``in_store``: a store commit has checked that the store holds every blob (new rows and
    claimed ones are ``in_store``); a local commit (False) checked only the tiers' copies: its
    new rows are not ``in_store``, and neither is a claimed row that was not live (its object
    may have been quarantined or swept; the drain checks the store again)."""
    now = utcnow()
    dialect = dialect_of(session)
    unique = {c.digest: c for c in claims}
    new = [c for c in unique.values() if c.digest not in existing]
    if new:
        # Another transaction may insert the same new blob concurrently (two runs saving
        # the same weights): its row wins -- live and claimed just now, and GC cannot run
        # before we commit (the commit holds the GC lock shared) -- and is referenced below.
        rows = select_rows(
            {
                "digest": (String, [c.digest for c in new]),
                "kind": (String, [c.kind for c in new]),
                "logical_bytes": (BigInteger, [c.logical_bytes for c in new]),
                "stored_bytes": (BigInteger, [c.stored_bytes for c in new]),
                "codec": (String, [c.codec for c in new]),
            },
            dialect,
        )
        stamped = rows.add_columns(
            literal(now, DateTime(timezone=True)).label("created_at"),
            literal(now, DateTime(timezone=True)).label("last_claimed_at"),
            literal(BlobState.LIVE.value, String).label("state"),
            literal(in_store, Boolean).label("in_store"),
        )
        session.execute(
            insert_ignoring_duplicates(session, BlobRow).from_select(
                [c.name for c in stamped.selected_columns], stamped
            )
        )
    claimed = [d for d in unique if d in existing]
    if claimed:
        # GC's grace counts from last_claimed_at: every reused row is claimed again.
        session.execute(
            update(BlobRow)
            .where(among(BlobRow.digest, claimed, dialect))
            .values(last_claimed_at=now, state=BlobState.LIVE)
            .execution_options(synchronize_session=False)
        )
        # A store commit found in the store every row that was not known to be there; a local
        # one vouches for no stored object of a row it brought back from condemned.
        if in_store:
            marked = [d for d in claimed if not existing[d].in_store]
        else:
            marked = [d for d in claimed if existing[d].state != BlobState.LIVE.value]
        if marked:
            session.execute(
                update(BlobRow)
                .where(among(BlobRow.digest, marked, dialect))
                .values(in_store=in_store)
                .execution_options(synchronize_session=False)
            )
    if unique:
        refs = select_rows({"digest": (String, list(unique))}, dialect)
        refs = refs.add_columns(literal(checkpoint_id, Integer).label("checkpoint_id"))
        session.execute(
            insert(_core(CheckpointBlobRow)).from_select(["digest", "checkpoint_id"], refs)
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
    session: Session, checkpoint_id: int, components: Sequence[ComponentInfo]
) -> None:
    """Insert a checkpoint's component rows, in one statement."""
    if not components:
        return
    kinds = {
        "name": String,
        "kind": String,
        "index_digest": String,
        "logical_bytes": BigInteger,
        "stored_bytes": BigInteger,
        "entries": BigInteger,
    }
    assert set(kinds) == {f.name for f in dataclasses.fields(ComponentInfo)}
    rows = select_rows(
        {name: (kind, [getattr(c, name) for c in components]) for name, kind in kinds.items()},
        dialect_of(session),
    )
    rows = rows.add_columns(literal(checkpoint_id, Integer).label("checkpoint_id"))
    session.execute(
        insert(_core(ComponentRow)).from_select([c.name for c in rows.selected_columns], rows)
    )


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
            .where(
                CheckpointBlobRow.checkpoint_id == source,
                BlobRow.state == BlobState.LIVE,
                BlobRow.in_store,
            )
        )
    )
