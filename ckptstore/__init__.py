"""ckptstore: a checkpoint store for large-model training."""

from __future__ import annotations

from ckptstore.cas import WriterOptions
from ckptstore.checkpointer import (
    CheckpointInfo,
    LoadedCheckpoint,
    RetentionPolicy,
    Run,
    SaveHandle,
    ShardReceipt,
    ShardWriter,
    open_run,
)
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ConfigError,
    DatabaseError,
    FencedError,
    IntegrityError,
    ObjectNotFoundError,
    ObjectStoreError,
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
    "S3Store",
    "SaveError",
    "SaveHandle",
    "SchemaError",
    "SerializationError",
    "ShardReceipt",
    "ShardWriter",
    "StorePermissionError",
    "WriterOptions",
    "open_run",
    "open_store",
]
