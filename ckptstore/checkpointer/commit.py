"""The save protocol, from receipts to one committed row (DESIGN.md §7).

A save is this sequence of calls; every participant sees only its own part:

1. (the saving process) ``Run.save`` validates names, steps and kinds, takes the snapshot (the
   only part that blocks training) and hands a :class:`SaveRequest` to the writer's queue.
2. (background) :func:`run_save` inserts the ``pending`` row with the writer's epoch.
3. (background, and in any worker holding shards) each component is chunked, hashed, deduplicated
   (against the live blobs of the run's newest committed checkpoint, fetched in one query per
   save; other blobs are probed in the store; with ``reuse_unchanged_digests``, a tensor whose
   version counter did not move keeps its remembered digests unhashed once the whole save's
   candidates passed the guard of serialize/unchanged.py), compressed and uploaded; each
   yields a small ``ShardReceipt`` (component, index digest, the blobs it references, byte
   counts), after one batched ``store.flush()`` makes its objects durable. Workers never need
   database access; they hand their receipts to the process that commits.
4. (background) :func:`commit`: the receipts become blob claims and component rows, and one
   transaction checks the writer epoch (``FencedError`` for a stale writer), checks in the store
   every blob that is not a live row while holding the GC lock, records blobs, references and
   components, flips the row to ``committed`` and supersedes an older save of the same step.
5. (background) retention marks checkpoints ``deleted``; if the commit brought back blobs that
   were condemned as damaged, the corrupt checkpoints that need them are re-verified
   (checkpointer/repair.py).

Any failure before the commit marks the row ``failed``; a commit whose answer was lost is
trusted by its row, not by the error. Nothing uncommitted is ever visible to resume.

A local save (a run with node-local tiers, :mod:`ckptstore.checkpointer.tiered`) is the same
sequence with the tiers in the store's place: step 3 writes through a replicating store (this
node's tier and its replica peers', fsynced at the flush) and every receipt names the nodes
that hold its blobs; step 4 is :func:`ckptstore.manifest.tiering.commit_local` (every blob on R
nodes, copies without a row asked for on their nodes, the row becomes ``local``); step 5 also
drops the copies no checkpoint keeps from the tiers (:class:`LocalCommit.after`). A drain makes
it ``committed`` later (:mod:`ckptstore.checkpointer.drain`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptstore.cas.blobs import BlobRef, keep_ref
from ckptstore.cas.digest import blob_key
from ckptstore.cas.writer import BlobWriter
from ckptstore.checkpointer.repair import recheck
from ckptstore.checkpointer.retention import Candidate, RetentionPolicy, to_delete
from ckptstore.checkpointer.shards import ShardReceipt
from ckptstore.errors import FencedError, SaveError
from ckptstore.manifest import committing as tx
from ckptstore.manifest import reading as reads
from ckptstore.manifest import tiering
from ckptstore.manifest.db import Database
from ckptstore.manifest.records import BlobClaim, CheckpointInfo, ComponentInfo
from ckptstore.objectstore import ObjectStore
from ckptstore.serialize.save import reusable, write_flat

log = logging.getLogger("ckptstore.checkpointer")


@dataclass(slots=True)
class SaveRequest:
    """One save, as the snapshot left it for the background job."""

    step: int
    flats: dict[str, Any]
    receipts: list[ShardReceipt]
    training_info: dict[str, Any] | None
    metrics: dict[str, Any] | None
    trigger: str
    #: Wall-clock time (``time.time()``) the save began: the earliest of the ``Run.save`` call,
    #: the caller's ``started_at`` and every receipt's (``save_seconds`` counts from here).
    started_at: float
    #: The longest any participant was blocked for this save (see ``Run.save``).
    blocked: float = 0.0
    #: A synchronous save's caller waits for the commit too: the ``perf_counter()`` instant its
    #: blocking began (its own call, less the blocked time it brought), so the row's
    #: ``blocked_seconds`` counts the uploads and the commit it waits for. None when async.
    blocking_since: float | None = None
    kinds: dict[str, str] = field(default_factory=dict)
    #: Components whose content must differ from the previous committed checkpoint's.
    expect_changed: tuple[str, ...] = ()


def blocked_now(request: SaveRequest) -> float:
    """The save's blocked seconds as of now: a synchronous caller is still waiting."""
    if request.blocking_since is None:
        return request.blocked
    return max(request.blocked, time.perf_counter() - request.blocking_since)


@dataclass(frozen=True, slots=True)
class Writer:
    """Everything a save job of one run's writer needs."""

    db: Database
    store: ObjectStore
    blobs: BlobWriter
    run_id: int
    name: str
    epoch: int
    retention: RetentionPolicy
    #: Fetches the manifest's live blobs this save will likely reuse (one query per save).
    refresh_live: Callable[[], None] = lambda: None
    #: Set for a local save: ``store`` and ``blobs`` write to the tiers, and the commit makes
    #: the checkpoint local-durable.
    local: LocalCommit | None = None


@dataclass(frozen=True, slots=True)
class LocalCommit:
    """What a local commit needs besides a store commit's (see ``checkpointer/tiered.py``)."""

    #: R: every blob must be on this many distinct nodes' tiers.
    replicas: int
    #: Which copies named by receipts, and not yet known to the manifest, are not there.
    check_copies: tiering.CheckCopies
    #: The nodes this process's own components were written to (its writer store's).
    nodes: tuple[str, ...]
    #: After the commit: keep the tiers bounded (best effort; what it returns is unused).
    after: Callable[[], object] = lambda: None


def run_save(writer: Writer, request: SaveRequest) -> CheckpointInfo:
    """Steps 2-5 of the protocol for one request (runs on the writer's background thread)."""
    checkpoint_id = tx.begin_checkpoint(
        writer.db, writer.run_id, request.step, writer.epoch, request.trigger
    )
    try:
        if request.flats:  # a save of receipts alone writes no blob: nothing to reuse
            writer.refresh_live()
        writer.blobs.forget()
        flats = list(request.flats.items())
        reuse = reusable(writer.blobs, [flat for _, flat in flats])
        nodes = writer.local.nodes if writer.local is not None else ()
        receipts = [
            ShardReceipt(
                name,
                write_flat(writer.blobs, flat, reused),
                request.kinds.get(name, "state"),
                nodes=nodes,
            )
            for (name, flat), reused in zip(flats, reuse, strict=True)
        ]
        request.flats.clear()  # the snapshot's views are no longer needed
        # Durability before the commit (step 3): one batched flush of what this save wrote.
        # Workers' receipts arrive already flushed (ShardWriter flushes before handing them).
        writer.store.flush()
        receipts.extend(request.receipts)
        info, revived = commit(writer, checkpoint_id, request, receipts)
    except Exception as exc:
        # The answer to a COMMIT that took effect can be lost with the connection: trust the
        # row, not the error, so the writer and resume always agree.
        done = committed_despite(writer, checkpoint_id, exc)
        if done is None:
            mark_failed(writer.db, checkpoint_id, exc)
            raise
        info, revived = done, []
    except BaseException as exc:
        mark_failed(writer.db, checkpoint_id, exc)
        raise
    apply_retention(writer)
    if revived:
        repair(writer, revived)
    if writer.local is not None:
        writer.local.after()
    return info


def claims_of(receipts: Sequence[ShardReceipt]) -> dict[str, BlobClaim]:
    """One claim per distinct blob; a blob both reused and uploaded counts as uploaded."""
    refs: dict[str, BlobRef] = {}
    for receipt in receipts:
        for ref in receipt.result.blobs:
            keep_ref(refs, ref)
    return {
        digest: BlobClaim(
            digest,
            ref.kind.name.lower(),
            ref.logical_bytes,
            ref.stored_bytes,
            ref.codec,
            ref.uploaded,
        )
        for digest, ref in refs.items()
    }


def commit(
    writer: Writer, checkpoint_id: int, request: SaveRequest, receipts: list[ShardReceipt]
) -> tuple[CheckpointInfo, list[str]]:
    """Step 4: the commit transaction. Returns the record and the digests it revived."""
    claims = claims_of(receipts)
    components = [
        ComponentInfo(
            r.component,
            r.kind,
            r.result.index_digest,
            r.result.logical_bytes,
            r.result.stored_bytes,
            r.result.entries,
        )
        for r in receipts
    ]
    logical = sum(r.result.logical_bytes for r in receipts)
    uploaded = sum(c.stored_bytes for c in claims.values() if c.uploaded)
    training_info = flag_stale(request.training_info, stale_components(writer, request, receipts))

    def values(stored: int) -> dict[str, Any]:
        return {
            "training_info": training_info,
            "metrics": request.metrics,
            "logical_bytes": logical,
            "stored_bytes": stored,
            "uploaded_bytes": uploaded,
            # Wall clock: receipts' instants come from other processes (workers).
            "save_seconds": max(0.0, time.time() - request.started_at),
            "blocked_seconds": blocked_now(request),
        }

    rows: dict[str, Any] = {
        "run_id": writer.run_id,
        "epoch": writer.epoch,
        "checkpoint_id": checkpoint_id,
        "step": request.step,
        "claims": claims,
        "components": components,
        "values": values,
    }
    revived: list[str] = []
    if writer.local is not None:
        tiering.commit_local(
            writer.db,
            **rows,
            holders=holders_of(receipts),
            replicas=writer.local.replicas,
            check_copies=writer.local.check_copies,
        )
    else:
        revived = tx.commit_checkpoint(
            writer.db,
            **rows,
            check_objects=lambda digests: check_objects(writer.store, digests),
        )
    info = reads.committed(writer.db, checkpoint_id, components)
    assert info is not None
    return info, revived


def holders_of(receipts: Sequence[ShardReceipt]) -> dict[str, set[str]]:
    """Each blob the receipts name -> the nodes whose tiers hold it (a blob two receipts share
    is on the nodes of both). A receipt written to the object store has no place in a local
    save: ``SaveError`` naming it."""
    holders: dict[str, set[str]] = {}
    for receipt in receipts:
        if not receipt.nodes:
            raise SaveError(
                f"component {receipt.component!r} was stored in the object store, not on the "
                "tiers: a local save takes receipts of writers that save through the tiers "
                "(ShardWriter(writer_store(tier_config))), or save it with durability='remote'"
            )
        for ref in receipt.result.blobs:
            holders.setdefault(ref.digest, set()).update(receipt.nodes)
    return holders


def stale_components(
    writer: Writer, request: SaveRequest, receipts: Sequence[ShardReceipt]
) -> list[str]:
    """The ``expect_changed`` components whose content equals the previous committed
    checkpoint's (same index digest): a writer that saved stale state. Each is logged loudly."""
    if not request.expect_changed:
        return []
    previous = reads.newest_committed(
        writer.db, (writer.run_id, writer.name), before_step=request.step
    )
    if previous is None:
        return []
    before = {c.name: c.index_digest for c in previous.components}
    digests = {r.component: r.result.index_digest for r in receipts}
    stale = [n for n in request.expect_changed if before.get(n) == digests[n]]
    for name in stale:
        log.warning(
            "STALE CHECKPOINT: run %r step %d: component %r is identical to the one saved at "
            "step %d although it was expected to change; the saving process may hold stale "
            "state (recorded as training_info['stale_components'])",
            writer.name,
            request.step,
            name,
            previous.step,
        )
    return stale


def flag_stale(training_info: dict[str, Any] | None, stale: list[str]) -> dict[str, Any] | None:
    """``training_info`` with ``stale_components`` added when any component is stale."""
    if not stale:
        return training_info
    return {**(training_info or {}), "stale_components": stale}


def check_objects(store: ObjectStore, digests: Sequence[str]) -> Mapping[str, int | None]:
    """Inside the commit: every blob that is not a live row must exist in the store — also blobs
    this save uploaded, since a save slower than the GC grace period could see them swept as
    orphans before their rows exist. Returns the objects' sizes; raises SaveError if any is
    missing."""
    if not digests:
        return {}
    keys = {d: blob_key(d) for d in digests}
    found = store.sizes(list(keys.values()))
    sizes = {d: found[key] for d, key in keys.items()}
    missing = [d for d, size in sizes.items() if size is None]
    if missing:
        raise SaveError(
            f"{len(missing)} blob(s) this checkpoint references are missing from "
            f"{store.url}, e.g. {blob_key(missing[0])} (garbage-collected while the "
            "save ran?); nothing was committed and the next save uploads them again"
        )
    return sizes


def committed_despite(writer: Writer, checkpoint_id: int, exc: Exception) -> CheckpointInfo | None:
    """The record if the row is committed although the commit reported ``exc``, else None."""
    try:
        info = reads.checkpoint(writer.db, checkpoint_id)
    except Exception:  # the database is still unreachable: report the original error
        return None
    if info is None or info.status != "committed":
        return None
    log.warning(
        "checkpoint at step %d of run %r committed although the commit reported %r",
        info.step,
        writer.name,
        exc,
    )
    return info


def mark_failed(db: Database, checkpoint_id: int, exc: BaseException) -> None:
    """Best effort: the row stays pending (which resume never sees) if this fails too."""
    try:
        tx.mark_failed(db, checkpoint_id, f"{type(exc).__name__}: {exc}")
    except Exception:
        log.exception("could not mark checkpoint %d as failed", checkpoint_id)


def apply_retention(writer: Writer) -> None:
    """Step 5: retention; a failure is logged and retried at the next save."""
    policy = writer.retention
    if policy.keep_top_k is None:
        return

    def choose(rows: list[CheckpointInfo]) -> set[int]:
        return to_delete((Candidate(r.id, r.step, r.metrics, r.trigger) for r in rows), policy)

    try:
        doomed = tx.apply_retention(writer.db, writer.run_id, writer.epoch, choose)
    except FencedError:
        log.warning("run %r has a newer writer; this stale writer skips retention", writer.name)
        return
    except Exception:  # the checkpoint is committed; retention runs again next time
        log.exception("retention failed for run %r; it will be retried", writer.name)
        return
    if doomed:
        log.info("retention marked %d checkpoint(s) of %r deleted", len(doomed), writer.name)


def release(writer: Writer, step: int) -> bool:
    """Mark the committed checkpoint at ``step`` deleted: retention with the owner's choice
    (under the run lock, with the epoch check). False if none was committed at ``step``."""
    doomed = tx.apply_retention(
        writer.db, writer.run_id, writer.epoch, lambda rows: {r.id for r in rows if r.step == step}
    )
    if doomed:
        log.info("released the checkpoint of %r at step %d", writer.name, step)
    return bool(doomed)


def repair(writer: Writer, revived: list[str]) -> None:
    """This save stored good bytes for blobs that were condemned: corrupt checkpoints that
    reference them may verify again (checkpointer/repair.py)."""
    try:
        ids = reads.corrupt_referencing(writer.db, revived)
        if ids:
            recheck(writer.db, writer.store, ids)
    except Exception:  # the save itself is committed; `verify --recheck` can repeat this
        log.exception("re-checking corrupt checkpoints of run %r failed", writer.name)
