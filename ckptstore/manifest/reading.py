"""Reading the manifest: plain arguments in, public records out (no session leaves the manifest).

Used by the checkpointer (latest, load, fallback), maintenance (verify) and the CLI; none of them
writes SQL of its own. Runs and checkpoints are looked up in SQLAlchemy Core
(:mod:`ckptstore.manifest._sql.lookups`), so the CLI's read commands never import the ORM; the
blob lookups below, which only savers, loaders and verify make, import it when first called.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptstore.errors import CheckpointNotFoundError
from ckptstore.manifest._sql import lookups, tables
from ckptstore.manifest._sql.tables import to_record
from ckptstore.manifest.db import Database
from ckptstore.manifest.records import CheckpointInfo, ComponentInfo, RunInfo
from ckptstore.manifest.statuses import Status


def find_run(db: Database, name: str) -> RunInfo | None:
    """The run named ``name``, or None."""
    with db.connect() as conn:
        return lookups.fetch_run(conn, name)


def require_run(db: Database, name: str) -> RunInfo:
    """The run named ``name``; CheckpointNotFoundError (naming `ckptstore runs`) if absent."""
    found = find_run(db, name)
    if found is None:
        raise CheckpointNotFoundError(f"no run named {name!r}; `ckptstore runs` lists them")
    return found


def latest(db: Database, run: RunInfo | tuple[int, str]) -> CheckpointInfo | None:
    """The newest committed checkpoint with its components (one indexed statement), or None."""
    run_id, name = _key(run)
    with db.connect() as conn:
        return lookups.fetch_latest(conn, run_id, name)


def newest_committed(
    db: Database, run: RunInfo | tuple[int, str], *, before_step: int | None = None
) -> CheckpointInfo | None:
    """The newest committed checkpoint (below ``before_step`` if given), with components."""
    run_id, name = _key(run)
    query = lookups.select_newest_committed(run_id, before_step=before_step)
    with db.connect() as conn:
        found = lookups.fetch_with_components(conn, query, name)
    return found[0] if found else None


def committed_at(db: Database, run: RunInfo | tuple[int, str], step: int) -> CheckpointInfo:
    """The committed checkpoint at ``step`` with its components; an error that says why not."""
    run_id, name = _key(run)
    with db.connect() as conn:
        row = lookups.fetch_committed_at_step(conn, run_id, step)
        return lookups.fetch_checkpoint_of_row(conn, row, name)


def checkpoint_at(db: Database, run: RunInfo | tuple[int, str], step: int) -> CheckpointInfo | None:
    """The checkpoint at ``step`` that a load may read (local or committed), with its
    components, or None."""
    run_id, name = _key(run)
    query = lookups.select_checkpoints_of(run_id, [Status.LOCAL, Status.COMMITTED]).where(
        tables.checkpoints.c.step == step
    )
    with db.connect() as conn:
        found = lookups.fetch_with_components(conn, query, name)
    return found[-1] if found else None


def checkpoint_or_latest(
    db: Database, name: str, step: int | None, *, local: bool = False
) -> CheckpointInfo:
    """``RUN@STEP`` (or ``RUN``: its newest committed checkpoint), with components; ``local``:
    ``RUN@STEP`` may also be local-durable (what describes it, not what reads the store)."""
    run = require_run(db, name)
    if step is not None:
        found_local = checkpoint_at(db, run, step) if local else None
        return found_local if found_local is not None else committed_at(db, run, step)
    found = latest(db, run)
    if found is None:
        raise CheckpointNotFoundError(f"run {name!r} has no committed checkpoint")
    return found


def checkpoints(
    db: Database, run: RunInfo | tuple[int, str], statuses: Sequence[str] | None = None
) -> list[CheckpointInfo]:
    """Every checkpoint of the run (optionally only some statuses), oldest first."""
    run_id, name = _key(run)
    with db.connect() as conn:
        query = lookups.select_checkpoints_of(run_id, statuses)
        return lookups.fetch_with_components(conn, query, name)


def checkpoint(db: Database, checkpoint_id: int) -> CheckpointInfo | None:
    """One checkpoint by id, with its run's name and components, or None."""
    with db.connect() as conn:
        found = lookups.fetch_with_components(conn, lookups.select_checkpoint_by_id(checkpoint_id))
    return found[0] if found else None


def committed(
    db: Database, checkpoint_id: int, components: Sequence[ComponentInfo]
) -> CheckpointInfo | None:
    """The checkpoint a commit just recorded, with the ``components`` it recorded (not read
    back: a commit of 16,384 ranks would read as many rows again), or None."""
    with db.connect() as conn:
        rows = tables.fetch_rows(conn, lookups.select_checkpoint_by_id(checkpoint_id))
    if not rows:
        return None
    parts = tuple(sorted(components, key=lambda c: c.name))  # as the manifest lists them
    return to_record(
        CheckpointInfo, tables.checkpoints, rows[0], run=rows[0].run_name or "?", components=parts
    )


def targets(
    db: Database, *, run: str | None, step: int | None, status: str = Status.COMMITTED
) -> list[CheckpointInfo]:
    """Checkpoints in ``status`` (of one run, at one step), by run name and step: what verify
    walks."""
    with db.connect() as conn:
        query = lookups.select_in_status(status, run=run, step=step)
        return lookups.fetch_with_components(conn, query)


def blob_sizes(db: Database, checkpoint_id: int) -> dict[str, int | None]:
    """Every blob a checkpoint references and the raw length its row records (None: no row)."""
    from ckptstore.manifest._orm.checkpoints import checkpoint_blob_sizes

    with db.read() as session:
        return checkpoint_blob_sizes(session, checkpoint_id)


def index_lengths(db: Database, digests: Sequence[str]) -> dict[str, int]:
    """The raw length the manifest records for each blob (bounds what a read may allocate)."""
    from ckptstore.manifest._orm.blobs import blob_rows

    with db.read() as session:
        rows = blob_rows(session, list(digests), lock=False)
        return {digest: row.logical_bytes for digest, row in rows.items()}


def some_digests(db: Database, checkpoint_id: int, *, limit: int) -> list[str]:
    """Up to ``limit`` digests the checkpoint references."""
    from ckptstore.manifest._orm.checkpoints import checkpoint_digests

    with db.read() as session:
        return checkpoint_digests(session, checkpoint_id, limit=limit)


def live_digests_to_reuse(db: Database, run_id: int) -> frozenset[str]:
    """The live blobs the run's next save most likely shares (its newest committed checkpoint's,
    or its fork parent's): the writer's dedup set, one query per save."""
    from ckptstore.manifest._orm.blobs import reusable_live_digests

    with db.read() as session:
        return frozenset(reusable_live_digests(session, run_id))


def corrupt_referencing(db: Database, digests: Sequence[str]) -> list[int]:
    """Ids of corrupt checkpoints that reference any of ``digests``."""
    from ckptstore.manifest._orm.checkpoints import corrupt_ids_referencing

    with db.read() as session:
        return corrupt_ids_referencing(session, digests)


def replica_counts(db: Database, checkpoint_ids: Sequence[int]) -> dict[int, int]:
    """Each checkpoint -> the fewest node-local tier copies any of its blobs has."""
    with db.connect() as conn:
        return lookups.fetch_replica_counts(conn, list(checkpoint_ids))


def durability(status: str) -> str | None:
    """What a checkpoint of ``status`` survives: ``"remote"`` (committed: the object store
    holds it), ``"local"`` (on node-local tiers only), or None (not loadable)."""
    return {Status.COMMITTED: "remote", Status.LOCAL: "local"}.get(Status(status))


def _key(run: RunInfo | tuple[int, str]) -> tuple[int, str]:
    return (run.id, run.name) if isinstance(run, RunInfo) else run
