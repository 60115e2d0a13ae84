"""Read-only lookups: plain arguments in, public records out (no session leaves the manifest).

Used by the checkpointer (latest, load, fallback), maintenance (verify) and the CLI; none of them
writes SQL of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select

from ckptstore.errors import CheckpointNotFoundError
from ckptstore.manifest import queries as q
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import CheckpointRow, RunRow, Status
from ckptstore.manifest.records import CheckpointInfo, RunInfo


def find_run(db: Database, name: str) -> RunInfo | None:
    """The run named ``name``, or None."""
    with db.read() as session:
        row = q.find_run(session, name)
        return None if row is None else row.to_record()


def require_run(db: Database, name: str) -> RunInfo:
    """The run named ``name``; CheckpointNotFoundError (naming `ckptstore runs`) if absent."""
    found = find_run(db, name)
    if found is None:
        raise CheckpointNotFoundError(f"no run named {name!r}; `ckptstore runs` lists them")
    return found


def latest(db: Database, run: RunInfo | tuple[int, str]) -> CheckpointInfo | None:
    """The newest committed checkpoint with its components (one indexed statement), or None."""
    run_id, name = _key(run)
    with db.read() as session:
        found = q.latest_with_components(session, run_id)
        return None if found is None else found[0].to_record(name, found[1])


def newest_committed(
    db: Database, run: RunInfo | tuple[int, str], *, before_step: int | None = None
) -> CheckpointInfo | None:
    """The newest committed checkpoint (below ``before_step`` if given), with components."""
    run_id, name = _key(run)
    with db.read() as session:
        row = q.latest_committed(session, run_id, before_step=before_step)
        return None if row is None else row.to_record(name, q.components_of(session, row.id))


def committed_at(db: Database, run: RunInfo | tuple[int, str], step: int) -> CheckpointInfo:
    """The committed checkpoint at ``step`` with its components; an error that says why not."""
    run_id, name = _key(run)
    with db.read() as session:
        row = q.committed_at_step(session, run_id, step)
        return row.to_record(name, q.components_of(session, row.id))


def checkpoint_or_latest(db: Database, name: str, step: int | None) -> CheckpointInfo:
    """``RUN@STEP`` (or ``RUN``: its newest committed checkpoint), with components."""
    run = require_run(db, name)
    if step is not None:
        return committed_at(db, run, step)
    found = latest(db, run)
    if found is None:
        raise CheckpointNotFoundError(f"run {name!r} has no committed checkpoint")
    return found


def checkpoints(
    db: Database, run: RunInfo | tuple[int, str], statuses: Sequence[str] | None = None
) -> list[CheckpointInfo]:
    """Every checkpoint of the run (optionally only some statuses), oldest first."""
    run_id, name = _key(run)
    with db.read() as session:
        return [
            row.to_record(name, q.components_of(session, row.id))
            for row in q.checkpoints_of(session, run_id, statuses)
        ]


def checkpoint(db: Database, checkpoint_id: int) -> CheckpointInfo | None:
    """One checkpoint by id, with its run's name and components, or None."""
    with db.read() as session:
        row = session.get(CheckpointRow, checkpoint_id)
        if row is None:
            return None
        run = session.get(RunRow, row.run_id)
        return row.to_record(run.name if run else "?", q.components_of(session, row.id))


def targets(
    db: Database, *, run: str | None, step: int | None, status: str = Status.COMMITTED
) -> list[CheckpointInfo]:
    """Checkpoints in ``status`` (of one run, at one step), by run name and step: what verify
    walks."""
    with db.read() as session:
        query = (
            select(CheckpointRow, RunRow.name)
            .join(RunRow, RunRow.id == CheckpointRow.run_id)
            .where(CheckpointRow.status == status)
        )
        if run is not None:
            query = query.where(RunRow.name == run)
        if step is not None:
            query = query.where(CheckpointRow.step == step)
        rows = list(session.execute(query.order_by(RunRow.name, CheckpointRow.step)))
        return [row.to_record(name, q.components_of(session, row.id)) for row, name in rows]


def blob_sizes(db: Database, checkpoint_id: int) -> dict[str, int | None]:
    """Every blob a checkpoint references and the raw length its row records (None: no row)."""
    with db.read() as session:
        return q.checkpoint_blob_sizes(session, checkpoint_id)


def index_lengths(db: Database, digests: Sequence[str]) -> dict[str, int]:
    """The raw length the manifest records for each blob (bounds what a read may allocate)."""
    with db.read() as session:
        rows = q.blob_rows(session, list(digests), lock=False)
        return {digest: row.logical_bytes for digest, row in rows.items()}


def some_digests(db: Database, checkpoint_id: int, *, limit: int) -> list[str]:
    """Up to ``limit`` digests the checkpoint references."""
    with db.read() as session:
        return q.checkpoint_digests(session, checkpoint_id, limit=limit)


def live_digests_to_reuse(db: Database, run_id: int) -> frozenset[str]:
    """The live blobs the run's next save most likely shares (its newest committed checkpoint's,
    or its fork parent's): the writer's dedup set, one query per save."""
    with db.read() as session:
        return frozenset(q.live_digests_to_reuse(session, run_id))


def corrupt_referencing(db: Database, digests: Sequence[str]) -> list[int]:
    """Ids of corrupt checkpoints that reference any of ``digests``."""
    with db.read() as session:
        return q.corrupt_referencing(session, digests)


def _key(run: RunInfo | tuple[int, str]) -> tuple[int, str]:
    return (run.id, run.name) if isinstance(run, RunInfo) else run
