"""Committing a save: the pending row, the commit (DESIGN §7.4), a failed save, retention.

The checkpointer calls these and never sees a session. The commit checks objects in the store
while it holds the GC lock: the caller passes that check in as a function of plain values.

The call protocol: :func:`begin_checkpoint` (the coordinator, before any upload) -> every
worker uploads its shards and returns a receipt (no database access) -> the coordinator's
:func:`commit_checkpoint` over every receipt, or :func:`mark_failed` -> :func:`apply_retention`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy.orm import Session

from ckptstore.manifest._orm import blobs, checkpoints, runs
from ckptstore.manifest._sql import lookups, tables
from ckptstore.manifest._sql.tables import to_record
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import BlobState, Status
from ckptstore.manifest.records import BlobClaim, CheckpointInfo, ComponentInfo

#: digests -> {digest: object size or None if absent}; called inside the commit transaction.
CheckObjects = Callable[[Sequence[str]], Mapping[str, int | None]]
#: The run's committed checkpoints (oldest first; records without their components) -> ids
#: retention deletes.
ChooseDoomed = Callable[[list[CheckpointInfo]], Iterable[int]]


def begin_checkpoint(db: Database, run_id: int, step: int, epoch: int, trigger: str) -> int:
    """Insert the pending row of a save; returns its id."""
    return db.write(
        lambda s: checkpoints.insert_pending(s, run_id, step, epoch, trigger),
        what=f"starting checkpoint at step {step}",
    )


def commit_checkpoint(
    db: Database,
    *,
    run_id: int,
    epoch: int,
    checkpoint_id: int,
    step: int,
    claims: Mapping[str, BlobClaim],
    components: Sequence[ComponentInfo],
    values: Callable[[int], dict[str, Any]],
    check_objects: CheckObjects,
) -> list[str]:
    """The commit (DESIGN §7.4): the writer epoch must still be ours; every blob that is not a
    live row is checked in the store (``check_objects``) while the GC lock is held; blob rows,
    references and components are recorded; the row becomes committed and an older committed
    checkpoint of the same step is superseded. ``values(stored_bytes)`` gives the row's
    remaining columns. Returns the digests this commit brought back from condemned to live."""
    revived: list[str] = []

    def transaction(session: Session) -> None:
        runs.lock_run(session, run_id, epoch)
        runs.hold_gc_lock_shared(session)
        # No row locks: only GC's mark and sweep and marking corrupt take a blob row away from
        # live (condemn, delete), and each holds the GC lock exclusive, which waits for ours;
        # other commits only make rows live. So the rows read here stay as read, or become
        # live, until this transaction ends -- one set-based lock instead of one per row.
        existing = blobs.blob_rows(session, list(claims), lock=False)
        live = BlobState.LIVE.value  # one enum lookup, not one per blob
        revived[:] = [d for d, row in existing.items() if row.state != live]
        # A live row the store holds is trusted; anything else is looked for in the store.
        to_check = [
            d
            for d in claims
            if d not in existing or existing[d].state != live or not existing[d].in_store
        ]
        sizes = check_objects(to_check)
        final = dict(claims)
        for digest, size in sizes.items():
            claim = final[digest]
            if (
                size is not None
                and digest not in existing
                and not claim.uploaded
                and claim.stored_bytes != size
            ):
                # Claimed as "already stored" from a row GC has since removed: the new row
                # takes the object's real size, not the claim's placeholder.
                final[digest] = replace(claim, stored_bytes=size)
        checkpoints.record_commit(session, checkpoint_id, final, existing, components, values)

    db.write(transaction, what=f"committing checkpoint at step {step}")
    return revived


def mark_failed(db: Database, checkpoint_id: int, reason: str) -> None:
    """A pending checkpoint failed: it becomes ``failed`` with its reason (never a committed
    one)."""
    db.write(
        lambda s: checkpoints.set_status(
            s, checkpoint_id, Status.FAILED, reason, only_if=Status.PENDING
        ),
        what="marking a failed checkpoint",
    )


def apply_retention(db: Database, run_id: int, epoch: int, choose: ChooseDoomed) -> list[int]:
    """Mark ``deleted`` the committed checkpoints ``choose`` picks; the run lock and the epoch
    check keep a writer fenced since its commit from pruning the new writer's checkpoints."""

    def transaction(session: Session) -> list[int]:
        run = runs.lock_run(session, run_id, epoch)
        committed = lookups.select_checkpoints_of(run_id, [Status.COMMITTED])
        # Rows only: retention ranks by step, trigger and metrics, and reading every kept
        # checkpoint's components would cost each save of R ranks R rows per kept checkpoint.
        kept = [
            to_record(CheckpointInfo, tables.checkpoints, row, run=run.name, components=())
            for row in tables.fetch_rows(session, committed)
        ]
        doomed = sorted(set(choose(kept)))
        checkpoints.mark_deleted(session, doomed)
        return doomed

    return db.write(transaction, what="applying retention")
