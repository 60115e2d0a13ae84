"""Re-hash what checkpoints reference and report what is missing, damaged or unreadable.

Only proven damage (a missing blob, bytes that fail their checksum or digest) marks a
checkpoint corrupt; a blob this process cannot read is reported and changes nothing. Metadata
that its loader refuses is proof too: a DCP or Megatron checkpoint whose blobs verify is then
checked as a load checks it (``ckptstore.formats``: each tensor's chunks tile it, sizes
agree with the rank components' entries), reading only its metadata and indexes; when that
fails the checkpoint is marked corrupt and no blob is quarantined (the blobs are healthy). A
checkpoint that stays marked corrupt is reported by every later pass until it is repaired
(``recheck``) or released (``ckptstore gc --release-corrupt``), so that a gate on verify's exit
code never turns green over a broken run.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptstore.cas.blobs import MissingBlobError, quarantine_blob
from ckptstore.cas.digest import blob_key
from ckptstore.cas.header import MAX_RAW_LEN
from ckptstore.checkpointer.repair import Verdict, check_blob
from ckptstore.checkpointer.repair import recheck as recheck_checkpoints
from ckptstore.checkpointer.restore import wrong_store
from ckptstore.errors import (
    CkptStoreError,
    IntegrityError,
    ObjectStoreError,
    SerializationError,
    UnreadableError,
)
from ckptstore.manifest import reading as reads
from ckptstore.manifest import repairing as tx
from ckptstore.manifest.db import Database
from ckptstore.manifest.records import CheckpointInfo
from ckptstore.objectstore import ObjectStore
from ckptstore.serialize.reader import ComponentReader

log = logging.getLogger("ckptstore.verify")
Progress = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class Problem:
    """One missing, damaged or unreadable blob of one checkpoint."""

    run: str
    step: int
    component: str
    key: str
    #: "missing" or "corrupt" (proven damage), "metadata" (a DCP or Megatron checkpoint's
    #: metadata that its loader refuses, ``key`` the object holding it: proven, though every
    #: blob is healthy), or "unreadable": this process cannot read the blob or check the
    #: metadata (an unknown codec or version, a missing codec, an index that does not parse).
    kind: str
    detail: str


@dataclass(slots=True)
class VerifyReport:
    """What one verify pass checked and found."""

    checkpoints: int = 0
    blobs_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    corrupt_checkpoints: list[tuple[str, int]] = field(default_factory=list)
    #: Corrupt checkpoints that verified again (``recheck``) and are committed again.
    repaired: list[tuple[str, int]] = field(default_factory=list)
    #: Checkpoints this pass marked corrupt.
    marked: list[tuple[str, int]] = field(default_factory=list)
    #: Checkpoints marked corrupt before this pass that still are: (run, step, why). Each
    #: is a problem until it is repaired or released.
    still_corrupt: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing found, and nothing left marked corrupt."""
        return not self.problems and not self.still_corrupt


@dataclass(slots=True)
class _Target:
    info: CheckpointInfo
    owners: dict[str, str]  # digest -> component
    sizes: dict[str, int | None]  # digest -> raw length the manifest recorded (None: no row)

    @property
    def run(self) -> str:
        return self.info.run

    @property
    def step(self) -> int:
        return self.info.step


def _targets(db: Database, run: str | None, step: int | None) -> list[_Target]:
    targets = []
    for info in reads.targets(db, run=run, step=step):
        sizes = reads.blob_sizes(db, info.id)
        owners = dict.fromkeys(sizes, "?")
        for comp in info.components:
            owners[comp.index_digest] = comp.name
        targets.append(_Target(info, owners, sizes))
    return targets


def verify(
    db: Database,
    store: ObjectStore,
    *,
    run: str | None = None,
    step: int | None = None,
    sample: int | None = None,
    mark_corrupt: bool = True,
    recheck: bool = False,
    workers: int = 8,
    progress: Progress | None = None,
    seed: int | None = None,
    planned: Progress | None = None,
) -> VerifyReport:
    """Check every blob (or ``sample`` random blobs per checkpoint) of committed checkpoints.

    Damaged checkpoints are marked corrupt and their bad blobs quarantined (so the next save
    uploads good bytes), and missing blobs with a good quarantined copy are put back, unless
    ``mark_corrupt`` is False (then nothing changes). A DCP or Megatron checkpoint whose blobs
    verify has its metadata checked too; wrong metadata marks it corrupt, quarantining nothing.
    Unreadable blobs are reported only. With ``recheck``, checkpoints marked corrupt are
    re-verified in full too, and those whose every blob verifies again (a good copy was
    re-uploaded or restored) and whose metadata passes become committed again (only if
    ``mark_corrupt``). Checkpoints left marked corrupt are listed in ``still_corrupt``.
    ``planned`` is told once how many blobs the pass will check (after any recheck), and
    ``progress`` each blob as it is checked.
    """
    report = VerifyReport()
    if recheck:
        _recheck(db, store, run, step, report, mark_corrupt, workers, progress)
    targets = _targets(db, run, step)
    if planned:
        # Each blob once (a shared one is checked for its first checkpoint), or the samples.
        planned(
            len({d for t in targets for d in t.owners})
            if sample is None
            else sum(min(sample, len(t.owners)) for t in targets)
        )
    rng = random.Random(seed)
    verdicts: dict[str, Verdict] = {}  # digest -> (kind, detail), or None if it verified
    to_mark: list[tuple[_Target, Verdict, list[str]]] = []
    act = db if mark_corrupt else None
    with ThreadPoolExecutor(workers) as pool:
        for target in targets:
            report.checkpoints += 1
            unreadable: list[tuple[str, str]] = []
            # The index tells which component owns each blob, for the report.
            for digest, component in list(target.owners.items()):
                if component == "?":
                    continue
                try:
                    referenced = ComponentReader(
                        store, digest, index_len=target.sizes.get(digest)
                    ).digests
                except (IntegrityError, UnreadableError):
                    continue  # reported below when the blob itself is checked
                except SerializationError as exc:
                    unreadable.append((digest, str(exc)))  # intact bytes, but no valid index
                    continue
                for blob in referenced:
                    target.owners[blob] = component
            todo = list(target.owners)
            if sample is not None and sample < len(todo):
                todo = rng.sample(todo, sample)
            fresh = [d for d in todo if d not in verdicts]
            bounds = [_bound(target.sizes.get(d)) for d in fresh]
            checked = pool.map(check_blob, [store] * len(fresh), fresh, bounds, [act] * len(fresh))
            for digest, verdict, size in checked:
                verdicts[digest] = verdict
                report.blobs_checked += 1
                report.bytes_checked += size
                if progress:
                    progress(1)
            bad = [(d, verdicts[d]) for d in todo if verdicts[d] is not None]
            if not bad and not unreadable:
                wrong = _check_metadata(store, target.info, target.owners)
                if wrong is not None and wrong[1] == "unreadable":
                    unreadable.append((wrong[0], wrong[2]))
                elif wrong is not None:
                    bad.append((wrong[0], (wrong[1], wrong[2])))
            found = [(d, v[0], v[1]) for d, v in bad if v is not None]
            found += [(d, "unreadable", detail) for d, detail in unreadable]
            for digest, kind, detail in found:
                key = f"{store.url}/{blob_key(digest)}"
                owner = target.owners.get(digest, "?")
                report.problems.append(Problem(target.run, target.step, owner, key, kind, detail))
            if bad or unreadable:
                report.corrupt_checkpoints.append((target.run, target.step))
            proven = [(d, v) for d, v in bad if v is not None and v[0] != "unreadable"]
            if proven and mark_corrupt:
                # Wrong metadata condemns the checkpoint, never a blob: its blobs are healthy.
                damaged = [d for d, v in proven if v is not None and v[0] != "metadata"]
                to_mark.append((target, proven[0][1], damaged))
    seen = list(verdicts.values())
    if len(seen) >= 2 and all(v is not None and v[0] == "missing" for v in seen):
        raise wrong_store(store, f"none of the {len(seen)} blobs checked exist in the store")
    for target, verdict, digests in to_mark:
        _mark_corrupt(db, store, target, verdict, digests)
        report.marked.append((target.run, target.step))
    report.still_corrupt = [
        (c.run, c.step, c.error or "")
        for c in reads.targets(db, run=run, step=step, status="corrupt")
        if (c.run, c.step) not in report.marked
    ]
    return report


def _check_metadata(
    store: ObjectStore, info: CheckpointInfo, referenced: Collection[str]
) -> tuple[str, str, str] | None:
    """The checks a load of a DCP or Megatron checkpoint makes before reading data, on its
    metadata and its components' indexes: None if they pass (or it is neither), else (digest,
    kind, detail). Kind "metadata": the metadata is wrong, the digest its component's index;
    "missing" or "corrupt": a blob the checkpoint references was found damaged on the way;
    "unreadable": this process cannot check it."""
    # The registry (below the integrations, which register their formats in it): each
    # format's checks (and torch.distributed for DCP) are imported only when used.
    from ckptstore.formats import metadata_component, validate_checkpoint

    component = metadata_component(info)
    if component is None:
        return None
    try:
        validate_checkpoint(store, info)
    except IntegrityError as exc:
        if exc.digest is not None and exc.digest in referenced:
            kind = "missing" if isinstance(exc, MissingBlobError) else "corrupt"
            return exc.digest, kind, str(exc)
        return component.index_digest, "metadata", str(exc)
    except ObjectStoreError:
        raise  # the store failed, not the checkpoint: as when a blob is checked
    except CkptStoreError as exc:  # not proof of anything: reported, never marked
        digest = exc.digest if isinstance(exc, UnreadableError) else None
        return digest or component.index_digest, "unreadable", str(exc)
    return None


def _bound(size: int | None) -> int:
    """The raw length the manifest records for a blob bounds its header; none: the format's."""
    return MAX_RAW_LEN if size is None else size


def _recheck(
    db: Database,
    store: ObjectStore,
    run: str | None,
    step: int | None,
    report: VerifyReport,
    restore: bool,
    workers: int,
    progress: Progress | None,
) -> None:
    ids = [c.id for c in reads.targets(db, run=run, step=step, status="corrupt")]
    if not ids:
        return
    results = recheck_checkpoints(
        db,
        store,
        ids,
        workers=workers,
        restore=restore,
        check_metadata=lambda info, referenced: _check_metadata(store, info, referenced),
    )
    for result in results:
        report.checkpoints += 1
        report.blobs_checked += result.blobs_checked
        report.bytes_checked += result.bytes_checked
        if progress:
            progress(result.blobs_checked)
        if result.repaired:
            report.repaired.append((result.run, result.step))
            continue
        if not result.problems:
            continue  # verified, but not restored (restore=False): nothing to report
        report.corrupt_checkpoints.append((result.run, result.step))
        for digest, kind, detail in result.problems:
            report.problems.append(
                Problem(
                    result.run, result.step, "?", f"{store.url}/{blob_key(digest)}", kind, detail
                )
            )


def _mark_corrupt(
    db: Database,
    store: ObjectStore,
    target: _Target,
    verdict: tuple[str, str] | None,
    digests: list[str],
) -> None:
    if verdict is None:
        reason = "verify failed"
    elif verdict[0] == "metadata":
        reason = f"verify: wrong metadata: {verdict[1]}"
    else:
        reason = f"verify: {verdict[0]} blob: {verdict[1]}"

    def quarantine(digest: str) -> None:
        try:
            quarantine_blob(store, digest)
        except CkptStoreError:
            log.exception("could not quarantine %s", blob_key(digest))

    # Condemn and quarantine with commits held off, so no commit can trust the damaged object
    # between the two (a later one finds the row condemned and the object gone).
    tx.mark_corrupt(db, target.info.id, reason, digests, quarantine)
    log.error("run %r step %d is corrupt: %s", target.run, target.step, reason)
