"""Payloads the format allows but the real encoder never writes, from an encoder of the format
written apart from ``_fpcodec.c`` (from its layout comment), with their exact raw bytes.

The real encoder only emits codes that package-merge builds from a block's histogram. The
decoder must take any complete code the layout can express: every plane Huffman-coded, random
complete codes from 2 to 256 symbols with lengths up to the 11-bit limit, gaps (absent
symbols) inside the symbol range, a symbol range at either end of the byte, the previous
block's code reused on data it was not built for, and blocks whose planes mix every mode. Each
synthetic payload comes with the raw bytes it must decode to: an independent oracle for the
decoder's Huffman path, which the mutation engine then damages like any other sample.
"""

from __future__ import annotations

import random
import struct

import numpy as np

from fuzz.payloads import (
    MODE_AGAIN,
    MODE_CONST,
    MODE_HUFF,
    MODE_RAW,
    STREAMS,
    Sample,
    layout,
    merge,
)

CODE_BITS = 11


def random_lengths(rng: random.Random, symbols: int) -> list[int]:
    """The leaf depths of a random complete binary tree with ``symbols`` leaves, none deeper
    than the 11-bit limit; sometimes deliberately lopsided (long codes)."""
    leaves = [0]
    lopsided = rng.random() < 0.3
    while len(leaves) < symbols:
        open_ = [i for i, depth in enumerate(leaves) if depth < CODE_BITS]
        i = max(open_, key=lambda j: leaves[j]) if lopsided else rng.choice(open_)
        depth = leaves.pop(i)
        leaves += [depth + 1, depth + 1]
    return leaves


def canonical(lengths: dict[int, int]) -> dict[int, tuple[int, int]]:
    """symbol -> (its canonical code bit-reversed for an LSB-first stream, its length)."""
    per_len = [0] * (CODE_BITS + 1)
    for length in lengths.values():
        per_len[length] += 1
    next_code, code = [0] * (CODE_BITS + 1), 0
    for length in range(1, CODE_BITS + 1):
        code = (code + per_len[length - 1]) << 1
        next_code[length] = code
    out = {}
    for symbol in sorted(lengths):
        length = lengths[symbol]
        value = next_code[length]
        next_code[length] += 1
        out[symbol] = (int(format(value, f"0{length}b")[::-1], 2), length)
    return out


def _stream(symbols: np.ndarray, codes: dict[int, tuple[int, int]]) -> bytes:
    acc = bits = 0
    for symbol in symbols.tolist():
        code, length = codes[symbol]
        acc |= code << bits
        bits += length
    return acc.to_bytes((bits + 7) // 8, "little")


def huffman_plane(plane: np.ndarray, lengths: dict[int, int], again: bool) -> bytes:
    """A mode-1 plane (or mode 3, reusing ``lengths`` sent before) coding ``plane``."""
    codes = canonical(lengths)
    if again:
        head = bytes([MODE_AGAIN])
    else:
        lo, hi = min(lengths), max(lengths)
        nibs = [lengths.get(s, 0) for s in range(lo, hi + 1)] + [0]
        table = bytes(nibs[i] | (nibs[i + 1] << 4) for i in range(0, hi - lo + 1, 2))
        head = bytes([MODE_HUFF, lo, hi]) + table
    n = len(plane)
    q = -(-n // STREAMS)
    bounds = [min(s * q, n) for s in range(STREAMS + 1)]
    streams = [_stream(plane[bounds[s] : bounds[s + 1]], codes) for s in range(STREAMS)]
    return head + struct.pack(f"<{STREAMS}I", *map(len, streams)) + b"".join(streams)


def _random_code(rng: random.Random) -> dict[int, int]:
    count = rng.choice([2, 2, 3, 5, 16, rng.randint(2, 256)])
    lo = rng.choice([0, rng.randint(0, 256 - count), 256 - count])
    span = rng.randint(count, min(256 - lo, count * 3))
    symbols = sorted(rng.sample(range(lo, lo + span), count))
    return dict(zip(symbols, random_lengths(rng, count), strict=True))


def _coded_values(rng: random.Random, code: dict[int, int], n: int) -> np.ndarray:
    symbols = list(code)
    weights = [rng.random() ** 3 for _ in symbols]
    return np.array(rng.choices(symbols, weights, k=n), dtype=np.uint8)


def sample(rng: random.Random, index: int) -> Sample:
    """One synthetic payload: a random itemsize, small block and count, random plane modes."""
    itemsize = rng.choice([2, 2, 4, 8])
    block_log2 = rng.choice([8, 8, 9])
    count = rng.choice([1, 9, 100, 256, 257, 600, 1100])
    block = 1 << block_log2
    planes = np.zeros((count, itemsize), dtype=np.uint8)
    sent: dict[int, dict[int, int]] = {}
    parts = []
    for first in range(0, count, block):
        n = min(block, count - first)
        for k in range(itemsize):
            modes = ["huff", "huff", "huff", "raw", "const"] + ["again"] * 3 * (k in sent)
            mode = rng.choice(modes)
            if mode == "raw":
                values = np.array([rng.randrange(256) for _ in range(n)], dtype=np.uint8)
                parts.append(bytes([MODE_RAW]) + values.tobytes())
            elif mode == "const":
                values = np.full(n, rng.randrange(256), dtype=np.uint8)
                parts.append(bytes([MODE_CONST, int(values[0])]))
            else:
                code = sent[k] if mode == "again" else _random_code(rng)
                sent[k] = code
                values = _coded_values(rng, code, n)
                parts.append(huffman_plane(values, code, again=mode == "again"))
            planes[first : first + n, k] = values
    raw, payload = merge(planes, itemsize), b"".join(parts)
    fields = layout(payload, len(raw), itemsize, block_log2)
    if fields is None:
        raise AssertionError("a synthetic payload does not parse")
    name = f"synthetic#{index}/itemsize={itemsize}/n={count}/block=2**{block_log2}"
    return Sample(name, raw, payload, itemsize, block_log2, tuple(fields))
