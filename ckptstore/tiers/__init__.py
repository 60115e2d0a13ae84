"""Node-local tiers (DESIGN.md §13): checkpoints every few steps on the nodes' own disks (RAM
disk, NVMe), each blob fsynced on R nodes before the commit, drained to the object store later;
a resume reads each blob from its nearest verified copy.

- :class:`TierConfig`: where each node's tier is (``local_dir``, may contain ``{node}``), R
  (``replicas``), how many checkpoints a tier keeps (``keep_last``). Give it to ``open_run``.
- :func:`writer_store`: what a worker on a node saves through (``ShardWriter(writer_store(cfg))``):
  its receipts then name the nodes holding their blobs, and the coordinator commits them local.
- Transports reach other nodes' tiers: :class:`PathTransport` (tiers that are directories here),
  ``ckptstore.tiers.ray.RayTransport`` (an actor per node).
"""

from __future__ import annotations

from ckptstore.tiers.config import TierConfig
from ckptstore.tiers.nodes import NODE_ENV, check_node_name, node_name
from ckptstore.tiers.transport import PathTransport, Transport

__all__ = [
    "NODE_ENV",
    "PathTransport",
    "TierConfig",
    "Transport",
    "check_node_name",
    "node_name",
]
