"""Content-addressed blobs: digests, codecs, packs, the upload pipeline and verified reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptstore._lazy import lazy_exports

if TYPE_CHECKING:
    from ckptstore.cas.blobs import BlobRef, MissingBlobError, get_blob, put_blob
    from ckptstore.cas.codec import Compression
    from ckptstore.cas.codecs import Codec, Encoded
    from ckptstore.cas.digest import blob_key, digest_bytes, digest_from_key
    from ckptstore.cas.header import Kind
    from ckptstore.cas.writer import BlobWriter, WriterOptions

__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {
        "ckptstore.cas.blobs": ["BlobRef", "MissingBlobError", "get_blob", "put_blob"],
        "ckptstore.cas.codec": ["Compression"],
        "ckptstore.cas.codecs": ["Codec", "Encoded"],
        "ckptstore.cas.digest": ["blob_key", "digest_bytes", "digest_from_key"],
        "ckptstore.cas.header": ["Kind"],
        "ckptstore.cas.writer": ["BlobWriter", "WriterOptions"],
    },
)

__all__ = [
    "BlobRef",
    "BlobWriter",
    "Codec",
    "Compression",
    "Encoded",
    "Kind",
    "MissingBlobError",
    "WriterOptions",
    "blob_key",
    "digest_bytes",
    "digest_from_key",
    "get_blob",
    "put_blob",
]
