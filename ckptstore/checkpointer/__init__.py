"""save / load / latest over the manifest and the blob store, async saves, retention, fencing."""

from __future__ import annotations

from ckptstore.checkpointer.handle import SaveHandle
from ckptstore.checkpointer.open import config_fingerprint, open_run, run_info
from ckptstore.checkpointer.restore import LoadedCheckpoint
from ckptstore.checkpointer.retention import RetentionPolicy
from ckptstore.checkpointer.run import Run
from ckptstore.checkpointer.shards import ShardReceipt, ShardSave, ShardWriter
from ckptstore.manifest.records import CheckpointInfo, ComponentInfo, RunInfo

__all__ = [
    "CheckpointInfo",
    "ComponentInfo",
    "LoadedCheckpoint",
    "RetentionPolicy",
    "Run",
    "RunInfo",
    "SaveHandle",
    "ShardReceipt",
    "ShardSave",
    "ShardWriter",
    "config_fingerprint",
    "open_run",
    "run_info",
]
