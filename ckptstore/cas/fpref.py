"""The float codec ``fphuff`` in Python and numpy: the reference that the C extension
(``_fpcodec.c``) matches byte for byte, and the decoder of an installation built without it.

Payload format 1 (the ``format`` byte of the blob's params; ``block_log2`` is the other byte):

- The raw bytes are ``n = raw_len / itemsize`` little-endian elements of ``itemsize`` 2, 4 or
  8 bytes. Each element is rotated left by one bit (the sign moves to bit 0, so the highest
  byte holds the top eight exponent bits), and byte ``k`` (0 = least significant) of each
  rotated element forms *plane* ``k``.
- The elements go in blocks of ``2**block_log2`` (8 to 24), the last block holding the rest;
  ``n = 0`` means no blocks and an empty payload. Each block stores its planes in order
  ``k = 0 .. itemsize - 1``, each beginning with a mode byte:

  - ``0`` raw: the plane's ``count`` bytes (``count`` = the block's elements).
  - ``2`` constant: one byte, the value of all ``count`` bytes.
  - ``1`` Huffman: bytes ``lo < hi`` (the lowest and highest symbol with a code), then
    ``(hi - lo + 2) // 2`` bytes of code lengths, one 4-bit nibble per symbol ``lo..hi``, low
    nibble first, 0 = no code; a nibble left over when ``hi - lo`` is even must be 0. Lengths
    are at most 11 and form a complete prefix code (the sum of ``2**-length`` is exactly 1).
    Then the 8 streams' byte lengths (u32 little-endian each), then the 8 streams.
  - ``3`` Huffman again: the 8 streams' byte lengths, then the streams, coded with the lengths
    that the same plane's most recent mode-1 block sent (an error if none did).

- Codes are canonical: symbols sorted by (length, symbol) get consecutive codes, the first
  code of each length being ``(first code of the length before + its count) << 1`` (as in
  DEFLATE). Stream ``s`` holds the plane's symbols ``[s * q, min((s + 1) * q, count))`` with
  ``q = ceil(count / 8)`` (some streams may be empty), as codes written most significant code
  bit first into a bit stream that fills each byte from its least significant bit. A stream
  ends in the byte holding its last code's last bit; the bits after that code are zero.
- The payload ends exactly after the last block. Anything else (an unknown mode, a truncated
  or extra byte, a stream that does not decode to exactly its symbols) is damage.

What the writer chooses is part of the reference too (:func:`encode` matches the C encoder's
bytes): a plane outside ``mask``, and a plane whose coded form would be larger than ``count``
bytes, is stored raw; a plane in ``mask`` with one distinct byte is constant; otherwise its
lengths are the optimal ones of at most 11 bits for the block's byte counts (package-merge,
ties broken by lower count, then lower symbol, a symbol before a package of equal weight), and
mode 3 replaces mode 1 whenever the plane's last sent lengths code every symbol present and
give a total no larger.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import numpy.typing as npt

from ckptstore.cas.fpstreams import (
    CODE_BITS,
    StreamDecoder,
    StreamError,
    kraft_complete,
    lsb_codes,
)

ByteArray = npt.NDArray[np.uint8]

#: Streams per coded plane.
STREAMS = 8
MODE_RAW, MODE_HUFF, MODE_CONST, MODE_AGAIN = 0, 1, 2, 3
#: The block sizes (log2 of elements) the format allows.
BLOCK_LOG2_RANGE = range(8, 25)
ITEMSIZES = (2, 4, 8)
#: The estimate's sample: this many windows of this many elements, spread over the input.
_SAMPLE_WINDOWS, _SAMPLE_WINDOW = 16, 4096
_ELEMENT: dict[int, np.dtype[np.unsignedinteger[Any]]] = {
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}
_SIZES = struct.Struct(f"<{STREAMS}I")


def _bytes(buffer: memoryview | bytes | bytearray) -> memoryview:
    return memoryview(buffer).cast("B")


def _rotated(elements: npt.NDArray[np.unsignedinteger], itemsize: int) -> ByteArray:
    """The (n, itemsize) plane bytes of ``elements``, each rotated left by one bit."""
    rotated = (elements << 1) | (elements >> (8 * itemsize - 1))
    planes: ByteArray = rotated.astype(_ELEMENT[itemsize], copy=False).view(np.uint8)
    return planes.reshape(-1, itemsize)


def stream_bounds(count: int) -> list[int]:
    """Where each of a plane's 8 streams starts, and where the last ends."""
    share = -(-count // STREAMS)
    return [min(s * share, count) for s in range(STREAMS + 1)]


# -- decoding ------------------------------------------------------------------------------------


class _Reader:
    """A bounds-checked cursor over the payload."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if self.data.nbytes - self.pos < n:
            raise ValueError(f"payload is truncated inside {what}")
        self.pos += n
        return self.data[self.pos - n : self.pos]


class _Coded:
    """The coded planes of a payload, collected while it is read, decoded together."""

    def __init__(self, itemsize: int) -> None:
        self.codes: list[ByteArray] = []
        self.current = [-1] * itemsize
        self.regions: list[memoryview] = []
        self.planes: list[ByteArray] = []
        self.nbytes: list[int] = []
        self.count: list[int] = []
        self.code: list[int] = []
        self.where: list[str] = []

    def add(self, reader: _Reader, plane: ByteArray, code: int, where: str) -> None:
        sizes = _SIZES.unpack(reader.take(_SIZES.size, f"{where}'s stream lengths"))
        self.regions.append(reader.take(sum(sizes), f"{where}'s streams"))
        self.planes.append(plane)
        bounds = stream_bounds(plane.size)
        for s, size in enumerate(sizes):
            self.nbytes.append(size)
            self.count.append(bounds[s + 1] - bounds[s])
            self.code.append(code)
            self.where.append(f"{where}, stream {s}")

    def decode(self) -> None:
        """Decode every stream and write each plane's symbols into it."""
        if not self.planes:
            return
        data = np.frombuffer(b"".join([*self.regions, bytes(8)]), np.uint8)
        nbytes = np.array(self.nbytes, np.intp)
        decoder = StreamDecoder(
            data,
            (np.cumsum(nbytes) - nbytes) * 8,
            nbytes,
            np.array(self.count, np.intp),
            np.array(self.code, np.intp),
            np.stack(self.codes),
        )
        try:
            symbols = decoder.decode()
        except StreamError as exc:
            raise ValueError(f"{self.where[exc.index]}: {exc}") from None
        at = 0
        for plane in self.planes:
            plane[:] = symbols[at : at + plane.size]
            at += plane.size


def _read_lengths(reader: _Reader, where: str) -> ByteArray:
    """A mode-1 plane's code lengths, checked: at most 11 bits, a complete code."""
    lo, hi = reader.take(2, f"{where}'s symbol range")
    if lo >= hi:
        raise ValueError(f"{where}: code symbol range {lo}-{hi} holds fewer than two symbols")
    nibbles = np.frombuffer(reader.take((hi - lo + 2) // 2, f"{where}'s code lengths"), np.uint8)
    if (hi - lo) % 2 == 0 and nibbles[-1] >> 4:
        raise ValueError(f"{where}: the unused nibble of the code lengths is not zero")
    lengths = np.zeros(256, np.uint8)
    lengths[lo : hi + 1] = np.stack([nibbles & 15, nibbles >> 4], axis=1).reshape(-1)[: hi - lo + 1]
    if lengths.max() > CODE_BITS or not kraft_complete(lengths):
        raise ValueError(f"{where}: code lengths are not a complete code of at most 11 bits")
    return lengths


def _read_plane(reader: _Reader, coded: _Coded, plane: ByteArray, k: int, where: str) -> None:
    """One plane of one block from ``reader``: written into ``plane`` now (raw, constant) or
    registered with ``coded`` for decoding."""
    (mode,) = reader.take(1, f"{where}'s mode")
    if mode == MODE_RAW:
        plane[:] = np.frombuffer(reader.take(plane.size, f"{where}'s raw bytes"), np.uint8)
    elif mode == MODE_CONST:
        plane[:] = reader.take(1, f"{where}'s constant")[0]
    elif mode == MODE_HUFF:
        coded.codes.append(_read_lengths(reader, where))
        coded.current[k] = len(coded.codes) - 1
        coded.add(reader, plane, coded.current[k], where)
    elif mode == MODE_AGAIN:
        if coded.current[k] < 0:
            raise ValueError(f"{where}: reuses a code that no earlier block of the plane sent")
        coded.add(reader, plane, coded.current[k], where)
    else:
        raise ValueError(f"{where}: unknown plane mode {mode}")


def check_params(raw_len: int, itemsize: int, block_log2: int) -> None:
    """``ValueError`` unless the parameters are ones the format allows."""
    if itemsize not in ITEMSIZES or raw_len < 0 or raw_len % itemsize:
        raise ValueError(
            f"payload parameters are invalid: itemsize {itemsize} must be 2, 4 or 8 and the "
            f"raw length {raw_len} a multiple of it"
        )
    if block_log2 not in BLOCK_LOG2_RANGE:
        raise ValueError(f"payload parameters are invalid: block_log2 {block_log2} is not 8-24")


def decode(
    payload: memoryview | bytes | bytearray, raw_len: int, itemsize: int, block_log2: int
) -> memoryview:
    """The ``raw_len`` bytes ``payload`` encodes; ``ValueError`` naming the block, plane and
    stream if it does not decode exactly (the C decoder's contract, case for case)."""
    check_params(raw_len, itemsize, block_log2)
    data = _bytes(payload)
    n, block = raw_len // itemsize, 1 << block_log2
    blocks = -(-n // block)
    # Every plane of every block takes two bytes at least: refuse before allocating raw_len.
    if data.nbytes // 2 // itemsize < blocks:
        raise ValueError(
            f"payload of {data.nbytes} bytes is too short for {raw_len} raw bytes (truncated)"
        )
    planes = np.empty((n, itemsize), np.uint8)
    reader, coded = _Reader(data), _Coded(itemsize)
    for b in range(blocks):
        rows = planes[b * block : (b + 1) * block]
        for k in range(itemsize):
            _read_plane(reader, coded, rows[:, k], k, f"block {b}, plane {k}")
    if reader.pos != data.nbytes:
        raise ValueError(f"payload has {data.nbytes - reader.pos} extra bytes after its last block")
    coded.decode()
    elements = planes.view(_ELEMENT[itemsize]).reshape(-1)
    out = elements >> 1
    np.left_shift(elements, 8 * itemsize - 1, out=elements)
    np.bitwise_or(out, elements, out=out)
    return out.data.cast("B")


# -- encoding ------------------------------------------------------------------------------------


def huff_lengths(counts: list[int]) -> ByteArray:
    """Optimal code lengths of at most 11 bits for the symbols with nonzero ``counts`` (two or
    more), by package-merge, with the C encoder's order and tie-breaks."""
    keyed = sorted((c << 8) | s for s, c in enumerate(counts) if c)
    leaf_weight = [k >> 8 for k in keyed]
    leaf_symbol = [k & 0xFF for k in keyed]
    weights, items = [leaf_weight], [leaf_symbol]
    for _ in range(1, CODE_BITS):
        below, packages = weights[-1], len(weights[-1]) // 2
        weight: list[int] = []
        item: list[int] = []
        leaf = pkg = 0
        while leaf < len(keyed) or pkg < packages:
            pw = below[2 * pkg] + below[2 * pkg + 1] if pkg < packages else 0
            if pkg >= packages or (leaf < len(keyed) and leaf_weight[leaf] <= pw):
                weight.append(leaf_weight[leaf])
                item.append(leaf_symbol[leaf])
                leaf += 1
            else:
                weight.append(pw)
                item.append(-1)
                pkg += 1
        weights.append(weight)
        items.append(item)
    lengths = np.zeros(256, np.uint8)
    take = 2 * len(keyed) - 2
    for item in reversed(items):
        if take <= 0:
            break
        chosen = item[:take]
        for symbol in chosen:
            if symbol >= 0:
                lengths[symbol] += 1
        take = 2 * chosen.count(-1)
    return lengths


def _pack(symbols: ByteArray, lengths: ByteArray, codes: npt.NDArray[np.intp]) -> bytes:
    """``symbols`` as one stream: codes back to back, least significant bit first."""
    if not symbols.size:
        return b""
    lens = lengths.astype(np.intp)[symbols]
    end = np.cumsum(lens)
    start = end - lens
    nbytes = (int(end[-1]) + 7) // 8
    shifted = codes[symbols] << (start & 7)
    at = start >> 3
    # Codes occupy disjoint bits, so summing each byte's shares is OR-ing them.
    out = np.zeros(nbytes + 2)
    for k in range(3):
        out += np.bincount(at + k, (shifted >> (8 * k)) & 0xFF, nbytes + 2)
    return out[:nbytes].astype(np.uint8).tobytes()


def _coded_size(hist: npt.NDArray[np.intp], lengths: ByteArray) -> npt.NDArray[np.intp]:
    """Bytes per stream that coding the streams' symbols (per-stream counts) takes."""
    bits: npt.NDArray[np.intp] = hist @ lengths.astype(np.intp)
    return (bits + 7) // 8


def _encode_plane(
    plane: ByteArray, try_huff: bool, sent: ByteArray | None
) -> tuple[bytes, ByteArray | None]:
    """One plane of one block as stored, and the plane's last sent lengths after it."""
    if try_huff:
        bounds = stream_bounds(plane.size)
        hist = np.stack(
            [np.bincount(plane[bounds[s] : bounds[s + 1]], minlength=256) for s in range(STREAMS)]
        )
        total = hist.sum(axis=0)
        if np.count_nonzero(total) == 1:
            return bytes([MODE_CONST, int(plane[0])]), sent
        lengths = huff_lengths(total.tolist())
        present = np.flatnonzero(lengths)
        lo, hi = int(present[0]), int(present[-1])
        own_sizes = _coded_size(hist, lengths)
        own = 3 + (hi - lo + 2) // 2 + 4 * STREAMS + int(own_sizes.sum())
        reuse = sent is not None and not np.any((total > 0) & (sent == 0))
        if reuse and sent is not None:
            again_sizes = _coded_size(hist, sent)
            reuse = 1 + 4 * STREAMS + int(again_sizes.sum()) <= own
        if reuse and sent is not None:
            use, sizes, head = sent, again_sizes, bytes([MODE_AGAIN])
        else:
            nibbles = np.zeros((hi - lo + 2) // 2 * 2, np.uint8)
            nibbles[: hi - lo + 1] = lengths[lo : hi + 1]
            use, sizes = lengths, own_sizes
            head = bytes([MODE_HUFF, lo, hi]) + (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()
        if len(head) + 4 * STREAMS + int(sizes.sum()) <= plane.size:
            codes = lsb_codes(use)
            streams = [_pack(plane[bounds[s] : bounds[s + 1]], use, codes) for s in range(STREAMS)]
            return b"".join([head, _SIZES.pack(*sizes.tolist()), *streams]), use
    return bytes([MODE_RAW]) + plane.tobytes(), sent


def _check_encode(data: memoryview, itemsize: int, block_log2: int) -> None:
    if itemsize not in ITEMSIZES or data.nbytes % itemsize or block_log2 not in BLOCK_LOG2_RANGE:
        raise ValueError("itemsize must be 2, 4 or 8 and block_log2 8-24")


def encode(raw: memoryview | bytes | bytearray, itemsize: int, mask: int, block_log2: int) -> bytes:
    """The payload for ``raw``: blocks of ``2**block_log2`` elements, the planes in ``mask``
    (bit k for plane k) Huffman-coded where that is smaller, the others raw."""
    data = _bytes(raw)
    _check_encode(data, itemsize, block_log2)
    planes = _rotated(np.frombuffer(data, _ELEMENT[itemsize]), itemsize)
    block = 1 << block_log2
    sent: list[ByteArray | None] = [None] * itemsize
    parts: list[bytes] = []
    for lo in range(0, planes.shape[0], block):
        rows = planes[lo : lo + block]
        for k in range(itemsize):
            plane = np.ascontiguousarray(rows[:, k])
            part, sent[k] = _encode_plane(plane, bool((mask >> k) & 1), sent[k])
            parts.append(part)
    return b"".join(parts)


def estimate(
    raw: memoryview | bytes | bytearray, itemsize: int, plane_min_gain: float
) -> tuple[int, float]:
    """From a sample (the C estimate's windows): the planes worth a Huffman code (bit k for
    plane k; the exponent plane always) and the share of raw bytes coding them would save."""
    data = _bytes(raw)
    if itemsize not in ITEMSIZES or data.nbytes % itemsize:
        raise ValueError("itemsize must be 2, 4 or 8")
    elements = np.frombuffer(data, _ELEMENT[itemsize])
    n = elements.size
    windows = 1 if n <= _SAMPLE_WINDOWS * _SAMPLE_WINDOW else _SAMPLE_WINDOWS
    width = n if windows == 1 else _SAMPLE_WINDOW
    stride = 0 if windows == 1 else (n - width) // (windows - 1)
    sample = np.concatenate([elements[k * stride : k * stride + width] for k in range(windows)])
    planes = _rotated(sample, itemsize)
    mask, saved = 0, 0.0
    for p in range(itemsize if sample.size else 0):
        bits = 0.0
        for count in np.bincount(planes[:, p], minlength=256).tolist():
            if count:
                q = count / sample.size
                bits -= q * math.log2(q)
        if p == itemsize - 1 or 8.0 - bits >= 8.0 * plane_min_gain:
            mask |= 1 << p
            saved += 8.0 - bits
    return mask, saved / (8.0 * itemsize) if n else 0.0
