"""Blob identity: BLAKE3-256 of the raw (uncompressed) bytes, written ``b3:<64 hex digits>``."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import blake3

from ckptstore.errors import IntegrityError

if TYPE_CHECKING:
    from ckptstore.objectstore.base import BytesLike

ALGORITHM = "b3"
_DIGEST_RE = re.compile(r"^b3:[0-9a-f]{64}$")
# Above this, BLAKE3's own tree parallelism pays for its thread start-up.
_MULTITHREAD_MIN = 32 << 20


def digest_bytes(data: BytesLike) -> str:
    """The tagged digest of ``data`` (hashing releases the GIL)."""
    view = memoryview(data)
    threads = blake3.blake3.AUTO if view.nbytes >= _MULTITHREAD_MIN else 1
    return f"{ALGORITHM}:{blake3.blake3(view, max_threads=threads).hexdigest()}"


class StreamingDigest:
    """The tagged digest of bytes fed in order, piece by piece, on the calling thread (each
    piece is hashed while it is still in the CPU cache; hashing releases the GIL)."""

    def __init__(self) -> None:
        self._hasher = blake3.blake3(max_threads=1)

    def update(self, data: BytesLike) -> None:
        """Feed the next ``data``."""
        self._hasher.update(data)

    def result(self) -> str:
        """The tagged digest of everything fed so far."""
        return f"{ALGORITHM}:{self._hasher.hexdigest()}"


def raw_digest(digest: str) -> bytes:
    """The 32 bytes of a tagged digest, after checking its form."""
    check_digest(digest)
    return bytes.fromhex(digest[3:])


def from_raw(raw: bytes) -> str:
    """The tagged digest of 32 raw digest bytes (the inverse of :func:`raw_digest`)."""
    return f"{ALGORITHM}:{raw.hex()}"


def check_digest(digest: str) -> str:
    """``digest`` if it is a well-formed tagged digest, else ``IntegrityError``."""
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        raise IntegrityError(f"malformed blob digest {digest!r}: expected 'b3:' and 64 hex digits")
    return digest


def blob_key(digest: str) -> str:
    """Object key of a blob: ``cas/<hex[:2]>/<hex>``."""
    hexd = check_digest(digest)[3:]
    return f"cas/{hexd[:2]}/{hexd}"


def digest_from_key(key: str) -> str | None:
    """The digest a ``cas/`` key names, or None if ``key`` is not a blob key."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "cas":
        return None
    candidate = f"{ALGORITHM}:{parts[2]}"
    if not _DIGEST_RE.match(candidate) or parts[1] != parts[2][:2]:
        return None
    return candidate
