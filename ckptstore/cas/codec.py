"""Blob codecs: raw, zstd, and zstd after byte-grouping, chosen per blob by measured gain.

Byte-grouping splits each element's bytes into planes (all first bytes, all second bytes, ...).
For floats nearly all the gain is in the sign/exponent plane; the mantissa planes look random.
So each plane is compressed only if a sample of it shrinks, and stored raw otherwise: zstd spends
its time where it pays.

Whether compressing is worth it also depends on where the bytes go (DESIGN.md §4): on a fast local
disk writing raw bytes beats compressing them unless the gain is large; on an object store over a
network a modest gain already saves wall time. :func:`min_gain` turns that into a threshold.
"""

from __future__ import annotations

import enum
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from ckptstore.cas.header import MAX_RAW_LEN, Codec
from ckptstore.errors import ConfigError, IntegrityError

#: What "not worth it" means: a blob is stored raw if compression saves less than this.
MIN_GAIN = 0.05
#: Rough zstd-1 throughput across the encoding threads, bytes/s (2 cores, measured).
COMPRESS_BYTES_PER_S = 1.0e9
#: Compression is not worth more than this share of the bytes in wall time terms; above it,
#: compress anyway since the space saving is large.
MAX_REQUIRED_GAIN = 0.5
_SAMPLE = 64 << 10
_SAMPLES = 3
_PLANE = struct.Struct("<BQ")
_LEVEL = 1


class Compression(enum.StrEnum):
    """The user's compression policy."""

    #: Compress when the estimated gain saves wall time on this store, or is large (default).
    AUTO = "auto"
    #: Compress whenever it saves at least 5% of the bytes.
    ALWAYS = "always"
    #: Store every blob raw.
    NEVER = "never"

    @classmethod
    def parse(cls, value: str | Compression) -> Compression:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(
                f"compression={value!r} is not one of 'auto', 'always', 'never'"
            ) from None


def min_gain(policy: Compression, write_bandwidth: float) -> float:
    """The smallest fractional saving for which a blob is compressed under ``policy``."""
    if policy is Compression.NEVER:
        return float("inf")
    if policy is Compression.ALWAYS:
        return MIN_GAIN
    return max(MIN_GAIN, min(MAX_REQUIRED_GAIN, write_bandwidth / COMPRESS_BYTES_PER_S))


_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe; one per thread, reused.
    comp = getattr(_local, "compressor", None)
    if comp is None:
        comp = _local.compressor = zstandard.ZstdCompressor(level=_LEVEL)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor()
    return dec


@dataclass(frozen=True, slots=True)
class Encoded:
    codec: Codec
    itemsize: int
    params: bytes
    payload: list[memoryview]

    @property
    def stored_len(self) -> int:
        return sum(p.nbytes for p in self.payload)


def _sample(view: memoryview, itemsize: int) -> memoryview | bytes:
    """A few element-aligned windows of ``view`` (the whole thing if small)."""
    n = view.nbytes
    if n <= _SAMPLE * _SAMPLES:
        return view
    step = (n - _SAMPLE) // (_SAMPLES - 1)
    starts = [(i * step) // itemsize * itemsize for i in range(_SAMPLES)]
    return b"".join(view[s : s + _SAMPLE] for s in starts)


def _planes(view: memoryview, itemsize: int) -> np.ndarray:
    """Byte planes of ``view`` as a (itemsize, n) array (a strided view, not yet copied)."""
    return np.frombuffer(view, dtype=np.uint8).reshape(-1, itemsize).T


def _bytes_view(array: np.ndarray[Any, Any]) -> memoryview:
    """A flat byte memoryview of a contiguous numpy array (no copy)."""
    return memoryview(array.reshape(-1).view(np.uint8).data)


def _gain(raw: memoryview | bytes, compressed_len: int) -> float:
    n = memoryview(raw).nbytes
    return 1.0 - compressed_len / n if n else 0.0


def encode(
    raw: memoryview, *, itemsize: int = 1, float_like: bool = False, threshold: float = MIN_GAIN
) -> Encoded:
    """Encode ``raw`` with the codec that shrinks it by at least ``threshold``, else raw."""
    stored_raw = Encoded(Codec.RAW, 1, b"", [raw])
    if threshold > 1.0 or raw.nbytes == 0:
        return stored_raw
    comp = _compressor()
    if float_like and itemsize > 1 and raw.nbytes % itemsize == 0:
        sample_planes = _planes(memoryview(_sample(raw, itemsize)), itemsize)
        gains = [
            _gain(p, len(comp.compress(_bytes_view(np.ascontiguousarray(p)))))
            for p in sample_planes
        ]
        keep = [g >= MIN_GAIN for g in gains]
        estimated = sum(g for g, k in zip(gains, keep, strict=True) if k) / itemsize
        if estimated >= threshold:
            return _encode_bytegrouped(raw, itemsize, keep, threshold)
        return stored_raw
    sample = _sample(raw, 1)
    if _gain(sample, len(comp.compress(sample))) < threshold:
        return stored_raw
    out = comp.compress(raw)
    if _gain(raw, len(out)) < threshold:
        return stored_raw
    return Encoded(Codec.ZSTD, 1, b"", [memoryview(out)])


def _encode_bytegrouped(
    raw: memoryview, itemsize: int, keep: list[bool], threshold: float
) -> Encoded:
    comp = _compressor()
    params = bytearray()
    payload: list[memoryview] = []
    for plane, compress in zip(_planes(raw, itemsize), keep, strict=True):
        view = _bytes_view(np.ascontiguousarray(plane))
        codec = Codec.RAW
        if compress:
            packed = comp.compress(view)
            if len(packed) < view.nbytes:
                view, codec = memoryview(packed), Codec.ZSTD
        params += _PLANE.pack(codec, view.nbytes)
        payload.append(view)
    encoded = Encoded(Codec.BGZSTD, itemsize, bytes(params), payload)
    if _gain(raw, encoded.stored_len) < threshold:
        return Encoded(Codec.RAW, 1, b"", [raw])
    return encoded


def decode(
    codec: Codec, itemsize: int, params: bytes, payload: memoryview, raw_len: int, where: str
) -> memoryview:
    """The raw bytes of a payload; raises ``IntegrityError`` on any inconsistency."""
    try:
        if codec is Codec.RAW:
            if payload.nbytes != raw_len:
                raise IntegrityError(f"{where}: raw payload is {payload.nbytes}, not {raw_len}")
            return payload
        if codec is Codec.ZSTD:
            return memoryview(_decompress(payload, raw_len, where))
        return _decode_bytegrouped(itemsize, params, payload, raw_len, where)
    except (zstandard.ZstdError, MemoryError, ValueError) as exc:
        raise IntegrityError(f"{where}: payload does not decode ({exc})") from exc


def _decompress(payload: memoryview | bytes, raw_len: int, where: str) -> bytes:
    if raw_len > MAX_RAW_LEN:
        raise IntegrityError(f"{where}: declared length {raw_len} is implausible")
    out = _decompressor().decompress(payload, max_output_size=raw_len)
    if len(out) != raw_len:
        raise IntegrityError(f"{where}: decompressed to {len(out)} bytes, expected {raw_len}")
    return out


def _decode_bytegrouped(
    itemsize: int, params: bytes, payload: memoryview, raw_len: int, where: str
) -> memoryview:
    if len(params) != itemsize * _PLANE.size or raw_len % itemsize:
        raise IntegrityError(f"{where}: byte-grouping table does not match the element size")
    count = raw_len // itemsize
    out = np.empty((count, itemsize), dtype=np.uint8)
    offset = 0
    for i in range(itemsize):
        codec, length = _PLANE.unpack_from(params, i * _PLANE.size)
        piece = payload[offset : offset + length]
        if piece.nbytes != length:
            raise IntegrityError(f"{where}: byte plane {i} is truncated")
        offset += length
        if codec == Codec.ZSTD:
            plane: memoryview | bytes = _decompress(piece, count, where)
        elif codec == Codec.RAW and length == count:
            plane = piece
        else:
            raise IntegrityError(f"{where}: byte plane {i} has an invalid codec or length")
        out[:, i] = np.frombuffer(plane, dtype=np.uint8)
    if offset != payload.nbytes:
        raise IntegrityError(f"{where}: payload has {payload.nbytes - offset} trailing bytes")
    return _bytes_view(out)
