"""A run's node-local tiers as its coordinator uses them: the stores local saves write through,
the check of a local commit's copies, keeping each tier bounded, the sweep at start, and the
stores a recovery reads through (DESIGN.md §13).

Writers on other nodes need none of this: they write through :func:`writer_store` (a
:class:`~ckptstore.tiers.stores.ReplicatingStore` for their node) and hand back receipts naming
the nodes that hold their blobs; the coordinator commits them (``Run.save(..., receipts=...)``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from ckptstore.cas.digest import blob_key, digest_from_key
from ckptstore.errors import CkptStoreError, ConfigError, ObjectStoreError
from ckptstore.manifest import tiering
from ckptstore.manifest.db import Database
from ckptstore.objectstore import LocalStore, ObjectStore
from ckptstore.objectstore.base import TMP_PREFIX
from ckptstore.tiers.config import TierConfig
from ckptstore.tiers.placement import STORE, read_order, replica_nodes
from ckptstore.tiers.stores import NearestCopies, ReplicatingStore
from ckptstore.tiers.transport import PathTransport, Transport

log = logging.getLogger("ckptstore.tiers")


def own_tier(config: TierConfig, node: str | None = None) -> LocalStore:
    """``node``'s own tier directory (this process's node by default), created if missing: a
    node writes its own tier directly, never through the transport."""
    return LocalStore(config.root(node or config.this_node()), fsync=config.fsync, create=True)


def transport_of(config: TierConfig) -> Transport:
    """The configured transport, or one that opens every tier as a directory."""
    return config.transport or PathTransport(config.local_dir, fsync=config.fsync)


def writer_store(
    config: TierConfig,
    *,
    node: str | None = None,
    transport: Transport | None = None,
    ring: Iterable[str] | None = None,
) -> ReplicatingStore:
    """What a writer on ``node`` (this process's by default) saves through: its own tier, and
    the tiers of the next R - 1 nodes of the ring (``ring``: the job's nodes that are up; by
    default all of ``config``'s). Hand it to a ``ShardWriter``: its receipts then name the
    nodes holding their blobs."""
    me = node or config.this_node()
    nodes = replica_nodes(sorted({*(ring or config.ring()), me}), me, config.replica_count())
    reach = transport or transport_of(config)
    peers = {peer: reach.tier(peer) for peer in nodes[1:]}
    return ReplicatingStore(me, own_tier(config, me), peers)


def nearest_copies(
    config: TierConfig,
    copies: Mapping[str, tuple[bool, Iterable[str]]],
    reachable: Iterable[str],
    store: ObjectStore,
    *,
    transport: Transport | None = None,
) -> NearestCopies:
    """What a rank on this process's node reads a checkpoint through, given where its blobs
    are (``Run.copies``, handed over by the coordinator) and the nodes reachable now: its own
    tier, then peers', then ``store``. The rank never opens the manifest."""
    me = config.this_node()
    reach = transport or transport_of(config)
    own = own_tier(config, me) if config.root(me).is_dir() else None

    def tier(node: str) -> ObjectStore:
        return own if node == me and own is not None else reach.tier(node)

    return _nearest(me, tier, copies, reachable, store)


def _nearest(
    me: str,
    tier: Callable[[str], ObjectStore],
    copies: Mapping[str, tuple[bool, Iterable[str]]],
    reachable: Iterable[str],
    store: ObjectStore,
) -> NearestCopies:
    live = set(reachable)
    sources = {
        blob_key(digest): read_order(me, nodes, live, in_store=in_store)
        for digest, (in_store, nodes) in copies.items()
    }
    return NearestCopies(
        sources,
        lambda node: store if node == STORE else tier(node),
        store=store,
        read_concurrency=max(store.read_concurrency, LocalStore.read_concurrency),
    )


class Tiers:
    """The coordinator's view of a run's tiers (``open_run(..., tiers=TierConfig(...))``)."""

    def __init__(self, config: TierConfig, *, create: bool = True) -> None:
        """``create``: make this node's tier directory if it is missing (a writer); else a
        missing one is simply not reachable (a reader creates nothing)."""
        self.config = config
        self.node = config.this_node()
        self.ring = config.ring()
        self.replicas = config.replica_count()
        self._owns_transport = config.transport is None
        self.transport = transport_of(config)
        #: This node's tier directory did not exist: a new disk, whatever the manifest says.
        self.new_disk = not config.root(self.node).is_dir()
        self.own: ObjectStore | None = own_tier(config) if create or not self.new_disk else None
        self._writer: ReplicatingStore | None = None

    def __repr__(self) -> str:
        return (
            f"Tiers({self.config.local_dir!r}, node={self.node!r}, ring={list(self.ring)}, "
            f"replicas={self.replicas})"
        )

    def writer(self, db: Database) -> ReplicatingStore:
        """This node's writer store, made at the first local save: its replicas go to the
        job's nodes whose tiers answer then (a lost node's are not written to; fewer nodes up
        than R is a ``ConfigError`` naming them)."""
        if self._writer is None:
            up = self.reachable(db) & set(self.ring)
            if len(up | {self.node}) < self.replicas:
                raise ConfigError(
                    f"a local save needs {self.replicas} nodes' tiers (TierConfig.replicas), "
                    f"but only {', '.join(sorted(up)) or 'none'} of {', '.join(self.ring)} "
                    "answer: lower replicas, or bring the nodes back"
                )
            self._writer = writer_store(
                self.config, node=self.node, transport=self.transport, ring=up
            )
        return self._writer

    def tier(self, node: str) -> ObjectStore:
        """``node``'s tier: this node's own directly, others' through the transport."""
        if node == self.node and self.own is not None:
            return self.own
        return self.transport.tier(node)

    def reachable(self, db: Database) -> set[str]:
        """The nodes whose tiers answer now, of the ring and of every node the manifest knows
        copies on (a job restarted elsewhere may still reach its old nodes)."""
        candidates = {*self.ring, *tiering.nodes(db)}
        found = self.transport.reachable(candidates - {self.node})
        return found | ({self.node} if self.own is not None else set())

    def check_copies(self, asked: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
        """Of each node's ``asked`` digests, those whose copy is not on its tier (a node that
        cannot be reached has none)."""
        missing: dict[str, list[str]] = {}
        for node, digests in asked.items():
            try:
                sizes = self.tier(node).sizes([blob_key(d) for d in digests])
            except ObjectStoreError:
                missing[node] = list(digests)
                continue
            gone = [d for d in digests if sizes.get(blob_key(d)) is None]
            if gone:
                missing[node] = gone
        return missing

    def nearest(
        self,
        copies: Mapping[str, tuple[bool, Iterable[str]]],
        reachable: Iterable[str],
        store: ObjectStore,
    ) -> NearestCopies:
        """A store reading each of a checkpoint's blobs (``copies``: digest -> (in the store,
        nodes with a copy)) from its nearest copy: this node, a reachable peer, the store."""
        return _nearest(self.node, self.tier, copies, reachable, store)

    def keep_bounded(self, db: Database, run_id: int, reachable: Iterable[str]) -> int:
        """After a local commit (and at a writer's start and close): local checkpoints a
        drained newer one made unnecessary are dropped, and every reachable tier drops the
        copies no checkpoint keeps there. Best effort (a failure is logged: the next save tries
        again). Returns the copies dropped.

        The rule that makes this safe: no writer saves to the tiers while it runs. A writer
        that finds a blob on its tier counts on it (content dedup) until its checkpoint
        commits; were the copy dropped meanwhile, that commit would find it gone and fail (it
        checks every copy it has no row for, so nothing wrong is ever committed). The run's
        own saves run one at a time, this at the end of each; a coordinator with workers
        starts their next save once the previous ``Run.save`` has returned its record
        (``SaveHandle.wait()``), as the reference trainer does. Jobs must not share a tier
        directory."""
        dropped = 0
        try:
            tiering.drop_superseded_locals(db, run_id, self.config.keep_last)
            for node in sorted(reachable):
                tier = self.tier(node)

                def delete(digests: Sequence[str], tier: ObjectStore = tier) -> None:
                    tier.delete([blob_key(d) for d in digests])

                dropped += tiering.evict(db, node, self.config.keep_last, delete)
        except CkptStoreError:
            log.exception("keeping the tiers bounded failed; the next save tries again")
        return dropped

    def start(self, db: Database, run_id: int) -> tuple[int, int]:
        """A writer's start on this node: a new (empty) tier disk means the node lost what
        it held, so the manifest forgets every copy it recorded there; then :meth:`sweep`, and
        the tiers drop what the run keeps no longer (:meth:`keep_bounded`: nothing saves yet)."""
        if self.new_disk:
            forgotten = tiering.forget_node(db, self.node)
            if forgotten:
                log.warning(
                    "the tier of node %r is new (%s): forgot the %d copies the manifest "
                    "recorded there",
                    self.node,
                    self.config.root(self.node),
                    forgotten,
                )
            self.new_disk = False
        swept = self.sweep(db)
        self.keep_bounded(db, run_id, self.reachable(db))
        return swept

    def sweep(self, db: Database, *, older_than: float = 0.0) -> tuple[int, int]:
        """What this node's tier holds that the manifest does not know (a crash between the
        copies and the commit, a copy evicted while its node was away), removed with
        unfinished writes if older than ``older_than`` seconds: :func:`sweep_tier`."""
        if self.own is None:
            return 0, 0
        return sweep_tier(db, self.node, self.own, older_than=older_than)

    def close(self) -> None:
        """Release the writer's threads and the transport (if this opened it)."""
        if self._writer is not None:
            self._writer.close()
        if self.own is not None:
            self.own.close()
        if self._owns_transport:
            self.transport.close()


def sweep_tier(
    db: Database, node: str, tier: ObjectStore, *, older_than: float, dry_run: bool = False
) -> tuple[int, int]:
    """Remove from ``node``'s tier every object older than ``older_than`` seconds that no copy
    row knows, and unfinished writes: (objects, bytes). A scan, for cleaning only: what is
    recoverable is never decided by one. A save in flight on that tier has no rows yet: with
    ``older_than`` 0 (a writer's own start) only this node's writer may be running."""
    cutoff = time.time() - older_than
    count, size = tier.sweep_incomplete(older_than, dry_run=dry_run)
    found: dict[str, int] = {}
    for info in tier.list("cas/"):
        if info.mtime > cutoff or TMP_PREFIX in info.key:
            continue
        digest = digest_from_key(info.key)
        if digest is not None:
            found[digest] = info.size
    if not found:
        return count, size
    unknown = sorted(set(found) - tiering.known_copies(db, node, sorted(found)))
    if not dry_run:
        tier.delete([blob_key(d) for d in unknown])
    return count + len(unknown), size + sum(found[d] for d in unknown)


def sweep_tiers(
    db: Database, config: TierConfig, *, older_than: float, dry_run: bool = False
) -> tuple[int, int, list[str]]:
    """:func:`sweep_tier` on every tier reachable now of the nodes the manifest records copies
    on (and ``config``'s): (objects, bytes, the nodes swept)."""
    transport = transport_of(config)
    try:
        nodes = sorted(transport.reachable({*tiering.nodes(db), *config.nodes}))
        count = size = 0
        for node in nodes:
            n, b = sweep_tier(
                db, node, transport.tier(node), older_than=older_than, dry_run=dry_run
            )
            count, size = count + n, size + b
        return count, size, nodes
    finally:
        if config.transport is None:
            transport.close()
