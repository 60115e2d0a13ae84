"""Bringing corrupt checkpoints back: corruption is a fact about a blob, not a verdict on a
checkpoint.

A checkpoint is marked corrupt when one of its blobs fails verification; the damaged object is
quarantined and its row condemned, and GC keeps every other blob of the checkpoint. When good
bytes of that digest are stored again (the next save of the same content re-uploads it, or an
operator restores the object), :func:`recheck` re-verifies the whole checkpoint and, when every
blob verifies, makes it committed again (``verify --recheck`` does the same on demand).

A checkpoint marked corrupt because its metadata is wrong (a DCP or Megatron checkpoint whose
chunks do not tile a tensor) has no damaged blob: every blob verifies, and it must stay corrupt.
Only a layer above knows those formats, so it hands :func:`recheck` the check
(``check_metadata``); without one, only the blobs are re-verified.

A blob quarantined although its bytes are good (by a reader that took "cannot decode here" for
damage) is found missing; when a copy of it under ``quarantine/`` verifies in full, a check
that may act puts it back under its key and revives its row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptstore.cas.blobs import MissingBlobError, get_blob, good_quarantined_copy, put_back
from ckptstore.cas.digest import blob_key
from ckptstore.cas.header import MAX_RAW_LEN
from ckptstore.errors import IntegrityError, UnreadableError
from ckptstore.manifest import reading as reads
from ckptstore.manifest import repairing as tx
from ckptstore.manifest.db import Database
from ckptstore.manifest.records import CheckpointInfo
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
    #: Blobs that are still missing, damaged or unreadable here: (digest, kind, detail).
    problems: tuple[tuple[str, str, str], ...] = ()
    bytes_checked: int = 0
    blobs_checked: int = 0

    @property
    def repaired(self) -> bool:
        """True if the checkpoint is no longer corrupt."""
        return self.status != "corrupt"


Verdict = tuple[str, str] | None
#: A check of a checkpoint's own metadata, given the digests it references: None if it holds,
#: else (digest, kind, detail) as for a blob, kind "metadata" when the metadata is wrong.
MetadataCheck = Callable[[CheckpointInfo, Collection[str]], tuple[str, str, str] | None]


def check_blob(
    store: ObjectStore, digest: str, max_raw_len: int, db: Database | None = None
) -> tuple[str, Verdict, int]:
    """(digest, None, raw bytes) if the blob verifies; else (digest, (kind, detail), 0) with
    kind "missing", "corrupt" (both proven) or "unreadable" (this process cannot read it; not
    proven damaged). Never raises IntegrityError. With ``db`` (a check that may act), a
    missing blob whose quarantined copy verifies is put back first."""
    verdict, size = _verify(store, digest, max_raw_len)
    if verdict is None or verdict[0] != "missing":
        return digest, verdict, size
    try:
        copy = good_quarantined_copy(store, digest, max_raw_len=max_raw_len)
    except UnreadableError as exc:
        return digest, ("missing", f"{verdict[1]}; its quarantined copy: {exc}"), 0
    if copy is None:
        return digest, verdict, 0
    if db is None:
        note = (
            f"; a copy that verifies is in quarantine ({copy[0]}): `ckptstore verify "
            "--recheck` (without --no-mark) puts it back"
        )
        return digest, ("missing", verdict[1] + note), 0
    if tx.revive_blob(db, digest, lambda: put_back(store, digest, copy)):
        log.warning(
            "RESTORED: %s was quarantined although it verifies; put back from %s",
            blob_key(digest),
            copy[0],
        )
    verdict, size = _verify(store, digest, max_raw_len)
    return digest, verdict, size


def _verify(store: ObjectStore, digest: str, max_raw_len: int) -> tuple[Verdict, int]:
    try:
        _, raw = get_blob(store, digest, max_raw_len=max_raw_len)
    except MissingBlobError as exc:
        return ("missing", str(exc)), 0
    except IntegrityError as exc:
        return ("corrupt", str(exc)), 0
    except UnreadableError as exc:
        return ("unreadable", str(exc)), 0
    return None, raw.nbytes


def recheck(
    db: Database,
    store: ObjectStore,
    checkpoint_ids: Iterable[int],
    *,
    workers: int = 8,
    restore: bool = True,
    check_metadata: MetadataCheck | None = None,
) -> list[Recheck]:
    """Re-verify every blob of the given corrupt checkpoints (putting back good quarantined
    copies), then, when they all verify, ``check_metadata``; restore those that pass (unless
    ``restore`` is False: then only report, and change nothing)."""
    results: list[Recheck] = []
    verdicts: dict[str, Verdict] = {}
    act = db if restore else None
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
            checked = pool.map(check_blob, [store] * len(todo), todo, bounds, [act] * len(todo))
            for digest, verdict, _ in checked:
                verdicts[digest] = verdict
            problems = tuple((d, v[0], v[1]) for d in sizes if (v := verdicts[d]) is not None)
            if not problems and check_metadata is not None:
                wrong = check_metadata(found, list(sizes))
                problems = () if wrong is None else (wrong,)
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
