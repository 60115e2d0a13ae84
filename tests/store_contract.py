"""Where the store factories used to live; they ship in :mod:`ckptstore.testing.factories` now
(and the conformance suite in :mod:`ckptstore.testing.store`). Kept so that test modules
importing these names from here keep working."""

from __future__ import annotations

from ckptstore.testing.factories import (
    FAST_RETRY,
    MULTIPART_OPTIONS,
    LocalStoreFactory,
    MiB,
    S3Endpoint,
    S3StoreFactory,
    StoreFactory,
    pattern,
)

__all__ = [
    "FAST_RETRY",
    "MULTIPART_OPTIONS",
    "LocalStoreFactory",
    "MiB",
    "S3Endpoint",
    "S3StoreFactory",
    "StoreFactory",
    "pattern",
]
