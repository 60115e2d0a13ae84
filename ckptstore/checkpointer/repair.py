"""Bringing corrupt checkpoints back: corruption is a fact about a blob, not a verdict on a
checkpoint.

A checkpoint is marked corrupt when one of its blobs fails verification; the damaged object is
quarantined and its row condemned, and GC keeps every other blob of the checkpoint. When good
bytes of that digest are stored again (the next save of the same content re-uploads it, or an
operator restores the object), :func:`recheck` re-verifies the whole checkpoint and, when every
blob verifies, makes it committed again (``verify --recheck`` does the same on demand).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptstore.cas.blobs import MissingBlobError, get_blob
from ckptstore.cas.header import MAX_RAW_LEN
from ckptstore.errors import IntegrityError
from ckptstore.manifest import reads
from ckptstore.manifest import transactions as tx
from ckptstore.manifest.db import Database
from ckptstore.objectstore import ObjectStore

log = logging.getLogger("ckptstore.repair")


@dataclass(frozen=True, slots=True)
class Recheck:
    """The outcome of re-verifying one corrupt checkpoint."""

    checkpoint_id: int
    run: str
    step: int
    #: "committed" or "deleted" (superseded) when repaired; "corrupt" when still damaged.
    status: str
    #: Blobs that are still missing or damaged: (digest, "missing" | "corrupt", detail).
    problems: tuple[tuple[str, str, str], ...] = ()
    bytes_checked: int = 0
    blobs_checked: int = 0

    @property
    def repaired(self) -> bool:
        """True if the checkpoint is no longer corrupt."""
        return self.status != "corrupt"


def check_blob(
    store: ObjectStore, digest: str, max_raw_len: int
) -> tuple[str, tuple[str, str] | None, int]:
    """(digest, None, raw bytes) if the blob verifies; else (digest, (kind, detail), 0) with
    kind "missing" or "corrupt". Never raises IntegrityError."""
    try:
        _, raw = get_blob(store, digest, max_raw_len=max_raw_len)
    except MissingBlobError as exc:
        return digest, ("missing", str(exc)), 0
    except IntegrityError as exc:
        return digest, ("corrupt", str(exc)), 0
    return digest, None, raw.nbytes


def recheck(
    db: Database,
    store: ObjectStore,
    checkpoint_ids: Iterable[int],
    *,
    workers: int = 8,
    restore: bool = True,
) -> list[Recheck]:
    """Re-verify every blob of the given corrupt checkpoints; restore those that verify
    (unless ``restore`` is False: then only report)."""
    results: list[Recheck] = []
    verdicts: dict[str, tuple[str, str] | None] = {}
    with ThreadPoolExecutor(workers) as pool:
        for checkpoint_id in checkpoint_ids:
            found = reads.checkpoint(db, checkpoint_id)
            if found is None or found.status != "corrupt":
                continue
            sizes = reads.blob_sizes(db, checkpoint_id)
            for comp in found.components:
                sizes.setdefault(comp.index_digest, None)
            todo = [d for d in sizes if d not in verdicts]
            bounds = [sizes[d] or MAX_RAW_LEN for d in todo]
            for digest, verdict, _ in pool.map(check_blob, [store] * len(todo), todo, bounds):
                verdicts[digest] = verdict
            problems = tuple((d, v[0], v[1]) for d in sizes if (v := verdicts[d]) is not None)
            status = "corrupt"
            if not problems and restore:
                restored = tx.restore(db, checkpoint_id, list(sizes))
                status = restored or "corrupt"
                if restored is not None:
                    log.warning(
                        "REPAIRED: run %r step %d verifies again and is %s",
                        found.run,
                        found.step,
                        restored,
                    )
            results.append(
                Recheck(
                    checkpoint_id,
                    found.run,
                    found.step,
                    status,
                    problems,
                    bytes_checked=sum(size or 0 for size in sizes.values()),
                    blobs_checked=len(sizes),
                )
            )
    return results
