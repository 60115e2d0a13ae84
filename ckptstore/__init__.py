"""ckptstore: a checkpoint store for large-model training."""

from __future__ import annotations

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
from ckptstore.objectstore import LocalStore, ObjectStore, S3Store, open_store

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
