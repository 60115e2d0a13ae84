"""What a run's node-local tiers are: where each node keeps its copies, how many nodes hold each
blob, how many checkpoints a tier keeps (DESIGN.md §13).

A tier is a directory on one node (a RAM disk such as ``/dev/shm``, or an NVMe), laid out as a
local object store is (``cas/<hex[:2]>/<hex>``, the same self-describing objects): any copy
verifies against its digest wherever it is read from. ``local_dir`` may contain ``{node}``,
replaced by the node's name, so that nodes simulated on one machine get separate directories
standing for separate disks; on a real cluster the same path on every machine is the usual
choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckptstore.errors import ConfigError
from ckptstore.tiers.nodes import check_local_dir, check_node_name, node_name, tier_root
from ckptstore.tiers.transport import Transport


@dataclass(frozen=True, kw_only=True, slots=True)
class TierConfig:
    """A run's node-local tiers (``open_run(..., tiers=TierConfig(...))``)."""

    #: Each node's tier directory; may contain ``{node}`` (the node's name).
    local_dir: str
    #: On how many distinct nodes' tiers every blob of a local checkpoint must be fsynced before
    #: it is committed local-durable (R). 0: 2 where the job has two nodes or more, else 1.
    replicas: int = 0
    #: How many of a run's newest checkpoints each tier keeps copies of, besides every local
    #: checkpoint not yet drained to the store.
    keep_last: int = 2
    #: This process's node; None: :func:`node_name` (``$CKPTSTORE_NODE`` or the host name).
    node: str | None = None
    #: Every node of the job, the ring replicas are placed on; empty: this node alone.
    nodes: tuple[str, ...] = ()
    #: How this process reaches the nodes' tiers; None: every tier is a directory it can open
    #: (:class:`~ckptstore.tiers.transport.PathTransport` over ``local_dir``).
    transport: Transport | None = field(default=None, compare=False)
    #: fsync every object and directory entry before a local commit (False: tests only).
    fsync: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_dir", check_local_dir(self.local_dir))
        if self.node is not None:
            check_node_name(self.node, what="TierConfig.node")
        nodes = tuple(self.nodes)
        for name in nodes:
            check_node_name(name, what="a name in TierConfig.nodes")
        if len(set(nodes)) != len(nodes):
            raise ConfigError(f"TierConfig.nodes names a node twice: {list(nodes)}")
        object.__setattr__(self, "nodes", nodes)
        if not isinstance(self.replicas, int) or self.replicas < 0:
            raise ConfigError(
                f"TierConfig.replicas={self.replicas!r} must be an integer >= 0 (0: the default)"
            )
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ConfigError(
                f"TierConfig.keep_last={self.keep_last!r} must be an integer >= 1 (the newest "
                "checkpoint's copies are always kept)"
            )

    def this_node(self) -> str:
        """The node this process runs on."""
        return self.node if self.node is not None else node_name()

    def ring(self) -> tuple[str, ...]:
        """Every node of the job, sorted (this node included)."""
        return tuple(sorted({*self.nodes, self.this_node()}))

    def replica_count(self) -> int:
        """R: the configured ``replicas``, or the default for the job's nodes; never more
        nodes than the job has (``ConfigError`` naming both)."""
        ring = self.ring()
        wanted = self.replicas or (2 if len(ring) >= 2 else 1)
        if wanted > len(ring):
            raise ConfigError(
                f"TierConfig.replicas={wanted} needs {wanted} nodes, but the job has "
                f"{len(ring)} ({', '.join(ring)}); lower replicas or list every node in "
                "TierConfig.nodes"
            )
        return wanted

    def root(self, node: str) -> Path:
        """``node``'s tier directory."""
        return tier_root(self.local_dir, node)
