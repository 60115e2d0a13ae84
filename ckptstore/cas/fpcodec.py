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

The payload format is specified in :mod:`ckptstore.cas.fpref`, a pure-Python (numpy)
implementation that matches the C extension byte for byte. The extension is an accelerator
only: an installation built without a C compiler reads fphuff blobs with the reference decoder
(much slower) and writes its floats as ``bgzstd`` instead, and says so once, at first use.

Params: ``format`` (u8, :data:`FORMAT`) and ``block_log2`` (u8).
"""

from __future__ import annotations

import logging
import struct
import threading
from typing import Protocol

from ckptstore.cas import fpref
from ckptstore.cas.codecs import Encoded
from ckptstore.errors import IntegrityError, UnreadableError

log = logging.getLogger("ckptstore.cas")


class FloatCoder(Protocol):
    """The byte work of the codec: the C extension, or :mod:`ckptstore.cas.fpref`."""

    def estimate(
        self, raw: memoryview, itemsize: int, plane_min_gain: float, /
    ) -> tuple[int, float]:
        """The planes worth coding (bit k for plane k) and the share coding would save."""
        ...

    def encode(self, raw: memoryview, itemsize: int, mask: int, block_log2: int, /) -> bytes:
        """The payload for ``raw``."""
        ...

    def decode(
        self, payload: memoryview, raw_len: int, itemsize: int, block_log2: int, /
    ) -> bytearray | memoryview:
        """The ``raw_len`` bytes ``payload`` encodes; ``ValueError`` if it does not decode."""
        ...


try:
    from ckptstore.cas import _fpcodec
except ImportError as exc:
    native: FloatCoder | None = None
    NATIVE_ERROR: str | None = (
        f"the float codec's C extension ckptstore.cas._fpcodec is not importable ({exc}): "
        "fphuff blobs are read with the pure-Python reference decoder (tens of MB/s instead "
        "of GB/s) and new float blobs are written as bgzstd. For the fast path install a C "
        "compiler (e.g. gcc) and reinstall ckptstore from source (pip install "
        "--force-reinstall --no-deps <sdist or checkout>, or make in a checkout)"
    )
else:
    native = _fpcodec
    NATIVE_ERROR = None

#: Encoding throughput across the writer's threads, bytes/s, on the 2-core machine this was
#: measured on (bench/bench_codec.py, one thread, 256 MiB tensors: 1.5-2.1 GB/s on bf16, 2.0-3.0
#: on fp16 and fp32, about half that when other processes load the machine); what the auto
#: policy weighs against a store's bandwidth (ckptstore.cas.codec.min_gain). zstd's is 1 GB/s.
BYTES_PER_S = 2.5e9
#: Payload layout version in the params; a decoder refuses any other as unreadable.
FORMAT = 1
#: A mantissa plane is Huffman-coded when a sample says coding would save this share of it.
PLANE_MIN_GAIN = 0.02
#: Elements per block: 2**18 keeps a block's coded planes (256 KiB each) in the L2 cache, and
#: makes the code tables a negligible share of the payload.
BLOCK_LOG2 = 18
#: The block sizes the format allows.
BLOCK_LOG2_RANGE = fpref.BLOCK_LOG2_RANGE
_PARAMS = struct.Struct("<BB")
_ITEMSIZES = fpref.ITEMSIZES
_warned = threading.Event()
_warning = threading.Lock()


def _say_native_missing() -> None:
    """Log, once per process, that this installation runs without the C extension (the
    writer's threads may all get here first at once)."""
    if _warned.is_set():
        return
    with _warning:
        if _warned.is_set():
            return
        _warned.set()
    log.warning("ckptstore: %s", NATIVE_ERROR)


class FloatPlaneCodec:
    """Typed floats (itemsize 2, 4 or 8): see the module docstring.

    ``coder`` does the byte work: by default the C extension, or where it is missing the
    reference, which then only decodes (floats go to ``bgzstd``: see the module docstring). A
    coder given explicitly (``FloatPlaneCodec(fpref)``) encodes too.
    """

    id = 3
    name = "fphuff"

    def __init__(self, coder: FloatCoder | None = None) -> None:
        self._fallback = coder is None and native is None
        self.coder: FloatCoder = coder or native or fpref
        self.encodes = not self._fallback

    def encode(
        self, raw: memoryview, *, itemsize: int, float_like: bool, threshold: float
    ) -> Encoded | None:
        """The coded planes, if a sampled estimate and then the whole save ``threshold``;
        declines data that is not whole floats, and everything without the C extension."""
        if not float_like or itemsize not in _ITEMSIZES or raw.nbytes % itemsize:
            return None
        if not self.encodes:
            _say_native_missing()
            return None
        mask, estimated = self.coder.estimate(raw, itemsize, PLANE_MIN_GAIN)
        if estimated < threshold:
            return None
        payload = self.coder.encode(raw, itemsize, mask, BLOCK_LOG2)
        if 1.0 - len(payload) / raw.nbytes < threshold:
            return None
        return Encoded(self, [memoryview(payload)], itemsize, _PARAMS.pack(FORMAT, BLOCK_LOG2))

    def decode(
        self, payload: memoryview, raw_len: int, *, itemsize: int, params: bytes, where: str
    ) -> memoryview:
        """The planes decoded and merged back into elements: ``UnreadableError`` for a format
        this ckptstore does not know, ``IntegrityError`` for any damage."""
        block_log2 = _block_log2(params, itemsize, raw_len, where)
        if self._fallback:
            _say_native_missing()
        try:
            return memoryview(self.coder.decode(payload, raw_len, itemsize, block_log2))
        except ValueError as exc:
            raise IntegrityError(f"{where}: {self.name} {exc}") from exc


def _block_log2(params: bytes, itemsize: int, raw_len: int, where: str) -> int:
    """The block size that ``params`` (sealed by the header's CRC) give, checked."""
    if not params:
        raise IntegrityError(f"{where}: fphuff params are empty: no format byte (corrupt)")
    if params[0] != FORMAT:
        raise UnreadableError(
            f"{where}: fphuff payload format {params[0]} is not one this ckptstore reads (it "
            f"reads format {FORMAT}): a newer ckptstore wrote the blob; upgrade ckptstore to "
            "read it"
        )
    if len(params) != _PARAMS.size:
        raise IntegrityError(f"{where}: fphuff params are {len(params)} bytes, not 2 (corrupt)")
    block_log2 = params[1]
    if block_log2 not in BLOCK_LOG2_RANGE or itemsize not in _ITEMSIZES or raw_len % itemsize:
        raise IntegrityError(
            f"{where}: fphuff header (format {FORMAT}, block 2**{block_log2}, itemsize "
            f"{itemsize}, {raw_len} raw bytes) breaks the format's rules (corrupt)"
        )
    return block_log2
