"""How a process reaches the nodes' tiers: each as an :class:`ObjectStore`.

A transport answers two questions: which of the job's nodes have a tier that answers now
(:meth:`Transport.reachable`), and a store for one node's tier (:meth:`Transport.tier`) that
writes, reads, sizes and deletes its objects. Copies, placement and verification are the
caller's: a transport only carries bytes.

- :class:`PathTransport`: every tier is a directory this process can open -- the nodes of one
  machine (tests, several jobs on one host), or tiers mounted from the peers.
- ``ckptstore.tiers.ray.RayTransport``: a small actor on every node owns its tier; peers reach it
  through Ray (the reference trainer's way across machines).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from ckptstore.errors import ConfigError, StoreNotFoundError
from ckptstore.names import printable
from ckptstore.objectstore import LocalStore, ObjectStore
from ckptstore.tiers.nodes import check_local_dir, tier_root


@runtime_checkable
class Transport(Protocol):
    """Reaches the tiers of a job's nodes. Must be safe to use from many threads."""

    def reachable(self, nodes: Iterable[str]) -> set[str]:
        """Those of ``nodes`` whose tier answers now (a lost node's does not)."""
        ...

    def tier(self, node: str) -> ObjectStore:
        """``node``'s tier; ``StoreNotFoundError`` naming the node if it cannot be reached."""
        ...

    def close(self) -> None:
        """Release what the transport holds (open tiers, connections)."""
        ...


class PathTransport:
    """Every node's tier is the directory ``local_dir`` names for it, openable here."""

    def __init__(self, local_dir: str, *, fsync: bool = True) -> None:
        self.local_dir = check_local_dir(local_dir)
        self.fsync = fsync
        self._tiers: dict[str, LocalStore] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"PathTransport({self.local_dir!r})"

    def reachable(self, nodes: Iterable[str]) -> set[str]:
        """The nodes whose tier directory exists (a lost node's was taken with it)."""
        return {node for node in nodes if tier_root(self.local_dir, node).is_dir()}

    def tier(self, node: str) -> ObjectStore:
        """``node``'s tier directory as a store; it must exist (its node made it)."""
        with self._lock:
            store = self._tiers.get(node)
            if store is not None and store.root.is_dir():
                return store
            root = tier_root(self.local_dir, node)
            try:
                store = LocalStore(root, fsync=self.fsync, create=False)
            except ConfigError as exc:
                raise StoreNotFoundError(
                    f"the tier of node {node!r} ({printable(str(root))}) cannot be reached: "
                    f"{exc}. Is the node up, and local_dir={self.local_dir!r} right for it?"
                ) from exc
            self._tiers[node] = store
            return store

    def close(self) -> None:
        """Close every tier opened."""
        with self._lock:
            for store in self._tiers.values():
                store.close()
            self._tiers.clear()
