"""The reference float codec (ckptstore.cas.fpref) against the C extension: the same estimate,
the same payload byte for byte, the raw bytes back from either decoder, and the same verdict on
damaged payloads (the reference raises ValueError exactly where the C decoder does).

tests/cas/test_fpcodec.py runs the codec's own tests with each implementation; here the two are
compared directly, on data shaped to reach every layout: raw, constant, coded and reused-code
planes, blocks of different scales, codes that never resynchronise (the reference decoder's
hardest case), sizes around stream and block boundaries, and the empty payload.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

import numpy as np
import pytest

from ckptstore.cas import fpcodec, fpref, fpstreams

if fpcodec.native is None:
    pytest.skip(f"compares with the C extension: {fpcodec.NATIVE_ERROR}", allow_module_level=True)
NATIVE = fpcodec.native

FLOAT = {2: np.float32, 4: np.float32, 8: np.float64}


def as_dtype(values: np.ndarray, itemsize: int, half: str) -> bytes:
    """``values`` as little-endian floats of ``itemsize`` (2: bf16 or fp16, per ``half``)."""
    if itemsize == 2 and half == "bf16":
        bits = values.astype("<f4").view("<u4")
        return ((bits + 0x8000) >> 16).astype("<u2").tobytes()
    dtype = {2: "<f2", 4: "<f4", 8: "<f8"}[itemsize]
    return values.astype(dtype).tobytes()


def weights(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal(n) * 0.02


def squares(rng: np.random.Generator, n: int) -> np.ndarray:
    """exp_avg_sq-like: tiny and never negative (a mantissa plane worth coding)."""
    return (rng.standard_normal(n) * 1e-3) ** 2 * 1e-3


def eight_exponents(rng: np.random.Generator, n: int) -> np.ndarray:
    """Eight equally likely powers of two: a fixed 3-bit code, which never resynchronises."""
    return 2.0 ** rng.integers(-8, 0, n).astype(np.float64)


def scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """Quarters of very different scales, one constant: blocks that need their own codes."""
    q = n // 4
    parts = [weights(rng, q), weights(rng, q) * 1e4, np.full(q, 3.0), weights(rng, n - 3 * q)]
    return np.concatenate(parts)


def skewed(rng: np.random.Generator, n: int) -> np.ndarray:
    """Nearly all 1.0: 1-bit codes, whose zero padding decodes as extra codes."""
    return np.where(rng.random(n) < 0.97, 1.0, 2.0)


KINDS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "weights": weights,
    "squares": squares,
    "eight exponents": eight_exponents,
    "scales": scales,
    "noise": weights,  # replaced by random bytes in sample()
    "skewed": skewed,
}
DTYPES = {"bf16": (2, "bf16"), "fp16": (2, "fp16"), "fp32": (4, ""), "fp64": (8, "")}


def sample(kind: str, rng: np.random.Generator, n: int, dtype: str) -> bytes:
    """``n`` elements of ``kind`` as ``dtype``; "noise" is random bytes (NaN payloads and all:
    coding never pays on it, so planes stay raw even where the mask asks for a code)."""
    itemsize, half = DTYPES[dtype]
    if kind == "noise":
        return rng.bytes(n * itemsize)
    return as_dtype(KINDS[kind](rng, n), itemsize, half)


#: Around one stream, the eight streams, and blocks of 2**8 elements.
SIZES = [0, 1, 2, 7, 8, 9, 64, 255, 256, 257, 511, 513, 3 * 256 + 77]


def check_same(raw: bytes, itemsize: int, block_log2: int) -> None:
    """Estimate and encode agree byte for byte; both decoders return ``raw`` from C's payload,
    for the estimate's mask, every plane coded and none."""
    mask, gain = NATIVE.estimate(raw, itemsize, fpcodec.PLANE_MIN_GAIN)
    assert fpref.estimate(raw, itemsize, fpcodec.PLANE_MIN_GAIN) == (mask, gain)
    for planes in {mask, (1 << itemsize) - 1, 0}:
        payload = NATIVE.encode(raw, itemsize, planes, block_log2)
        assert fpref.encode(raw, itemsize, planes, block_log2) == payload
        assert bytes(NATIVE.decode(payload, len(raw), itemsize, block_log2)) == raw
        assert bytes(fpref.decode(payload, len(raw), itemsize, block_log2)) == raw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_the_reference_matches_the_c_codec_byte_for_byte(kind: str, dtype: str) -> None:
    rng = np.random.default_rng(sorted(KINDS).index(kind))
    for n in SIZES:
        check_same(sample(kind, rng, n, dtype), DTYPES[dtype][0], 8)


@pytest.mark.parametrize("n", [(1 << 18) - 1, (1 << 18) + 1, 400_000])
def test_the_reference_matches_at_the_default_block_size(n: int) -> None:
    rng = np.random.default_rng(n)
    for kind in ("weights", "eight exponents"):
        check_same(sample(kind, rng, n, "bf16"), 2, fpcodec.BLOCK_LOG2)


def test_tight_chunk_budgets_decode_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference decoder walks its lanes in chunks cut by a memory budget; a chunk that
    ends inside a stream hands the next its entry, whatever the budget."""
    rng = np.random.default_rng(3)
    for kind in ("weights", "eight exponents", "skewed"):
        raw = sample(kind, rng, 20_000, "bf16")
        payload = NATIVE.encode(raw, 2, 0b11, 12)
        for budget in (1, 3_000, 20_000):
            monkeypatch.setattr(fpstreams, "CHUNK_BUDGET", budget)
            assert bytes(fpref.decode(payload, len(raw), 2, 12)) == raw


def mutate(payload: bytes, rng: random.Random) -> bytes:
    """``payload`` with a random kind of damage: flipped bits, a replaced, inserted or removed
    byte, or a cut."""
    damaged = bytearray(payload)
    how = rng.random()
    if how < 0.5:
        for _ in range(rng.choice([1, 1, 2, 5])):
            damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
    elif how < 0.7:
        damaged[rng.randrange(len(damaged))] = rng.randrange(256)
    elif how < 0.8:
        del damaged[rng.randrange(len(damaged)) :]
    elif how < 0.9:
        damaged.insert(rng.randrange(len(damaged) + 1), rng.randrange(256))
    else:
        del damaged[rng.randrange(len(damaged))]
    return bytes(damaged)


def verdict(
    decoder: Callable[[bytes, int, int, int], bytearray | memoryview],
    payload: bytes,
    raw_len: int,
    itemsize: int,
    block_log2: int,
) -> bytes | None:
    """What ``decoder`` makes of ``payload``: the bytes, or None for a ValueError."""
    try:
        return bytes(decoder(payload, raw_len, itemsize, block_log2))
    except ValueError:
        return None


@pytest.mark.parametrize(
    ("kind", "dtype", "n", "block_log2"),
    [
        ("weights", "bf16", 3 * 256 + 77, 8),
        ("squares", "fp32", 2 * 256 + 5, 8),
        ("eight exponents", "bf16", 5000, 10),
        ("skewed", "fp16", 1500, 9),
    ],
)
def test_both_decoders_refuse_the_same_damaged_payloads(
    kind: str, dtype: str, n: int, block_log2: int
) -> None:
    itemsize = DTYPES[dtype][0]
    raw = sample(kind, np.random.default_rng(n), n, dtype)
    payload = NATIVE.encode(raw, itemsize, (1 << itemsize) - 1, block_log2)
    rng = random.Random(n)
    refused = 0
    for _ in range(150):
        damaged = mutate(payload, rng)
        raw_len = len(raw) if rng.random() < 0.9 else rng.randrange(2 * len(raw)) & -itemsize
        expected = verdict(NATIVE.decode, damaged, raw_len, itemsize, block_log2)
        assert verdict(fpref.decode, damaged, raw_len, itemsize, block_log2) == expected
        refused += expected is None
    assert refused > 30


def test_a_stream_longer_than_its_codes_could_be_is_refused_before_it_is_walked() -> None:
    """Work stays bounded by the raw length: a 2-element block whose stream claims a megabyte
    (present in the payload) is refused from its lengths alone, by both decoders."""
    plane = b"\x01\x05\x06\x11" + struct.pack("<8I", 1 << 20, 1, *[0] * 6)
    payload = b"\x00\x11\x22" + plane + bytes(1 << 20) + b"\x01"
    for decoder in (NATIVE.decode, fpref.decode):
        assert verdict(decoder, payload, 4, 2, 8) is None
    with pytest.raises(ValueError, match=r"block 0, plane 1, stream 0: .*cannot hold 1 codes"):
        fpref.decode(payload, 4, 2, 8)


def test_errors_name_the_block_plane_and_what_is_wrong() -> None:
    raw = sample("weights", np.random.default_rng(0), 3 * 256, "bf16")
    payload = NATIVE.encode(raw, 2, 0b10, 8)
    with pytest.raises(ValueError, match="extra bytes"):
        fpref.decode(payload + b"\0", len(raw), 2, 8)
    with pytest.raises(ValueError, match="too short"):
        fpref.decode(payload[:10], 1 << 30, 2, 8)
    with pytest.raises(ValueError, match=r"block 2, plane 1's (streams|stream lengths)"):
        fpref.decode(payload[:-5], len(raw), 2, 8)
    with pytest.raises(ValueError, match="block 0, plane 0: unknown plane mode 7"):
        fpref.decode(b"\x07" + payload[1:], len(raw), 2, 8)
