"""save / load / latest over the manifest and the blob store, async saves, retention, fencing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptstore._lazy import lazy_exports

if TYPE_CHECKING:
    from ckptstore.checkpointer.handle import SaveHandle
    from ckptstore.checkpointer.open import config_fingerprint, open_run, run_info
    from ckptstore.checkpointer.restore import LoadedCheckpoint
    from ckptstore.checkpointer.retention import RetentionPolicy
    from ckptstore.checkpointer.run import Run
    from ckptstore.checkpointer.shards import ShardReceipt, ShardSave, ShardWriter
    from ckptstore.manifest.records import CheckpointInfo, ComponentInfo, RunInfo

__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {
        "ckptstore.checkpointer.handle": ["SaveHandle"],
        "ckptstore.checkpointer.open": ["config_fingerprint", "open_run", "run_info"],
        "ckptstore.checkpointer.restore": ["LoadedCheckpoint"],
        "ckptstore.checkpointer.retention": ["RetentionPolicy"],
        "ckptstore.checkpointer.run": ["Run"],
        "ckptstore.checkpointer.shards": ["ShardReceipt", "ShardSave", "ShardWriter"],
        "ckptstore.manifest.records": ["CheckpointInfo", "ComponentInfo", "RunInfo"],
    },
)

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
