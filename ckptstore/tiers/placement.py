"""Where copies go and where a read looks first: pure functions of node names, tested without a
cluster (NVRx plans replication apart from executing it; so do we).

Replicas: a node's blobs go to itself and to the next R - 1 nodes after it on the ring of the
job's nodes in sorted order -- every node receives as many peers' copies as it sends, and losing
any R - 1 nodes leaves a copy of everything. Reads: own tier, then the holders nearest after
this node on the ring (spreading a recovery's reads over the survivors), then the object store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ckptstore.errors import ConfigError

#: The name a read plan gives the object store among the nodes.
STORE = ""


def replica_nodes(ring: Sequence[str], me: str, replicas: int) -> tuple[str, ...]:
    """The nodes ``me``'s blobs are written to: ``me``, then the next ``replicas - 1`` nodes
    after it on the sorted ``ring``."""
    nodes = sorted(set(ring))
    if me not in nodes:
        raise ConfigError(f"node {me!r} is not one of the job's nodes {nodes}")
    if not 1 <= replicas <= len(nodes):
        raise ConfigError(f"replicas={replicas} must be between 1 and {len(nodes)} (the nodes)")
    at = nodes.index(me)
    return tuple(nodes[(at + k) % len(nodes)] for k in range(replicas))


def read_order(
    me: str, holders: Iterable[str], reachable: Iterable[str], *, in_store: bool
) -> list[str]:
    """Where to read a blob from, nearest first: ``me`` if it holds a copy, then the other
    reachable holders in ring order after ``me``, then the object store (:data:`STORE`) if it
    holds the blob. Unreachable holders are left out."""
    live = set(reachable)
    held = sorted(h for h in set(holders) if h in live)
    ring = sorted({*held, me})
    at = ring.index(me)
    order = [ring[(at + k) % len(ring)] for k in range(len(ring))]
    sources = [node for node in order if node in held]
    if in_store:
        sources.append(STORE)
    return sources
