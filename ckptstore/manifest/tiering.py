"""The manifest's side of node-local tiers (DESIGN.md §13): local commits, drains, what is
recoverable from the reachable nodes, forgetting bad copies, and what a tier may drop.

The call protocol of a local save: :func:`~ckptstore.manifest.committing.begin_checkpoint` ->
every writer stores its shards on its node's tier and its replica peers' and returns a receipt
naming those nodes (no database access) -> the coordinator's :func:`commit_local` over every
receipt (status ``local``, blob rows not ``in_store``, one copy row per node) -> later
:func:`drain_work` + uploads + :func:`mark_drained` (status ``committed``). A resume asks
:func:`newest_recoverable` with the nodes it can reach now, and :func:`copies` where each blob
is; bad copies it met go back through :func:`forget`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ckptstore.errors import CheckpointNotFoundError, SaveError
from ckptstore.manifest._orm import blobs, checkpoints, copies, runs
from ckptstore.manifest._sql import lookups
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import CheckpointRow
from ckptstore.manifest.records import BlobClaim, CheckpointInfo, ComponentInfo
from ckptstore.manifest.statuses import Status

#: {node: digests whose copy there has no row yet} -> {node: those of them that are missing}.
CheckCopies = Callable[[Mapping[str, Sequence[str]]], Mapping[str, Sequence[str]]]
#: digests -> {digest: object size or None if absent}: a drain's check of the store.
CheckObjects = Callable[[Sequence[str]], Mapping[str, int | None]]


def commit_local(
    db: Database,
    *,
    run_id: int,
    epoch: int,
    checkpoint_id: int,
    step: int,
    claims: Mapping[str, BlobClaim],
    components: Sequence[ComponentInfo],
    values: Callable[[int], dict[str, Any]],
    holders: Mapping[str, Collection[str]],
    replicas: int,
    check_copies: CheckCopies,
) -> None:
    """The local commit: like a store commit (epoch check, blob rows, references, components,
    the step superseded), but what it checks is that every blob has copies on ``replicas``
    distinct nodes (``holders[digest]``), and every copy without a row yet is asked for on its
    node (``check_copies``) while commits and tier evictions are held off (the GC lock). New
    blob rows are not ``in_store``; the checkpoint becomes ``local``."""
    short = {
        d: sorted(holders.get(d, ())) for d in claims if len(set(holders.get(d, ()))) < replicas
    }
    if short:
        digest, nodes = next(iter(short.items()))
        raise SaveError(
            f"{len(short)} blob(s) of step {step} have fewer than {replicas} tier copies, e.g. "
            f"{digest} on {nodes or 'no node'}; nothing was committed"
        )

    def transaction(session: Session) -> None:
        runs.lock_run(session, run_id, epoch)
        runs.hold_gc_lock_shared(session)
        existing = blobs.blob_rows(session, list(claims), lock=False)
        have = copies.copy_nodes(session, list(claims))
        ask: dict[str, list[str]] = {}
        for digest in claims:
            for node in sorted(set(holders[digest]) - have.get(digest, set())):
                ask.setdefault(node, []).append(digest)
        missing = {node: list(ds) for node, ds in check_copies(ask).items() if ds}
        if missing:
            node, digests = next(iter(missing.items()))
            raise SaveError(
                f"{sum(map(len, missing.values()))} tier copies of step {step} are gone, e.g. "
                f"{digests[0]} on node {node!r} (evicted while the save ran?); nothing was "
                "committed and the next save writes them again"
            )
        checkpoints.record_commit(
            session, checkpoint_id, claims, existing, components, values, status=Status.LOCAL
        )
        copies.insert_copies(
            session, ((digest, node) for digest in claims for node in holders[digest])
        )

    db.write(transaction, what=f"committing local checkpoint at step {step}")


def newest_recoverable(
    db: Database,
    run: tuple[int, str],
    reachable: Collection[str],
    *,
    before_step: int | None = None,
) -> CheckpointInfo | None:
    """The run's newest checkpoint, local or committed (below ``before_step``), whose every blob
    the store or one of the ``reachable`` nodes' tiers holds, with its components; or None."""
    run_id, name = run
    with db.read() as session:
        found = copies.newest_recoverable_id(session, run_id, reachable, before_step=before_step)
        if found is None:
            return None
        infos = lookups.fetch_with_components(session, lookups.select_checkpoint_by_id(found), name)
    return infos[0] if infos else None


def recoverable_at(
    db: Database, run: tuple[int, str], step: int, reachable: Collection[str]
) -> CheckpointInfo:
    """The checkpoint at ``step`` if it is recoverable from the store and the ``reachable``
    nodes' tiers (local or committed); else an error that says why not."""
    run_id, name = run
    with db.read() as session:
        found = copies.newest_recoverable_id(session, run_id, reachable, step=step)
        if found is not None:
            infos = lookups.fetch_with_components(
                session, lookups.select_checkpoint_by_id(found), name
            )
            if infos:
                return infos[0]
        local = session.scalar(
            select(CheckpointRow.id).where(
                CheckpointRow.run_id == run_id,
                CheckpointRow.step == step,
                CheckpointRow.status == Status.LOCAL,
            )
        )
        if local is not None:
            raise CheckpointNotFoundError(
                f"the checkpoint at step {step} of run {name!r} is local-durable, but some of "
                "its blobs are only on tiers of nodes that cannot be reached now "
                f"(reachable: {', '.join(sorted(reachable))}); load another step"
            )
        lookups.fetch_committed_at_step(session, run_id, step)  # raises, saying why
    raise CheckpointNotFoundError(f"no checkpoint at step {step} of run {name!r}")


def copies_of(db: Database, checkpoint_id: int) -> dict[str, tuple[bool, set[str]]]:
    """Every blob of a checkpoint -> (the store holds it, the nodes with a verified copy)."""
    with db.read() as session:
        return copies.checkpoint_copies(session, checkpoint_id)


def forget(db: Database, bad: Iterable[tuple[str, str]]) -> None:
    """Forget copies a read found damaged or gone: (digest, node) pairs."""
    by_node: dict[str, list[str]] = {}
    for digest, node in bad:
        by_node.setdefault(node, []).append(digest)
    if not by_node:
        return

    def transaction(session: Session) -> None:
        for node, digests in by_node.items():
            copies.delete_copies(session, node, sorted(set(digests)))

    db.write(transaction, what="forgetting bad tier copies")


def forget_node(db: Database, node: str) -> int:
    """Forget every copy recorded on ``node`` (its tier is gone); how many."""
    return db.write(lambda s: copies.delete_node(s, node), what=f"forgetting node {node!r}")


def drain_work(db: Database, checkpoint_id: int) -> dict[str, tuple[int, set[str]]]:
    """The blobs of a local checkpoint the store may not hold -> (stored bytes, the nodes with
    a copy): what its drain uploads."""
    with db.read() as session:
        return copies.not_in_store(session, checkpoint_id)


def mark_drained(db: Database, checkpoint_id: int, check_objects: CheckObjects) -> bool:
    """The drain's commit: with commits and sweeps held off, every blob of the checkpoint that
    was not known to be in the store is looked for there (``check_objects``); all found, they
    become ``in_store`` and the checkpoint ``committed`` (an older committed checkpoint of its
    step is superseded). ``SaveError`` if one is missing (nothing changes). False if the
    checkpoint is no longer local (drained already, or deleted)."""

    def transaction(session: Session) -> bool:
        runs.hold_gc_lock_shared(session)
        status = checkpoints.status_of(session, checkpoint_id)
        if status != Status.LOCAL:
            return False
        pending = sorted(copies.not_in_store(session, checkpoint_id))
        sizes = check_objects(pending)
        missing = [d for d in pending if sizes.get(d) is None]
        if missing:
            raise SaveError(
                f"{len(missing)} blob(s) of the checkpoint are not in the store, e.g. "
                f"{missing[0]}; it stays local-durable (drain it again)"
            )
        copies.mark_in_store(session, pending)
        checkpoints.set_status(session, checkpoint_id, Status.COMMITTED, None, only_if=Status.LOCAL)
        checkpoints.supersede_step(session, checkpoint_id)
        return True

    return db.write(transaction, what="marking a drained checkpoint remote-durable")


def drop_superseded_locals(db: Database, run_id: int, keep_last: int) -> list[int]:
    """The run's local checkpoints that a drained newer one made unnecessary (older than its
    newest committed checkpoint, outside its ``keep_last`` newest) become deleted."""
    return db.write(
        lambda s: copies.supersede_locals(s, run_id, keep_last),
        what="dropping superseded local checkpoints",
    )


def evict(
    db: Database,
    node: str,
    keep_last: int,
    delete_files: Callable[[Sequence[str]], None],
    *,
    batch: int = 5000,
) -> int:
    """Drop ``node``'s copies that no checkpoint keeps on the tiers (a local checkpoint, a
    pending save, a run's ``keep_last`` newest): rows and files together, batch by batch, with
    commits held off (the GC lock) so that no commit finds a copy that is going. Returns how
    many went."""
    total = 0
    while True:

        def transaction(session: Session) -> int:
            runs.hold_gc_lock_exclusive(session)
            doomed = copies.evictable_copies(session, node, keep_last, limit=batch)
            if doomed:
                copies.delete_copies(session, node, doomed)
                delete_files(doomed)
            return len(doomed)

        gone = db.write(transaction, what=f"evicting copies from the tier of node {node!r}")
        total += gone
        if gone < batch:
            return total


def known_copies(db: Database, node: str, digests: Sequence[str]) -> set[str]:
    """Those of ``digests`` whose copy on ``node`` the manifest knows."""
    with db.read() as session:
        return copies.copies_on_node(session, node, list(digests))


def nodes(db: Database) -> list[str]:
    """Every node the manifest records a copy on."""
    with db.read() as session:
        return copies.nodes_with_copies(session)
