"""Object stores: one contract (:class:`ObjectStore`) and the backends that open store URLs.

:func:`open_store` picks the backend by the URL's scheme from a table (:mod:`.registry`);
the built-in rows are below. A new backend is a module with its store class and an opener,
and one :func:`register_backend` call. Remote backends send their requests through
:class:`~ckptstore.objectstore.remote.RemoteCaller` (retries, error translation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptstore.objectstore._local import LocalStore, open_file_url, open_path
from ckptstore.objectstore._retry import RetryPolicy
from ckptstore.objectstore.base import BytesLike, ObjectInfo, ObjectStore, PutData
from ckptstore.objectstore.registry import (
    Backend,
    Opener,
    StoreURL,
    backends,
    open_store,
    register_backend,
)

if TYPE_CHECKING:
    from ckptstore.objectstore._s3 import S3Store

__all__ = [
    "Backend",
    "BytesLike",
    "LocalStore",
    "ObjectInfo",
    "ObjectStore",
    "Opener",
    "PutData",
    "RetryPolicy",
    "S3Store",
    "StoreURL",
    "backends",
    "open_store",
    "register_backend",
]

register_backend("", open_path, description="a directory path")
register_backend("file", open_file_url, description="file:///abs/path")


def _open_s3_url(url: StoreURL, *, create: bool, **options: Any) -> ObjectStore:
    # boto3 (a few tenths of a second to import) only for a store that is on S3.
    from ckptstore.objectstore._s3 import open_s3_url

    return open_s3_url(url, create=create, **options)


def __getattr__(name: str) -> Any:
    # S3Store, imported on first use (with boto3): a local store's process never pays for it.
    if name == "S3Store":
        from ckptstore.objectstore._s3 import S3Store

        globals()["S3Store"] = S3Store
        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register_backend("s3", _open_s3_url, description="s3://bucket/prefix")


def _open_gcs_url(url: StoreURL, *, create: bool, **options: Any) -> ObjectStore:
    # The Google Cloud Storage client only for a store that is on GCS.
    from ckptstore.objectstore._gcs import open_gcs_url

    return open_gcs_url(url, create=create, **options)


def _open_azure_url(url: StoreURL, *, create: bool, **options: Any) -> ObjectStore:
    # The Azure Blob client only for a store that is on Azure.
    from ckptstore.objectstore._azure import open_azure_url

    return open_azure_url(url, create=create, **options)


register_backend("gs", _open_gcs_url, description="gs://bucket/prefix")
register_backend("az", _open_azure_url, description="az://container/prefix")
