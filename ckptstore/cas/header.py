"""The self-describing header at the start of every stored blob.

Layout (little-endian), padded with zeros to a multiple of 64 bytes so the payload of a raw
blob is aligned for any dtype when read into memory::

    magic      4s   b"CKPB"
    version    u8   2
    kind       u8   0 chunk, 1 pack, 2 index
    codec      u8   the codec's id (ckptstore.cas.codecs): 0 raw, 1 zstd, 2 byte-grouped zstd,
                    3 fphuff (exponent planes Huffman-coded)
    itemsize   u8   element size the codec grouped bytes by (1 otherwise)
    raw_len    u64  length of the raw bytes the digest covers
    stored_len u64  length of the payload that follows the header
    digest     32s  BLAKE3-256 of the raw bytes
    params_len u32  length of codec parameters that follow
    crc        u32  CRC-32 of the header (this field as zero) and its params
    params     ...  codec parameters (byte-grouping: per plane u8 codec + u64 length)

The digest checks the data; the CRC checks the header itself, so that a flipped bit which
happens not to change the decoded bytes (a chunk read as a pack, say) is still reported. This
module checks the fields every blob has; what ``itemsize`` and ``params`` may hold is for the
codec to check when it decodes.

The CRC decides whether a header is damaged before any field is interpreted: a codec id or
blob kind this ckptstore does not know, in a header whose CRC holds, was written that way (by
a newer ckptstore) and is unreadable here, not damaged. Another format version is different:
its layout past the version byte is unknown, so only the magic and the version can be read.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass
from typing import NoReturn

from ckptstore.cas import codecs
from ckptstore.cas.codecs import Codec
from ckptstore.errors import IntegrityError, UnreadableError

MAGIC = b"CKPB"
VERSION = 2
ALIGN = 64
_FIXED = struct.Struct("<4sBBBBQQ32sII")
_CRC_AT = _FIXED.size - 4
_VERSION_AT = 4
#: Codec parameters never need more: the byte-grouping table holds at most 16 planes.
MAX_PARAMS = 512
#: Hard limit on one blob's raw length; guards allocation against crafted headers.
MAX_RAW_LEN = 1 << 36


class Kind(enum.IntEnum):
    """What a blob holds (DESIGN.md §4)."""

    CHUNK = 0
    PACK = 1
    INDEX = 2


@dataclass(frozen=True, slots=True)
class Header:
    """The decoded header of one stored blob."""

    kind: Kind
    #: The registered codec whose id the header names.
    codec: Codec
    itemsize: int
    raw_len: int
    stored_len: int
    digest: bytes
    params: bytes = b""

    @property
    def size(self) -> int:
        """Bytes the encoded header occupies, padding included."""
        return _padded(_FIXED.size + len(self.params))

    def encode(self) -> bytes:
        """The header as stored: fixed fields, CRC, params, zero padding."""
        fixed = _FIXED.pack(
            MAGIC,
            VERSION,
            self.kind,
            self.codec.id,
            self.itemsize,
            self.raw_len,
            self.stored_len,
            self.digest,
            len(self.params),
            0,
        )
        crc = zlib.crc32(self.params, zlib.crc32(fixed))
        body = fixed[:_CRC_AT] + struct.pack("<I", crc) + self.params
        return body + bytes(self.size - len(body))


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


#: The most bytes a header occupies (fixed fields, the largest params, padding).
MAX_HEADER = _padded(_FIXED.size + MAX_PARAMS)


def decode_header(data: memoryview, where: str, *, object_size: int | None = None) -> Header:
    """Parse and check the header at the start of ``data``: a whole stored object, or its
    first :data:`MAX_HEADER` bytes (or all of it, if smaller) when ``object_size`` gives the
    object's size.

    Only proven damage raises :class:`IntegrityError`: an object that is no blob (too short,
    bad magic), a header that fails its CRC, or a sealed header that breaks this format's
    rules. A header whose CRC holds was written as it reads, so a field this ckptstore does not
    know (a codec id, a blob kind, a format version) raises :class:`UnreadableError`.
    """
    size = data.nbytes if object_size is None else object_size
    if min(size, data.nbytes) < _FIXED.size:
        raise IntegrityError(f"{where}: object is {size} bytes, too short for a blob header")
    magic, version, kind, codec_id, itemsize, raw_len, stored_len, digest, params_len, crc = (
        _FIXED.unpack_from(data)
    )
    if magic != MAGIC:
        raise IntegrityError(f"{where}: not a ckptstore blob (bad magic {bytes(magic)!r})")
    if version != VERSION:
        _refuse_version(data, version, where)
    if params_len > MAX_PARAMS:
        raise IntegrityError(
            f"{where}: blob header declares {params_len} bytes of codec parameters, more than "
            f"any version-{VERSION} header holds ({MAX_PARAMS}) (corrupt or crafted)"
        )
    params = bytes(data[_FIXED.size : _FIXED.size + params_len])
    if not _sealed(data, params, crc):
        raise IntegrityError(f"{where}: blob header fails its checksum (corrupt)")
    # From here the header holds what its writer sealed.
    try:
        kind_e = Kind(kind)
    except ValueError:
        raise UnreadableError(
            f"{where}: blob kind {kind} is not one this ckptstore knows (a newer ckptstore "
            "wrote the blob; its header checksum holds); upgrade ckptstore to read it"
        ) from None
    codec = codecs.by_id(codec_id, where)
    if raw_len > MAX_RAW_LEN or itemsize < 1:
        raise IntegrityError(f"{where}: implausible blob header (corrupt or crafted)")
    header = Header(kind_e, codec, itemsize, raw_len, stored_len, bytes(digest), params)
    if data.nbytes >= header.size and any(data[_FIXED.size + params_len : header.size]):
        raise IntegrityError(f"{where}: blob header padding is not zero (corrupt)")
    if size != header.size + stored_len:
        raise IntegrityError(
            f"{where}: object is {size} bytes but its header declares "
            f"{header.size + stored_len} (truncated or corrupt)"
        )
    return header


def _sealed(data: memoryview, params: bytes, crc: int, *, version: int | None = None) -> bool:
    """Whether the header's CRC holds (with its version byte read as ``version``, if given)."""
    unsealed = bytearray(data[:_CRC_AT]) + bytes(4)
    if version is not None:
        unsealed[_VERSION_AT] = version
    return zlib.crc32(params, zlib.crc32(unsealed)) == crc


def _refuse_version(data: memoryview, version: int, where: str) -> NoReturn:
    """Another format version's layout past the version byte is unknown, so its CRC cannot be
    checked: only a header that is this version's, damaged in the version byte alone, can be
    proven damaged (its CRC holds once that byte reads :data:`VERSION` again, which a real
    header of another version's -- sealed with its own version byte -- never does)."""
    *_, params_len, crc = _FIXED.unpack_from(data)
    if params_len <= MAX_PARAMS and data.nbytes >= _FIXED.size + params_len:
        params = bytes(data[_FIXED.size : _FIXED.size + params_len])
        if _sealed(data, params, crc, version=VERSION):
            raise IntegrityError(
                f"{where}: blob header names format version {version}, but it is a version-"
                f"{VERSION} header whose version byte is damaged (corrupt)"
            )
    if version > VERSION:
        raise UnreadableError(
            f"{where}: blob format version {version} is newer than this ckptstore reads "
            f"({VERSION}); upgrade ckptstore to read it"
        )
    raise UnreadableError(
        f"{where}: blob format version {version} is a pre-release format this ckptstore does "
        f"not read (it reads {VERSION})"
    )
