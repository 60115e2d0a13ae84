"""save / load / latest over the manifest and the blob store, async saves, retention, fencing."""

from __future__ import annotations

from ckptstore.checkpointer.retention import RetentionPolicy
from ckptstore.checkpointer.run import (
    CheckpointInfo,
    ComponentInfo,
    LoadedCheckpoint,
    Run,
    SaveHandle,
    open_run,
)
from ckptstore.checkpointer.shards import ShardReceipt, ShardWriter

__all__ = [
    "CheckpointInfo",
    "ComponentInfo",
    "LoadedCheckpoint",
    "RetentionPolicy",
    "Run",
    "SaveHandle",
    "ShardReceipt",
    "ShardWriter",
    "open_run",
]
