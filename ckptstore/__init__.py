"""ckptstore: a checkpoint store for large-model training.

The names below are imported on first use (PEP 562), so ``import ckptstore.manifest`` or the
read-only CLI commands do not pay for torch and numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptstore._lazy import lazy_exports
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ComponentNotFoundError,
    ConfigError,
    DatabaseError,
    FencedError,
    IntegrityError,
    ObjectNotFoundError,
    ObjectStoreError,
    RunStateError,
    SaveError,
    SchemaError,
    SerializationError,
    StorePermissionError,
)

if TYPE_CHECKING:
    from ckptstore.cas import WriterOptions
    from ckptstore.checkpointer import (
        CheckpointInfo,
        ComponentInfo,
        LoadedCheckpoint,
        RetentionPolicy,
        Run,
        RunInfo,
        SaveHandle,
        ShardReceipt,
        ShardSave,
        ShardWriter,
        open_run,
        run_info,
    )
    from ckptstore.objectstore import LocalStore, ObjectStore, S3Store, open_store

__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {
        "ckptstore.cas": ["WriterOptions"],
        "ckptstore.checkpointer": [
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
            "open_run",
            "run_info",
        ],
        "ckptstore.objectstore": ["LocalStore", "ObjectStore", "S3Store", "open_store"],
    },
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CkptStoreError",
    "ComponentInfo",
    "ComponentNotFoundError",
    "ConfigError",
    "DatabaseError",
    "FencedError",
    "IntegrityError",
    "LoadedCheckpoint",
    "LocalStore",
    "ObjectNotFoundError",
    "ObjectStore",
    "ObjectStoreError",
    "RetentionPolicy",
    "Run",
    "RunInfo",
    "RunStateError",
    "S3Store",
    "SaveError",
    "SaveHandle",
    "SchemaError",
    "SerializationError",
    "ShardReceipt",
    "ShardSave",
    "ShardWriter",
    "StorePermissionError",
    "WriterOptions",
    "open_run",
    "open_store",
    "run_info",
]
