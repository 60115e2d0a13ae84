"""Types of the float codec's C extension (ckptstore/cas/_fpcodec.c); see ckptstore.cas.fpcodec.

ckptstore.cas.fpref implements the same three functions in Python, byte for byte the same (its
docstring specifies the payload format); the extension is optional.
"""

from typing_extensions import Buffer

def estimate(raw: Buffer, itemsize: int, plane_min_gain: float, /) -> tuple[int, float]:
    """From a sample: the planes worth coding (bit k for plane k) and the share of raw bytes
    coding them would save."""

def encode(raw: Buffer, itemsize: int, mask: int, block_log2: int, /) -> bytes:
    """The payload for ``raw``: the planes in ``mask`` Huffman-coded per block where smaller."""

def decode(payload: Buffer, raw_len: int, itemsize: int, block_log2: int, /) -> bytearray:
    """The ``raw_len`` bytes ``payload`` encodes; ValueError if it does not decode exactly."""
