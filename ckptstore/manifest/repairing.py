"""Repairing: a damaged checkpoint marked corrupt (and its blobs quarantined), a repaired one
restored, a wrongly quarantined blob put back, corrupt checkpoints given up on.

Where a transaction must act on the object store while it holds its locks (a mark-corrupt
quarantines the damaged object before commits may trust the row again), the caller passes that
action in as a function of plain values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sqlalchemy.orm import Session

from ckptstore.manifest._orm import blobs, checkpoints, runs
from ckptstore.manifest.db import Database


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
        checkpoints.corrupt_and_condemn(session, checkpoint_id, reason, digests)
        for digest in digests:
            quarantine(digest)

    db.write(transaction, what="marking a corrupt checkpoint")


def restore(db: Database, checkpoint_id: int, digests: Sequence[str]) -> str | None:
    """A corrupt checkpoint whose every blob verified again becomes committed (or deleted when
    superseded); returns the new status, or None if nothing changed."""
    return db.write(
        lambda s: checkpoints.restore_committed(s, checkpoint_id, digests),
        what=f"restoring repaired checkpoint {checkpoint_id}",
    )


def revive_blob(db: Database, digest: str, put_back: Callable[[], bool]) -> bool:
    """A blob quarantined although it verifies goes back: ``put_back`` stores it under its key
    (True if it did) with commits held off, and its row is live again."""

    def transaction(session: Session) -> bool:
        runs.hold_gc_lock_exclusive(session)
        if not put_back():
            return False
        blobs.revive_blob_rows(session, [digest])
        return True

    return db.write(transaction, what=f"restoring quarantined blob {digest}")


def release_corrupt(db: Database) -> list[int]:
    """Give up on every corrupt checkpoint (``gc --release-corrupt``): each becomes deleted, so
    GC may take its blobs and ``verify`` no longer reports it. Returns their ids."""
    return db.write(checkpoints.delete_corrupt, what="releasing corrupt checkpoints")
