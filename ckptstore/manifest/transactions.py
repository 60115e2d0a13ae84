"""The writer's named transactions: plain arguments in, records out, each one transaction.

The checkpointer calls these and never sees a session. Where a transaction must act on the
object store while it holds its locks (a commit checks objects under the GC lock; a mark-corrupt
quarantines the damaged object before commits may trust the row again), the caller passes that
action in as a function of plain values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy.exc import IntegrityError as SQLIntegrityError
from sqlalchemy.orm import Session

from ckptstore.errors import CheckpointNotFoundError, ConfigError
from ckptstore.manifest import lookups
from ckptstore.manifest import queries as q
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import BlobState, Status
from ckptstore.manifest.records import BlobClaim, CheckpointInfo, ComponentInfo

#: digests -> {digest: object size or None if absent}; called inside the commit transaction.
CheckObjects = Callable[[Sequence[str]], Mapping[str, int | None]]
#: The run's committed checkpoints (oldest first) -> ids retention deletes.
ChooseDoomed = Callable[[list[CheckpointInfo]], Iterable[int]]


@dataclass(frozen=True, slots=True)
class OpenedRun:
    """What opening a run for reading or writing found."""

    run_id: int
    #: The writer epoch this writer holds; None for a reader.
    epoch: int | None


def open_run_row(
    db: Database,
    name: str,
    *,
    writable: bool,
    config: dict[str, Any] | None,
    fingerprint: str | None,
    fork_from: tuple[str, int] | None,
    metric_name: str | None,
    higher_is_better: bool,
    allow_config_change: bool,
) -> OpenedRun:
    """Find or create the run; a writer bumps its epoch (fencing older writers) and marks their
    pending checkpoints abandoned. A changed config is refused unless allowed."""

    def transaction(session: Session) -> OpenedRun:
        run = q.find_run(session, name)
        if run is None:
            if not writable:
                raise CheckpointNotFoundError(f"no run named {name!r} in {db!r}")
            parent = None
            if fork_from is not None:
                parent_run = q.find_run(session, fork_from[0])
                if parent_run is None:
                    raise CheckpointNotFoundError(f"fork_from: no run named {fork_from[0]!r}")
                parent = q.committed_at_step(session, parent_run.id, fork_from[1]).id
            run = q.create_run(
                session,
                name,
                config=config,
                fingerprint=fingerprint,
                parent_checkpoint_id=parent,
                metric_name=metric_name,
                higher_is_better=higher_is_better,
            )
        elif (
            fingerprint is not None
            and run.config_fingerprint not in (None, fingerprint)
            and not allow_config_change
        ):
            changed = changed_keys(run.config or {}, config or {})
            raise ConfigError(
                f"run {name!r} was created with a different config (changed: {changed}); "
                "use a new run name, fork it, or pass allow_config_change=True"
            )
        elif writable:
            if fingerprint is not None:
                run.config, run.config_fingerprint = config, fingerprint
            if metric_name is not None:
                run.metric_name = metric_name
                run.higher_is_better = higher_is_better
        epoch = q.bump_epoch(session, run.id) if writable else None
        if epoch is not None:
            q.abandon_pending(session, run.id, epoch)
        return OpenedRun(run.id, epoch)

    try:
        return db.write(transaction, what=f"opening run {name!r}")
    except SQLIntegrityError:
        # Another process created the same run at the same moment: open the existing row.
        return db.write(transaction, what=f"opening run {name!r}")


def changed_keys(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Top-level keys whose values differ between two configs."""
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]


def begin_checkpoint(db: Database, run_id: int, step: int, epoch: int, trigger: str) -> int:
    """Insert the pending row of a save; returns its id."""
    return db.write(
        lambda s: q.begin_checkpoint(s, run_id, step, epoch, trigger),
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
        q.lock_run(session, run_id, epoch)
        q.hold_gc_lock_shared(session)
        existing = q.blob_rows(session, list(claims))
        revived[:] = [d for d, row in existing.items() if row.state != BlobState.LIVE]
        to_check = [d for d in claims if d not in existing or existing[d].state != BlobState.LIVE]
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
        stored = sum(
            existing[d].stored_bytes if d in existing else c.stored_bytes for d, c in final.items()
        )
        q.record_blobs(session, checkpoint_id, final.values())
        q.record_components(session, checkpoint_id, components)
        q.finish_commit(session, checkpoint_id, values(stored))
        q.supersede_step(session, checkpoint_id)

    db.write(transaction, what=f"committing checkpoint at step {step}")
    return revived


def mark_failed(db: Database, checkpoint_id: int, reason: str) -> None:
    """A pending checkpoint failed: it becomes ``failed`` with its reason (never a committed
    one)."""
    db.write(
        lambda s: q.mark(s, checkpoint_id, Status.FAILED, reason, only_if=Status.PENDING),
        what="marking a failed checkpoint",
    )


def apply_retention(db: Database, run_id: int, epoch: int, choose: ChooseDoomed) -> list[int]:
    """Mark ``deleted`` the committed checkpoints ``choose`` picks; the run lock and the epoch
    check keep a writer fenced since its commit from pruning the new writer's checkpoints."""

    def transaction(session: Session) -> list[int]:
        run = q.lock_run(session, run_id, epoch)
        committed = lookups.of_run(run_id, [Status.COMMITTED])
        doomed = sorted(set(choose(lookups.with_components(session, committed, run.name))))
        q.mark_deleted(session, doomed)
        return doomed

    return db.write(transaction, what="applying retention")


def mark_corrupt(
    db: Database,
    checkpoint_id: int,
    reason: str,
    digests: Sequence[str],
    quarantine: Callable[[str], None],
) -> None:
    """The one mark-corrupt (load fallback and verify): the checkpoint becomes corrupt, its
    damaged blobs are condemned and ``quarantine``d with commits held off, so no commit can
    trust a damaged object between the two. Corrupt is recoverable (see :func:`restore`)."""

    def transaction(session: Session) -> None:
        q.mark_corrupt(session, checkpoint_id, reason, digests)
        for digest in digests:
            quarantine(digest)

    db.write(transaction, what="marking a corrupt checkpoint")


def restore(db: Database, checkpoint_id: int, digests: Sequence[str]) -> str | None:
    """A corrupt checkpoint whose every blob verified again becomes committed (or deleted when
    superseded); returns the new status, or None if nothing changed."""
    return db.write(
        lambda s: q.restore_committed(s, checkpoint_id, digests),
        what=f"restoring repaired checkpoint {checkpoint_id}",
    )


def revive_blob(db: Database, digest: str, put_back: Callable[[], bool]) -> bool:
    """A blob quarantined although it verifies goes back: ``put_back`` stores it under its key
    (True if it did) with commits held off, and its row is live again."""

    def transaction(session: Session) -> bool:
        q.hold_gc_lock_exclusive(session)
        if not put_back():
            return False
        q.revive_blobs(session, [digest])
        return True

    return db.write(transaction, what=f"restoring quarantined blob {digest}")


def release_corrupt(db: Database) -> list[int]:
    """Give up on every corrupt checkpoint (``gc --release-corrupt``): each becomes deleted, so
    GC may take its blobs and ``verify`` no longer reports it. Returns their ids."""
    return db.write(q.release_corrupt, what="releasing corrupt checkpoints")
