"""ckptstore: a checkpoint store for large-model training.

The names below are imported on first use (PEP 562), so ``import ckptstore.manifest`` or the
read-only CLI commands do not pay for torch and numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

# The integrations' checkpoint formats (DCP, Megatron-Core) join the registry that verify,
# export and show look formats up in (ckptstore.formats); importing the table costs nothing.
from ckptstore.integrations import formats as _formats  # noqa: F401  (registers them)
from ckptstore.settings import package_version

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
    from ckptstore.checkpointer.drain import DrainReport
    from ckptstore.checkpointer.tiered import writer_store
    from ckptstore.objectstore import LocalStore, ObjectStore, S3Store, open_store
    from ckptstore.tiers import PathTransport, TierConfig

_lazy_getattr, _lazy_dir = lazy_exports(
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
        "ckptstore.checkpointer.drain": ["DrainReport"],
        "ckptstore.checkpointer.tiered": ["writer_store"],
        "ckptstore.objectstore": ["LocalStore", "ObjectStore", "S3Store", "open_store"],
        "ckptstore.tiers": ["PathTransport", "TierConfig"],
    },
)


def __getattr__(name: str) -> Any:
    """``__version__`` (the installed package's, read on first use: the metadata lookup costs
    tens of milliseconds), else the lazy exports above."""
    if name == "__version__":
        return package_version()
    return _lazy_getattr(name)


def __dir__() -> list[str]:
    """The package's names, ``__version__`` included."""
    return sorted({*_lazy_dir(), "__version__"})


__all__ = [
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CkptStoreError",
    "ComponentInfo",
    "ComponentNotFoundError",
    "ConfigError",
    "DatabaseError",
    "DrainReport",
    "FencedError",
    "IntegrityError",
    "LoadedCheckpoint",
    "LocalStore",
    "ObjectNotFoundError",
    "ObjectStore",
    "ObjectStoreError",
    "PathTransport",
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
    "TierConfig",
    "WriterOptions",
    "open_run",
    "open_store",
    "run_info",
    "writer_store",
]
