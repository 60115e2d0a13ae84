"""Blob copies on node-local tiers: the rows, what is recoverable from which nodes, what a tier
may drop (DESIGN.md §13). Statements inside the caller's session."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

from sqlalchemy import (
    DateTime,
    String,
    and_,
    delete,
    exists,
    false,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session, aliased
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import ScalarSelect

from ckptstore.manifest._orm.blobs import dialect_of, insert_ignoring_duplicates
from ckptstore.manifest._sql.sets import among, select_rows
from ckptstore.manifest._sql.tables import BATCH
from ckptstore.manifest.models import (
    BlobCopyRow,
    BlobRow,
    BlobState,
    CheckpointBlobRow,
    CheckpointRow,
    Status,
    utcnow,
)

#: The statuses whose checkpoints a resume may load from the tiers or the store.
RECOVERABLE = (Status.LOCAL, Status.COMMITTED)


def copy_nodes(session: Session, digests: Sequence[str]) -> dict[str, set[str]]:
    """Each of ``digests`` -> the nodes with a copy row for it (absent: none)."""
    found: dict[str, set[str]] = {}
    dialect = dialect_of(session)
    for i in range(0, len(digests), BATCH * 20):
        rows = session.execute(
            select(BlobCopyRow.digest, BlobCopyRow.node).where(
                among(BlobCopyRow.digest, digests[i : i + BATCH * 20], dialect)
            )
        )
        for digest, node in rows:
            found.setdefault(digest, set()).add(node)
    return found


def insert_copies(session: Session, pairs: Iterable[tuple[str, str]]) -> None:
    """Copy rows for (digest, node) pairs, skipping those that exist: one statement."""
    pairs = sorted(set(pairs))
    if not pairs:
        return
    rows = select_rows(
        {"digest": (String, [d for d, _ in pairs]), "node": (String, [n for _, n in pairs])},
        dialect_of(session),
    )
    stamped = rows.add_columns(literal(utcnow(), DateTime(timezone=True)).label("created_at"))
    session.execute(
        insert_ignoring_duplicates(session, BlobCopyRow).from_select(
            ["digest", "node", "created_at"], stamped
        )
    )


def delete_copies(session: Session, node: str, digests: Sequence[str]) -> None:
    """Forget ``node``'s copies of ``digests``."""
    dialect = dialect_of(session)
    for i in range(0, len(digests), BATCH * 20):
        session.execute(
            delete(BlobCopyRow)
            .where(
                BlobCopyRow.node == node,
                among(BlobCopyRow.digest, digests[i : i + BATCH * 20], dialect),
            )
            .execution_options(synchronize_session=False)
        )


def delete_node(session: Session, node: str) -> int:
    """Forget every copy on ``node``; how many there were."""
    result = session.execute(
        delete(BlobCopyRow)
        .where(BlobCopyRow.node == node)
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def _uncovered(checkpoint_id: Any, reachable: Collection[str]) -> ColumnElement[bool]:
    """SQL: the checkpoint references a blob that neither the store holds nor any of
    ``reachable``'s tiers."""
    ref = aliased(CheckpointBlobRow)
    copy = select(1).where(BlobCopyRow.digest == ref.digest)
    copy = copy.where(BlobCopyRow.node.in_(sorted(reachable)) if reachable else false())
    return exists(
        select(1)
        .select_from(ref)
        .join(BlobRow, BlobRow.digest == ref.digest)
        .where(ref.checkpoint_id == checkpoint_id, ~BlobRow.in_store, ~exists(copy))
    )


def newest_recoverable_id(
    session: Session,
    run_id: int,
    reachable: Collection[str],
    *,
    before_step: int | None = None,
    step: int | None = None,
) -> int | None:
    """The id of the run's newest checkpoint (local or committed; below ``before_step``, or at
    ``step``) whose every blob the store or one of the ``reachable`` nodes' tiers holds: one
    statement."""
    query = select(CheckpointRow.id).where(
        CheckpointRow.run_id == run_id,
        CheckpointRow.status.in_([s.value for s in RECOVERABLE]),
        ~_uncovered(CheckpointRow.id, reachable),
    )
    if before_step is not None:
        query = query.where(CheckpointRow.step < before_step)
    if step is not None:
        query = query.where(CheckpointRow.step == step)
    found = session.scalar(
        query.order_by(CheckpointRow.step.desc(), CheckpointRow.id.desc()).limit(1)
    )
    return int(found) if found is not None else None


def checkpoint_copies(session: Session, checkpoint_id: int) -> dict[str, tuple[bool, set[str]]]:
    """Every blob of a checkpoint -> (the store holds it, the nodes with a copy row)."""
    rows = session.execute(
        select(CheckpointBlobRow.digest, BlobRow.in_store, BlobCopyRow.node)
        .join(BlobRow, BlobRow.digest == CheckpointBlobRow.digest)
        .outerjoin(BlobCopyRow, BlobCopyRow.digest == CheckpointBlobRow.digest)
        .where(CheckpointBlobRow.checkpoint_id == checkpoint_id)
    )
    found: dict[str, tuple[bool, set[str]]] = {}
    for digest, in_store, node in rows:
        entry = found.setdefault(digest, (bool(in_store), set()))
        if node is not None:
            entry[1].add(node)
    return found


def not_in_store(session: Session, checkpoint_id: int) -> dict[str, tuple[int, set[str]]]:
    """The blobs of a checkpoint the store may not hold (not ``in_store``, or not live: a
    condemned row's object may be gone) -> (their stored bytes, the nodes with a copy)."""
    rows = session.execute(
        select(BlobRow.digest, BlobRow.stored_bytes, BlobCopyRow.node)
        .join(CheckpointBlobRow, CheckpointBlobRow.digest == BlobRow.digest)
        .outerjoin(BlobCopyRow, BlobCopyRow.digest == BlobRow.digest)
        .where(
            CheckpointBlobRow.checkpoint_id == checkpoint_id,
            or_(~BlobRow.in_store, (BlobRow.state + "") != BlobState.LIVE.value),
        )
    )
    found: dict[str, tuple[int, set[str]]] = {}
    for digest, size, node in rows:
        entry = found.setdefault(digest, (int(size), set()))
        if node is not None:
            entry[1].add(node)
    return found


def mark_in_store(session: Session, digests: Sequence[str]) -> None:
    """The store holds these blobs now (a drain found them there): live and ``in_store``."""
    dialect = dialect_of(session)
    for i in range(0, len(digests), BATCH * 20):
        session.execute(
            update(BlobRow)
            .where(among(BlobRow.digest, digests[i : i + BATCH * 20], dialect))
            .values(
                in_store=True, state=BlobState.LIVE, condemned_at=None, last_claimed_at=utcnow()
            )
            .execution_options(synchronize_session=False)
        )


def _wanted_on_tiers(keep_last: int) -> ColumnElement[bool]:
    """SQL over a ``checkpoints`` row: its copies are kept on the tiers -- it is local (not
    drained yet) or pending (a save in flight), or one of its run's ``keep_last`` newest local
    or committed checkpoints."""
    return or_(
        CheckpointRow.status.in_([Status.LOCAL.value, Status.PENDING.value]),
        and_(CheckpointRow.status == Status.COMMITTED, _newer_count() < keep_last),
    )


def _newer_count() -> ScalarSelect[int]:
    """SQL over a ``checkpoints`` row: how many local or committed checkpoints of its run are
    newer."""
    newer = aliased(CheckpointRow)
    return (
        select(func.count())
        .select_from(newer)
        .where(
            newer.run_id == CheckpointRow.run_id,
            newer.status.in_([s.value for s in RECOVERABLE]),
            newer.step > CheckpointRow.step,
        )
        .scalar_subquery()
    )


def evictable_copies(session: Session, node: str, keep_last: int, *, limit: int) -> list[str]:
    """Up to ``limit`` digests of ``node``'s copies that no checkpoint keeps on the tiers."""
    kept = exists(
        select(1)
        .select_from(CheckpointBlobRow)
        .join(CheckpointRow, CheckpointRow.id == CheckpointBlobRow.checkpoint_id)
        .where(CheckpointBlobRow.digest == BlobCopyRow.digest, _wanted_on_tiers(keep_last))
    )
    return list(
        session.scalars(
            select(BlobCopyRow.digest)
            .where(BlobCopyRow.node == node, ~kept)
            .order_by(BlobCopyRow.digest)
            .limit(limit)
        )
    )


def supersede_locals(session: Session, run_id: int, keep_last: int) -> list[int]:
    """The run's local checkpoints older than its newest committed one and outside its
    ``keep_last`` newest become deleted: a drained newer checkpoint made them unnecessary, and
    the tiers will not keep their copies. Returns their ids."""
    newest_committed = (
        select(func.max(CheckpointRow.step))
        .where(CheckpointRow.run_id == run_id, CheckpointRow.status == Status.COMMITTED)
        .scalar_subquery()
    )
    ids = list(
        session.scalars(
            select(CheckpointRow.id).where(
                CheckpointRow.run_id == run_id,
                CheckpointRow.status == Status.LOCAL,
                CheckpointRow.step < newest_committed,
                _newer_count() >= keep_last,
            )
        )
    )
    if ids:
        session.execute(
            update(CheckpointRow)
            .where(CheckpointRow.id.in_(ids), CheckpointRow.status == Status.LOCAL)
            .values(
                status=Status.DELETED,
                error="dropped from the local tiers: a newer checkpoint was drained to the store",
            )
            .execution_options(synchronize_session=False)
        )
    return ids


def copies_on_node(session: Session, node: str, digests: Sequence[str]) -> set[str]:
    """Those of ``digests`` ``node`` has a copy row for."""
    known: set[str] = set()
    dialect = dialect_of(session)
    for i in range(0, len(digests), BATCH * 20):
        known.update(
            session.scalars(
                select(BlobCopyRow.digest).where(
                    BlobCopyRow.node == node,
                    among(BlobCopyRow.digest, digests[i : i + BATCH * 20], dialect),
                )
            )
        )
    return known


def nodes_with_copies(session: Session) -> list[str]:
    """Every node some copy row names."""
    return sorted(session.scalars(select(BlobCopyRow.node).distinct()))
