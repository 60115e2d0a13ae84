"""The built-in blob codecs (raw, zstd, zstd after byte-grouping, and the float codec) and the
choice between them.

Typed floats usually go to the float codec (:mod:`ckptstore.cas.fpcodec`: the exponent plane
Huffman-coded), which compresses weights more, and several times faster, than byte-grouped
zstd. Every codec is offered a sample of each blob and the smallest output wins, a slower codec
only by a clear margin (:func:`encode`): floats full of zero runs or of a few distinct values
(RL rollouts: log-probabilities, advantages) go to byte-grouped or plain zstd, integers of
several bytes (token ids) to byte-grouped zstd. Byte-grouped zstd also takes the floats the
float codec cannot (an installation whose C extension did not compile, element sizes other
than 2, 4 and 8).

Byte-grouping splits each element's bytes into planes (all first bytes, all second bytes, ...).
For floats nearly all the gain is in the sign/exponent plane; the mantissa planes look random.
So each plane is compressed only if a sample of it shrinks, and stored raw otherwise: zstd spends
its time where it pays.

Whether compressing is worth it also depends on where the bytes go (DESIGN.md §4): on a fast local
disk writing raw bytes beats compressing them unless the gain is large; on an object store over a
network a modest gain already saves wall time. :func:`min_gain` turns that into a threshold.

Importing this module registers the built-in codecs (see :mod:`ckptstore.cas.codecs`).
"""

from __future__ import annotations

import enum
import struct
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import zstandard

from ckptstore.cas import codecs, fpcodec
from ckptstore.cas.codecs import Encoded
from ckptstore.errors import ConfigError, IntegrityError

#: What "not worth it" means: a blob is stored raw if compression saves less than this.
MIN_GAIN = 0.05
#: Rough zstd-1 throughput across the encoding threads, bytes/s (2 cores, measured).
ZSTD_BYTES_PER_S = 1.0e9
#: The compression speed the auto policy weighs against the store's bandwidth: the float
#: codec's, since typed floats are nearly all of a checkpoint's bytes and go to it (zstd's
#: where its C extension is missing). One threshold serves every codec, so zstd's blobs are
#: held to the float codec's bar (the writer passes one number).
COMPRESS_BYTES_PER_S = fpcodec.BYTES_PER_S if fpcodec.NATIVE_ERROR is None else ZSTD_BYTES_PER_S
#: Compression is not worth more than this share of the bytes in wall time terms; above it,
#: compress anyway since the space saving is large.
MAX_REQUIRED_GAIN = 0.5
_SAMPLE = 64 << 10
_SAMPLES = 3
#: Before the trials on the full sample, every codec is offered a quick probe of windows a
#: quarter that size. A blob that no codec shrinks there by ``threshold - QUICK_MARGIN`` is
#: stored raw without the full trials: on a local disk (threshold 0.5) that is nearly every
#: weight blob, and the full trials cost a third of what hashing the blob does (measured on
#: bf16 weights, 2 cores). The margin absorbs what the smaller windows misjudge.
_QUICK_SAMPLE = 16 << 10
QUICK_MARGIN = 0.1
#: How much smaller a slower codec's output must be to be chosen over a faster one's (the
#: registry's order is by speed: fphuff, then bgzstd, then zstd).
SWITCH_GAIN = 0.08
#: One byte plane in a byte-grouped blob's params: its codec (the id of raw or zstd), length.
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
        """The policy ``value`` names; ``ConfigError`` naming the choices otherwise."""
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


def encode(
    raw: memoryview, *, itemsize: int = 1, float_like: bool = False, threshold: float = MIN_GAIN
) -> Encoded:
    """``raw`` as the codec that stores a sample of it smallest; raw if every codec declines.

    Every registered codec encodes the sample (the whole blob when it is small); the registry's
    order is by speed, fastest first, and a later codec wins over an earlier one only if its
    output is at least ``SWITCH_GAIN`` smaller (ratio and speed weighed as for weights: the float
    codec keeps floats unless byte-grouped or plain zstd does clearly better on this data, e.g.
    rollout log-probabilities full of exact zeros). The chosen codec then encodes the whole
    blob; should it decline there, the next ones are offered it in the registry's order.
    A blob larger than the sample is first offered as a quick probe (see ``QUICK_MARGIN``):
    if no codec comes near ``threshold`` there, it is stored raw without the full trials.
    """
    if threshold > 1.0 or not raw.nbytes:
        return Encoded(RAW, [raw])
    whole = raw.nbytes <= _SAMPLE * _SAMPLES
    if not whole and threshold > QUICK_MARGIN:
        quick = memoryview(_sample(raw, itemsize, _QUICK_SAMPLE))
        if next(_trials(quick, itemsize, float_like, threshold - QUICK_MARGIN), None) is None:
            return Encoded(RAW, [raw])
    probe = raw if whole else memoryview(_sample(raw, itemsize))
    trials = list(_trials(probe, itemsize, float_like, threshold))
    for candidate, tried in _by_preference(trials):
        if whole:
            return tried
        encoded = candidate.encode(
            raw, itemsize=itemsize, float_like=float_like, threshold=threshold
        )
        if encoded is not None:
            return encoded
    return Encoded(RAW, [raw])


def _trials(
    probe: memoryview, itemsize: int, float_like: bool, threshold: float
) -> Iterator[tuple[codecs.Codec, Encoded]]:
    """Each registered codec's encoding of ``probe`` that saves ``threshold``, in the
    registry's order (raw, the fallback, is no candidate), tried as they are asked for."""
    for candidate in codecs.registered():
        if candidate is RAW:
            continue
        tried = candidate.encode(
            probe, itemsize=itemsize, float_like=float_like, threshold=threshold
        )
        if tried is not None:
            yield candidate, tried


def _by_preference(
    trials: list[tuple[codecs.Codec, Encoded]],
) -> list[tuple[codecs.Codec, Encoded]]:
    """``trials`` (in the registry's order) with the preferred one first: the first trial unless
    a later one stores at least ``SWITCH_GAIN`` less than the best so far."""
    if not trials:
        return []
    best = trials[0]
    for trial in trials[1:]:
        if trial[1].stored_len <= best[1].stored_len * (1.0 - SWITCH_GAIN):
            best = trial
    return [best, *(trial for trial in trials if trial is not best)]


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


def _sample(view: memoryview, itemsize: int, window: int = _SAMPLE) -> memoryview | bytes:
    """A few element-aligned windows of ``window`` bytes of ``view`` (the whole if small)."""
    n = view.nbytes
    if n <= window * _SAMPLES:
        return view
    step = (n - window) // (_SAMPLES - 1)
    starts = [(i * step) // itemsize * itemsize for i in range(_SAMPLES)]
    return b"".join(view[s : s + window] for s in starts)


def _planes(view: memoryview, itemsize: int) -> np.ndarray:
    """Byte planes of ``view`` as a (itemsize, n) array (a strided view, not yet copied)."""
    return np.frombuffer(view, dtype=np.uint8).reshape(-1, itemsize).T


def _bytes_view(array: np.ndarray[Any, Any]) -> memoryview:
    """A flat byte memoryview of a contiguous numpy array (no copy)."""
    return memoryview(array.reshape(-1).view(np.uint8).data)


def _gain(raw: memoryview | bytes, compressed_len: int) -> float:
    n = memoryview(raw).nbytes
    return 1.0 - compressed_len / n if n else 0.0


def _byte_groupable(raw: memoryview, itemsize: int) -> bool:
    """Whether ``raw`` is whole elements of more than one byte (floats, and integers such as
    token ids, whose high bytes are nearly constant)."""
    return itemsize > 1 and raw.nbytes % itemsize == 0


def _decompress(payload: memoryview | bytes, raw_len: int, where: str) -> bytes:
    try:
        # python-zstandard allocates what the frame declares, whatever max_output_size says: a
        # frame that records another size is damaged, and is refused before anything is allocated.
        declared = zstandard.frame_content_size(payload)
        if declared not in (-1, raw_len):
            raise IntegrityError(
                f"{where}: zstd frame declares {declared} bytes, expected {raw_len} (corrupt)"
            )
        out = _decompressor().decompress(payload, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{where}: payload does not decode ({exc})") from exc
    if len(out) != raw_len:
        raise IntegrityError(f"{where}: decompressed to {len(out)} bytes, expected {raw_len}")
    return out


def _refuse_params(name: str, itemsize: int, params: bytes, where: str) -> None:
    """A codec without parameters refuses a header that carries some (a damaged header)."""
    if itemsize != 1 or params:
        raise IntegrityError(
            f"{where}: blob header has byte-grouping fields for codec {name} (corrupt)"
        )


class RawCodec:
    """The bytes as they are: the fallback when no other codec saves enough."""

    id = 0
    name = "raw"

    def encode(
        self, raw: memoryview, *, itemsize: int, float_like: bool, threshold: float
    ) -> Encoded:
        """``raw`` itself (never declines)."""
        return Encoded(self, [raw])

    def decode(
        self, payload: memoryview, raw_len: int, *, itemsize: int, params: bytes, where: str
    ) -> memoryview:
        """The payload itself, once its length is checked."""
        _refuse_params(self.name, itemsize, params, where)
        if payload.nbytes != raw_len:
            raise IntegrityError(f"{where}: raw payload is {payload.nbytes}, not {raw_len}")
        return payload


class ZstdCodec:
    """One zstd frame of the whole blob, for data that is not typed floats."""

    id = 1
    name = "zstd"

    def encode(
        self, raw: memoryview, *, itemsize: int, float_like: bool, threshold: float
    ) -> Encoded | None:
        """One frame, if a sample and then the whole shrink by ``threshold``."""
        comp = _compressor()
        sample = _sample(raw, 1)
        if _gain(sample, len(comp.compress(sample))) < threshold:
            return None
        out = comp.compress(raw)
        if _gain(raw, len(out)) < threshold:
            return None
        return Encoded(self, [memoryview(out)])

    def decode(
        self, payload: memoryview, raw_len: int, *, itemsize: int, params: bytes, where: str
    ) -> memoryview:
        """The decompressed frame, refused if it is not exactly ``raw_len`` bytes."""
        _refuse_params(self.name, itemsize, params, where)
        return memoryview(_decompress(payload, raw_len, where))


class ByteGroupedZstdCodec:
    """Byte planes of typed floats, each zstd-compressed if that pays (see module docstring).

    Params: per plane its codec (raw's or zstd's id, u8) and stored length (u64).
    """

    id = 2
    name = "bgzstd"

    def encode(
        self, raw: memoryview, *, itemsize: int, float_like: bool, threshold: float
    ) -> Encoded | None:
        """The planes, if the sampled estimate and then the whole shrink by ``threshold``."""
        if not _byte_groupable(raw, itemsize):
            return None
        comp = _compressor()
        sample_planes = _planes(memoryview(_sample(raw, itemsize)), itemsize)
        gains = [
            _gain(p, len(comp.compress(_bytes_view(np.ascontiguousarray(p)))))
            for p in sample_planes
        ]
        keep = [g >= MIN_GAIN for g in gains]
        estimated = sum(g for g, k in zip(gains, keep, strict=True) if k) / itemsize
        if estimated < threshold:
            return None
        params = bytearray()
        payload: list[memoryview] = []
        for plane, compress in zip(_planes(raw, itemsize), keep, strict=True):
            view = _bytes_view(np.ascontiguousarray(plane))
            plane_codec = RawCodec.id
            if compress:
                packed = comp.compress(view)
                if len(packed) < view.nbytes:
                    view, plane_codec = memoryview(packed), ZstdCodec.id
            params += _PLANE.pack(plane_codec, view.nbytes)
            payload.append(view)
        encoded = Encoded(self, payload, itemsize, bytes(params))
        return encoded if _gain(raw, encoded.stored_len) >= threshold else None

    def decode(
        self, payload: memoryview, raw_len: int, *, itemsize: int, params: bytes, where: str
    ) -> memoryview:
        """The planes decoded and interleaved back into elements."""
        if len(params) != itemsize * _PLANE.size or raw_len % itemsize:
            raise IntegrityError(f"{where}: byte-grouping table does not match the element size")
        count = raw_len // itemsize
        out = np.empty((count, itemsize), dtype=np.uint8)
        offset = 0
        for i in range(itemsize):
            plane_codec, length = _PLANE.unpack_from(params, i * _PLANE.size)
            piece = payload[offset : offset + length]
            if piece.nbytes != length:
                raise IntegrityError(f"{where}: byte plane {i} is truncated")
            offset += length
            if plane_codec == ZstdCodec.id:
                plane: memoryview | bytes = _decompress(piece, count, where)
            elif plane_codec == RawCodec.id and length == count:
                plane = piece
            else:
                raise IntegrityError(f"{where}: byte plane {i} has an invalid codec or length")
            out[:, i] = np.frombuffer(plane, dtype=np.uint8)
        if offset != payload.nbytes:
            raise IntegrityError(f"{where}: payload has {payload.nbytes - offset} trailing bytes")
        return _bytes_view(out)


RAW = codecs.register(RawCodec())
# The order in which encode() offers them a blob: the float codec, then byte-grouping (floats
# the float codec declines), then plain zstd.
FPHUFF = codecs.register(fpcodec.FloatPlaneCodec())
BGZSTD = codecs.register(ByteGroupedZstdCodec())
ZSTD = codecs.register(ZstdCodec())
