"""ckptstore: a checkpoint store for large-model training."""

from __future__ import annotations

from ckptstore.errors import (
    CkptStoreError,
    ConfigError,
    IntegrityError,
    ObjectNotFoundError,
    ObjectStoreError,
    SerializationError,
    StorePermissionError,
)
from ckptstore.objectstore import LocalStore, ObjectStore, S3Store, open_store

__version__ = "0.1.0"

__all__ = [
    "CkptStoreError",
    "ConfigError",
    "IntegrityError",
    "LocalStore",
    "ObjectNotFoundError",
    "ObjectStore",
    "ObjectStoreError",
    "S3Store",
    "SerializationError",
    "StorePermissionError",
    "open_store",
]
