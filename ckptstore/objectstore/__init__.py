"""Object stores: one contract (:class:`ObjectStore`), a local-directory and an S3 backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ckptstore.errors import ConfigError
from ckptstore.objectstore._local import LocalStore
from ckptstore.objectstore._retry import RetryPolicy
from ckptstore.objectstore._s3 import S3Store
from ckptstore.objectstore.base import BytesLike, ObjectInfo, ObjectStore, PutData

__all__ = [
    "BytesLike",
    "LocalStore",
    "ObjectInfo",
    "ObjectStore",
    "PutData",
    "RetryPolicy",
    "S3Store",
    "open_store",
]


def open_store(url: str | Path, **options: Any) -> ObjectStore:
    """Open the store at ``url``.

    ``url`` is a local path, ``file:///abs/path`` or ``s3://bucket/prefix``. ``options`` go to
    the backend's constructor (e.g. ``endpoint_url=`` for :class:`S3Store`).
    """
    if isinstance(url, Path):
        return LocalStore(url, **options)
    text = str(url).strip()
    if not text:
        raise ConfigError(
            "empty store URL: give a directory, file:///abs/path or s3://bucket/prefix"
        )
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "s3":
        if not parts.netloc:
            raise ConfigError(f"store URL {text!r} has no bucket: use s3://bucket/prefix")
        return S3Store(parts.netloc, unquote(parts.path).strip("/"), **options)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"store URL {text!r} names host {parts.netloc!r}: file URLs must be "
                "file:///absolute/path"
            )
        return LocalStore(unquote(parts.path), **options)
    if scheme and len(scheme) > 1:  # one letter is a Windows drive, not a scheme
        raise ConfigError(
            f"unsupported store URL scheme {scheme!r} in {text!r}: use a directory path, "
            "file:///abs/path or s3://bucket/prefix"
        )
    return LocalStore(text, **options)
