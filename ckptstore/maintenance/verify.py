"""Re-hash what checkpoints reference and report what is missing or damaged."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from ckptstore.cas.blobs import MissingBlobError, get_blob, quarantine_blob
from ckptstore.cas.digest import blob_key
from ckptstore.cas.header import MAX_RAW_LEN
from ckptstore.errors import (
    CkptStoreError,
    IntegrityError,
    SerializationError,
    StoreNotFoundError,
)
from ckptstore.manifest import queries as q
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import Blob, Checkpoint, CheckpointBlob, Run, Status
from ckptstore.objectstore import ObjectStore
from ckptstore.serialize.load import read_index

log = logging.getLogger("ckptstore.verify")
Progress = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class Problem:
    run: str
    step: int
    component: str
    key: str
    kind: str  # "missing", "corrupt" or "unreadable" (an index that does not parse)
    detail: str


@dataclass(slots=True)
class VerifyReport:
    checkpoints: int = 0
    blobs_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    corrupt_checkpoints: list[tuple[str, int]] = field(default_factory=list)


@dataclass(slots=True)
class _Target:
    id: int
    run: str
    step: int
    owners: dict[str, str]  # digest -> component
    sizes: dict[str, int]  # digest -> raw length the manifest recorded


def _targets(db: Database, run: str | None, step: int | None) -> list[_Target]:
    with db.read() as session:
        query = (
            select(Checkpoint.id, Run.name, Checkpoint.step)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Checkpoint.status == Status.COMMITTED)
        )
        if run is not None:
            query = query.where(Run.name == run)
        if step is not None:
            query = query.where(Checkpoint.step == step)
        rows = list(session.execute(query.order_by(Run.name, Checkpoint.step)))
        targets = []
        for cid, name, cstep in rows:
            sizes = _digests(session, cid)
            owners = dict.fromkeys(sizes, "?")
            for comp in q.components_of(session, cid):
                owners[comp.index_digest] = comp.name
            targets.append(_Target(cid, name, cstep, owners, sizes))
        return targets


def _digests(session: Session, checkpoint_id: int) -> dict[str, int]:
    """The checkpoint's blobs and the raw length the manifest recorded for each."""
    rows = session.execute(
        select(CheckpointBlob.digest, Blob.logical_bytes)
        .outerjoin(Blob, Blob.digest == CheckpointBlob.digest)
        .where(CheckpointBlob.checkpoint_id == checkpoint_id)
    )
    return {digest: size if size is not None else MAX_RAW_LEN for digest, size in rows}


def verify(
    db: Database,
    store: ObjectStore,
    *,
    run: str | None = None,
    step: int | None = None,
    sample: int | None = None,
    mark_corrupt: bool = True,
    workers: int = 8,
    progress: Progress | None = None,
    seed: int | None = None,
) -> VerifyReport:
    """Check every blob (or ``sample`` random blobs per checkpoint) of committed checkpoints.

    Damaged checkpoints are marked corrupt and their bad blobs quarantined (so the next save
    uploads good bytes), unless ``mark_corrupt`` is False.
    """
    report = VerifyReport()
    targets = _targets(db, run, step)
    rng = random.Random(seed)
    verdicts: dict[str, tuple[str, str] | None] = {}  # digest -> (kind, detail) or None if ok
    to_mark: list[tuple[_Target, tuple[str, str] | None, list[str]]] = []
    with ThreadPoolExecutor(workers) as pool:
        for target in targets:
            report.checkpoints += 1
            unreadable: list[tuple[str, str]] = []
            # The index tells which component owns each blob, for the report.
            for digest, component in list(target.owners.items()):
                if component == "?":
                    continue
                try:
                    index = read_index(store, digest, index_len=target.sizes.get(digest))
                except IntegrityError:
                    continue  # reported below when the blob itself is checked
                except SerializationError as exc:
                    unreadable.append((digest, str(exc)))  # intact bytes, but no valid index
                    continue
                for blob in index.digests:
                    target.owners[blob] = component
            todo = list(target.owners)
            if sample is not None and sample < len(todo):
                todo = rng.sample(todo, sample)
            fresh = [d for d in todo if d not in verdicts]
            bounds = [target.sizes.get(d, MAX_RAW_LEN) for d in fresh]
            checked = pool.map(_check, [store] * len(fresh), fresh, bounds)
            for digest, verdict, size in checked:
                verdicts[digest] = verdict
                report.blobs_checked += 1
                report.bytes_checked += size
                if progress:
                    progress(1)
            bad = [(d, verdicts[d]) for d in todo if verdicts[d] is not None]
            found = [(d, v[0], v[1]) for d, v in bad if v is not None]
            found += [(d, "unreadable", detail) for d, detail in unreadable]
            for digest, kind, detail in found:
                key = f"{store.url}/{blob_key(digest)}"
                owner = target.owners[digest]
                report.problems.append(Problem(target.run, target.step, owner, key, kind, detail))
            if bad or unreadable:
                report.corrupt_checkpoints.append((target.run, target.step))
            if bad and mark_corrupt:
                to_mark.append((target, bad[0][1], [d for d, _ in bad]))
    seen = list(verdicts.values())
    if len(seen) >= 2 and all(v is not None and v[0] == "missing" for v in seen):
        raise StoreNotFoundError(
            f"none of the {len(seen)} blobs checked exist in {store.url}: is the store URL "
            "right (--store, CKPTSTORE_STORE, the bucket and prefix)? Nothing was marked corrupt."
        )
    for target, verdict, digests in to_mark:
        _mark(db, store, target, verdict, digests)
    return report


def _check(
    store: ObjectStore, digest: str, max_raw_len: int
) -> tuple[str, tuple[str, str] | None, int]:
    try:
        _, raw = get_blob(store, digest, max_raw_len=max_raw_len)
    except MissingBlobError as exc:
        return digest, ("missing", str(exc)), 0
    except IntegrityError as exc:
        return digest, ("corrupt", str(exc)), 0
    return digest, None, raw.nbytes


def _mark(
    db: Database,
    store: ObjectStore,
    target: _Target,
    verdict: tuple[str, str] | None,
    digests: list[str],
) -> None:
    reason = f"verify: {verdict[0]} blob: {verdict[1]}" if verdict else "verify failed"

    def transaction(session: Session) -> None:
        # Condemn and quarantine with commits held off, so no commit can trust the damaged
        # object between the two (a later one finds the row condemned and the object gone).
        q.hold_gc_lock_exclusive(session)
        q.mark(session, target.id, Status.CORRUPT, reason)
        for digest in digests:
            q.condemn_blob(session, digest)
        for digest in digests:
            try:
                quarantine_blob(store, digest)
            except CkptStoreError:
                log.exception("could not quarantine %s", blob_key(digest))

    db.write(transaction, what="marking a corrupt checkpoint")
    log.error("run %r step %d is corrupt: %s", target.run, target.step, reason)
