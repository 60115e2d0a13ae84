"""The trainer's side of node-local tiers: which node a process is on, and the check that every
node sees the same object store (``checkpointing.local_dir``; DESIGN.md §13)."""

from __future__ import annotations

import dataclasses

from ckptstore.floor import ObjectStore, TierConfig, node_name
from ckptstore.floor import check_nonce as check_store_nonce


def tier_node() -> tuple[str, str | None]:
    """This process's node: its name for the tiers (``$CKPTSTORE_NODE`` or the host name), and
    its Ray node id (None outside Ray)."""
    try:
        import ray

        node_id = str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else None
    except ImportError:  # pragma: no cover - ray is a dependency of the trainer
        node_id = None
    return node_name(), node_id


def on_this_node(tiers: TierConfig) -> TierConfig:
    """The controller's tier config, for a process on this process's node."""
    return dataclasses.replace(tiers, node=node_name())


def check_nonce(store: ObjectStore | str, key: str, nonce: str) -> None:
    """The controller's nonce, read back as this node sees the store (ConfigError if not)."""
    check_store_nonce(store, key, nonce, node=node_name())
