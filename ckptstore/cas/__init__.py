"""Content-addressed blobs: digests, codecs, packs, the upload pipeline and verified reads."""

from __future__ import annotations

from ckptstore.cas.blobs import BlobRef, MissingBlobError, get_blob, put_blob
from ckptstore.cas.codec import Compression
from ckptstore.cas.codecs import Codec, Encoded
from ckptstore.cas.digest import blob_key, digest_bytes, digest_from_key
from ckptstore.cas.header import Kind
from ckptstore.cas.writer import BlobWriter, WriterOptions

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
