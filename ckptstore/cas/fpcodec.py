"""The float codec ``fphuff``: the exponent byte plane Huffman-coded, the mantissa planes raw.

A float's entropy sits in its exponent: bf16 and fp32 weights or Adam moments have a dozen or
two common exponents (about 2.5 bits of information in 8), while the mantissa bytes are close
to random. So each element is rotated left by one bit (the sign moves to bit 0 and the top byte
becomes the exponent), the elements are cut into byte planes, and the exponent plane is
Huffman-coded. A mantissa plane is coded too when a sample of it shows it would shrink by
:data:`PLANE_MIN_GAIN` (the squares in ``exp_avg_sq`` have a sign bit that is always 0); the
others are stored as they are, since entropy-coding random bytes only costs time. fp16 (itemsize
2 as well) comes out of the same layout: its top byte holds 5 exponent bits and 3 mantissa bits,
and that byte is still the one worth coding.

zstd finds little in the exponent plane that Huffman does not (its match finder only wastes
time there), and a table-driven Huffman decoder runs several times faster than zstd; the byte
work is a C extension (``_fpcodec.c``) that drops the GIL, because many writer threads encode
at once. Blocks of ``1 << block_log2`` elements each carry a code (or reuse the previous
block's, when that is no larger), so decoding needs one block of scratch and a damaged block is
refused on its own terms.

Params: ``format`` (u8, :data:`FORMAT`) and ``block_log2`` (u8).
"""

from __future__ import annotations

import struct

from ckptstore.cas.codecs import Encoded
from ckptstore.errors import ConfigError, IntegrityError

try:
    from ckptstore.cas import _fpcodec
except ImportError as exc:
    NATIVE_ERROR: str | None = (
        f"the float codec's C extension ckptstore.cas._fpcodec is not importable ({exc}); "
        "reinstall ckptstore from source with a C compiler present (pip install -e . or "
        "make), so that the extension is compiled"
    )
else:
    NATIVE_ERROR = None

#: Encoding throughput across the writer's threads, bytes/s, on the 2-core machine this was
#: measured on (bench/bench_codec.py, one thread, 256 MiB tensors: 1.5-2.1 GB/s on bf16, 2.0-3.0
#: on fp16 and fp32, about half that when other processes load the machine); what the auto
#: policy weighs against a store's bandwidth (ckptstore.cas.codec.min_gain). zstd's is 1 GB/s.
BYTES_PER_S = 2.5e9
#: Payload layout version in the params; a decoder refuses any other.
FORMAT = 1
#: A mantissa plane is Huffman-coded when a sample says coding would save this share of it.
PLANE_MIN_GAIN = 0.02
#: Elements per block: 2**18 keeps a block's coded planes (256 KiB each) in the L2 cache, and
#: makes the code tables a negligible share of the payload.
BLOCK_LOG2 = 18
#: The block sizes the decoder accepts (the C extension's bounds, repeated here so that a
#: missing extension still reports a damaged header as damaged).
BLOCK_LOG2_RANGE = range(8, 25)
_PARAMS = struct.Struct("<BB")
_ITEMSIZES = (2, 4, 8)


class FloatPlaneCodec:
    """Typed floats (itemsize 2, 4 or 8): see the module docstring."""

    id = 3
    name = "fphuff"

    def encode(
        self, raw: memoryview, *, itemsize: int, float_like: bool, threshold: float
    ) -> Encoded | None:
        """The coded planes, if a sampled estimate and then the whole save ``threshold``;
        declines data that is not whole floats, and everything without the C extension."""
        if (
            NATIVE_ERROR is not None
            or not float_like
            or itemsize not in _ITEMSIZES
            or raw.nbytes % itemsize
        ):
            return None
        mask, estimated = _fpcodec.estimate(raw, itemsize, PLANE_MIN_GAIN)
        if estimated < threshold:
            return None
        payload = _fpcodec.encode(raw, itemsize, mask, BLOCK_LOG2)
        if 1.0 - len(payload) / raw.nbytes < threshold:
            return None
        return Encoded(self, [memoryview(payload)], itemsize, _PARAMS.pack(FORMAT, BLOCK_LOG2))

    def decode(
        self, payload: memoryview, raw_len: int, *, itemsize: int, params: bytes, where: str
    ) -> memoryview:
        """The planes decoded and merged back into elements; ``ConfigError`` naming the fix if
        the C extension is missing."""
        if len(params) != _PARAMS.size:
            raise IntegrityError(f"{where}: float codec params are {len(params)} bytes, not 2")
        fmt, block_log2 = _PARAMS.unpack(params)
        if (
            fmt != FORMAT
            or block_log2 not in BLOCK_LOG2_RANGE
            or itemsize not in _ITEMSIZES
            or raw_len % itemsize
        ):
            raise IntegrityError(
                f"{where}: float codec header (format {fmt}, block 2**{block_log2}, itemsize "
                f"{itemsize}, {raw_len} raw bytes) is not one this ckptstore writes (corrupt, or "
                "written by a newer ckptstore)"
            )
        if NATIVE_ERROR is not None:
            raise ConfigError(f"{where}: cannot decode a {self.name} blob: {NATIVE_ERROR}")
        try:
            return memoryview(_fpcodec.decode(payload, raw_len, itemsize, block_log2))
        except ValueError as exc:
            raise IntegrityError(f"{where}: {self.name} {exc}") from exc
