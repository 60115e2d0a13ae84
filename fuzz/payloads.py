"""Valid float-codec payloads from the real encoder, and where each field of one lies.

The corpus covers what the decoder must take apart: bf16/fp16/fp32/fp64 (itemsize 2, 4, 4,
8), small blocks (so a payload of several blocks stays a few KiB and decodes in microseconds),
a short last block, the empty payload, and data that makes the encoder pick every plane mode:
raw (random bytes), constant (zeros, one value), Huffman with its own code, and Huffman with
the previous block's code (several blocks of one distribution), including codes that reach
the 11-bit length limit (a long-tailed exponent distribution).

:func:`layout` walks a payload the way ``_fpcodec.c`` does, without decoding any stream, and
names each field's place, so that the mutation engine can forge one field at a time.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np

STREAMS = 8
MODE_RAW, MODE_HUFF, MODE_CONST, MODE_AGAIN = 0, 1, 2, 3
#: (name, itemsize, numpy type the values are generated in) of each float type.
DTYPES = (("bf16", 2, np.float32), ("fp16", 2, np.float16), ("fp32", 4, np.float32))
DTYPES += (("fp64", 8, np.float64),)
#: Element counts around the stream split (8), the small block sizes and their multiples.
COUNTS = (0, 1, 2, 7, 8, 9, 15, 17, 63, 100, 255, 256, 257, 300, 511, 513, 700, 1030)
BLOCK_LOG2S = (8, 8, 8, 9, 10, 12)


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a payload: ``kind`` at ``[offset, offset + length)``, of plane ``plane``
    of block ``block`` (which starts at element ``first``)."""

    kind: str
    offset: int
    length: int
    block: int
    plane: int
    first: int


@dataclass(frozen=True, slots=True)
class Sample:
    """A valid payload, the raw bytes it encodes, and the decode parameters."""

    name: str
    raw: bytes
    payload: bytes
    itemsize: int
    block_log2: int
    fields: tuple[Field, ...]


def _values(kind: str, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` values of one distribution a checkpoint (or an attacker) might hold."""
    if kind == "weights":
        return rng.standard_normal(count) * 0.02
    if kind == "adam_sq":
        return (rng.standard_normal(count) * 1e-3) ** 2
    if kind == "zeros":
        return np.zeros(count)
    if kind == "constant":
        return np.full(count, 1.5)
    if kind == "two_values":
        return rng.choice([0.5, -2.0], count)
    if kind == "long_tail":  # exponents spread geometrically: codes up to the length limit
        return 2.0 ** -rng.geometric(0.35, count).astype(np.float64) * rng.choice([-1, 1], count)
    if kind == "specials":
        pool = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-310, -1e-45, 6e-8, 65504.0, 1.0]
        return rng.choice(np.array(pool), count)
    if kind == "blocky":  # each 256 elements another regime: per-block modes and codes
        parts = [np.full(256, 3.0), rng.standard_normal(256), rng.standard_normal(256) * 1e6]
        return np.resize(np.concatenate(parts), count)
    raise ValueError(kind)


KINDS = ("weights", "adam_sq", "zeros", "constant", "two_values", "long_tail", "specials")
KINDS += ("blocky", "random_bytes")


def _raw(dtype: str, itemsize: int, np_type: type, kind: str, count: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    if kind == "random_bytes":
        return rng.integers(0, 256, count * itemsize, dtype=np.uint8).tobytes()
    with np.errstate(all="ignore"):
        values = _values(kind, count, rng).astype(np_type)
    if dtype == "bf16":  # the top half of each fp32, as torch's bfloat16 holds it
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return values.tobytes()


def corpus(codec: ModuleType, size: int, seed: int) -> list[Sample]:
    """``size`` valid payloads encoded by ``codec`` (a build of ``_fpcodec``), every dtype,
    kind, small block size and plane mask, plus the empty payload of each itemsize."""
    rng = random.Random(seed)
    samples = []
    for i in range(size):
        dtype, itemsize, np_type = DTYPES[i % len(DTYPES)]
        kind = KINDS[(i // len(DTYPES)) % len(KINDS)]
        count = rng.choice(COUNTS)
        block_log2 = rng.choice(BLOCK_LOG2S)
        raw = _raw(dtype, itemsize, np_type, kind, count, seed * 100_003 + i)
        full = (1 << itemsize) - 1
        mask = rng.choice([1 << (itemsize - 1), full, rng.randrange(full + 1)])
        if rng.random() < 0.3:
            mask = codec.estimate(raw, itemsize, 0.02)[0]
        payload = codec.encode(raw, itemsize, mask, block_log2)
        fields = layout(payload, len(raw), itemsize, block_log2)
        if fields is None:
            raise AssertionError(f"the encoder's own payload does not parse ({dtype} {kind})")
        name = f"{dtype}/{kind}/n={count}/block=2**{block_log2}/mask={mask:#x}"
        samples.append(Sample(name, raw, payload, itemsize, block_log2, tuple(fields)))
    return samples


def _huffman_head(payload: bytes, at: int, add: Callable[[str, int, int], None]) -> int | None:
    """The code table of a mode-1 plane at ``at`` (after its mode byte); its end, or None."""
    if at + 2 > len(payload) or payload[at] >= payload[at + 1]:
        return None
    add("range", at, 2)
    count = payload[at + 1] - payload[at] + 1
    add("nibbles", at + 2, (count + 1) // 2)
    return at + 2 + (count + 1) // 2


def layout(payload: bytes, raw_len: int, itemsize: int, block_log2: int) -> list[Field] | None:
    """Every field of ``payload`` in order, or None where its structure is inconsistent (the
    code tables' and streams' contents are not checked: that is the decoder's work)."""
    count, block = raw_len // itemsize, 1 << block_log2
    fields: list[Field] = []
    at = 0
    for b, first in enumerate(range(0, count, block)):
        n = min(block, count - first)
        for k in range(itemsize):

            def add(kind: str, offset: int, length: int, b: int = b, k: int = k) -> None:
                fields.append(Field(kind, offset, length, b, k, b * block))

            if at >= len(payload):
                return None
            mode = payload[at]
            add("mode", at, 1)
            at += 1
            if mode == MODE_RAW:
                add("raw", at, n)
                at += n
                continue
            if mode == MODE_CONST:
                add("const", at, 1)
                at += 1
                continue
            if mode == MODE_HUFF:
                end = _huffman_head(payload, at, add)
                if end is None:
                    return None
                at = end
            elif mode != MODE_AGAIN:
                return None
            if at + 4 * STREAMS > len(payload):
                return None
            sizes = struct.unpack_from(f"<{STREAMS}I", payload, at)
            add("sizes", at, 4 * STREAMS)
            at += 4 * STREAMS
            for size in sizes:
                add("stream", at, size)
                at += size
    return fields if at == len(payload) else None


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def split(raw: bytes, itemsize: int) -> np.ndarray:
    """The byte planes of ``raw`` as an (elements, itemsize) array: each element rotated left
    by one bit (sign to bit 0), column k its byte k."""
    bits = np.uint64(8 * itemsize - 1)
    v = np.frombuffer(raw, dtype=_UINT[itemsize]).astype(np.uint64)
    rotated = ((v << np.uint64(1)) | (v >> bits)).astype(_UINT[itemsize])
    return rotated.view(np.uint8).reshape(-1, itemsize).copy()


def merge(planes: np.ndarray, itemsize: int) -> bytes:
    """The inverse of :func:`split`."""
    v = np.ascontiguousarray(planes).view(_UINT[itemsize]).reshape(-1).astype(np.uint64)
    top = np.uint64(8 * itemsize - 1)
    mask = np.uint64((1 << (8 * itemsize)) - 1)
    return (((v >> np.uint64(1)) | (v << top)) & mask).astype(_UINT[itemsize]).tobytes()
