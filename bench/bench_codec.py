"""Float codec benchmark: ckptstore's ``fphuff`` against zipnn and ckptstore's older ``bgzstd``.

Run: ``.venv/bin/python bench/bench_codec.py [--size-mib 256] [--reps 3] [--json PATH]``
(zipnn comes with ``pip install -e '.[bench]'``).

One process, one thread per codec call (what one of the writer's threads does), the same
tensors for every contender: bf16, fp16 and fp32 weights (``randn * 0.02``) and fp32 Adam
moments (``exp_avg`` small and signed, ``exp_avg_sq`` its square: small and non-negative), each
``--size-mib`` of raw bytes, deterministic seeds. Each repetition runs the contenders in turn,
in an order that rotates from one repetition to the next, and every decode is checked bit for
bit against the tensor; the table shows medians (and the range over repetitions) of the ratio
raw/stored, encode MB/s and decode MB/s (MB of raw bytes, 10**6). ``ours/zipnn`` above 1.0 is
better for every column. The goal is fphuff >= zipnn on every row.

zipnn 0.5.4 is run as ``ZipNN(threads=1, input_format="byte", bytearray_dtype=...)``. Its
``compress`` rewrites the buffer it is given (it moves the sign bit in place, even in a
``bytes`` object), so each of its encodes gets a private copy of the tensor (made untimed), and
its decodes are checked against the untouched tensor.

Beside them, on the bf16 and fp32 weights: the pure-Python reference decoder
(``ckptstore.cas.fpref``, what an installation built without a C compiler reads fphuff blobs
with) against the C one, decode MB/s of raw output, the two alternating in each repetition on
the same payload and checked bit for bit ("info" rows: a floor, not a goal).

``--json PATH`` writes one row per tensor and metric: ``{"work", "ours", "peer", "peer_value",
"unit", "ratio", "goal", "met"}``. Exit status 1 if any round trip is not bit-exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptstore.cas import fpref
from ckptstore.cas.codec import BGZSTD
from ckptstore.cas.codecs import Codec, Encoded
from ckptstore.cas.fpcodec import NATIVE_ERROR, FloatPlaneCodec

MiB = 1 << 20
#: The tensors the reference decoder is timed on.
REFERENCE_WORKS = ("bf16 weights", "fp32 weights")


@dataclass(frozen=True)
class Work:
    """One tensor to compress: its name, raw bytes, element size and zipnn's dtype name."""

    name: str
    raw: memoryview
    itemsize: int
    zipnn_dtype: str


def tensors(size_mib: int) -> list[Work]:
    """The benchmark's tensors, ``size_mib`` of raw bytes each, from fixed seeds."""
    g = torch.Generator().manual_seed(1234)
    count16 = size_mib * MiB // 2
    count32 = size_mib * MiB // 4
    weights = torch.randn(count16, generator=g) * 0.02
    exp_avg = torch.randn(count32, generator=g) * 1e-3
    exp_avg_sq = (torch.randn(count32, generator=g) * 1e-3) ** 2
    cases = [
        ("bf16 weights", weights.to(torch.bfloat16), "bfloat16"),
        ("fp16 weights", weights.to(torch.float16), "float16"),
        ("fp32 weights", weights[:count32].clone(), "float32"),
        ("fp32 exp_avg", exp_avg, "float32"),
        ("fp32 exp_avg_sq", exp_avg_sq, "float32"),
    ]
    return [
        Work(name, memoryview(t.view(torch.uint8).numpy()).cast("B"), t.element_size(), dtype)
        for name, t, dtype in cases
    ]


class CkptstoreCodec:
    """A ckptstore codec through its own encode/decode, as the blob writer and reader call it
    (threshold 0, so it never declines)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.name = codec.name

    def prepare(self, work: Work) -> memoryview:
        """What encode reads: the tensor's bytes themselves."""
        return work.raw

    def encode(self, work: Work, raw: memoryview) -> Encoded:
        enc = self.codec.encode(raw, itemsize=work.itemsize, float_like=True, threshold=0.0)
        if enc is None or enc.codec is not self.codec:
            raise SystemExit(f"{self.name} declined {work.name}: nothing to compare")
        return enc

    def stored(self, enc: Encoded) -> tuple[int, Any]:
        """Stored length, and what decode reads: the parts back to back, as a stored object
        holds them (untimed)."""
        return enc.stored_len, (b"".join(enc.payload), enc.itemsize, enc.params)

    def decode(self, work: Work, stored: Any) -> memoryview:
        payload, itemsize, params = stored
        return self.codec.decode(
            memoryview(payload), work.raw.nbytes, itemsize=itemsize, params=params, where=work.name
        )


class Zipnn:
    """zipnn 0.5.4 with one thread, on raw bytes of the tensor's dtype."""

    name = "zipnn"

    def __init__(self) -> None:
        import zipnn  # the benchmark's only use of it: pip install -e '.[bench]'

        self._zipnn = zipnn
        self._by_dtype: dict[str, Any] = {}

    def _for(self, work: Work) -> Any:
        if work.zipnn_dtype not in self._by_dtype:
            self._by_dtype[work.zipnn_dtype] = self._zipnn.ZipNN(
                threads=1, input_format="byte", bytearray_dtype=work.zipnn_dtype
            )
        return self._by_dtype[work.zipnn_dtype]

    def prepare(self, work: Work) -> bytearray:
        """A private copy of the tensor's bytes: zipnn's compress rewrites its input."""
        return bytearray(work.raw)

    def encode(self, work: Work, raw: bytearray) -> bytes:
        return bytes(self._for(work).compress(raw))

    def stored(self, enc: bytes) -> tuple[int, Any]:
        """Stored length, and what decode reads: the stream itself."""
        return len(enc), enc

    def decode(self, work: Work, stored: Any) -> bytearray:
        return self._for(work).decompress(stored)  # type: ignore[no-any-return]


@dataclass
class Sample:
    ratio: float
    encode_mbs: list[float]
    decode_mbs: list[float]


def measure(contenders: list[Any], works: list[Work], reps: int) -> dict[tuple[str, str], Sample]:
    """Every contender on every tensor, ``reps`` times, in a rotating order; exits 1 on a
    round trip that is not bit-exact."""
    samples: dict[tuple[str, str], Sample] = {}
    for work in works:
        expected = work.raw.tobytes()
        for rep in range(reps):
            shift = rep % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                raw = contender.prepare(work)
                t0 = time.perf_counter()
                enc = contender.encode(work, raw)
                t1 = time.perf_counter()
                stored_len, stored = contender.stored(enc)
                del enc, raw
                t2 = time.perf_counter()
                out = contender.decode(work, stored)
                t3 = time.perf_counter()
                if bytes(out) != expected:
                    print(f"{contender.name} round trip of {work.name} is not bit-exact")
                    sys.exit(1)
                del out, stored
                key = (work.name, contender.name)
                sample = samples.setdefault(key, Sample(0.0, [], []))
                sample.ratio = work.raw.nbytes / stored_len
                sample.encode_mbs.append(work.raw.nbytes / (t1 - t0) / 1e6)
                sample.decode_mbs.append(work.raw.nbytes / (t3 - t2) / 1e6)
    return samples


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.0f} ({min(values):.0f}-{max(values):.0f})"


def report(
    samples: dict[tuple[str, str], Sample], works: list[Work], names: list[str]
) -> list[dict[str, Any]]:
    """Print the table; return the JSON rows (fphuff against zipnn)."""
    print(
        f"{'tensor':16} {'codec':7} {'ratio':>7} {'encode MB/s (range)':>22} "
        f"{'decode MB/s (range)':>22}"
    )
    rows: list[dict[str, Any]] = []
    for work in works:
        for name in names:
            s = samples[(work.name, name)]
            print(
                f"{work.name:16} {name:7} {s.ratio:7.4f} {spread(s.encode_mbs):>22} "
                f"{spread(s.decode_mbs):>22}"
            )
        ours, peer = samples[(work.name, "fphuff")], samples[(work.name, "zipnn")]
        metrics = [
            ("ratio", ours.ratio, peer.ratio, "x"),
            (
                "encode",
                statistics.median(ours.encode_mbs),
                statistics.median(peer.encode_mbs),
                "MB/s",
            ),
            (
                "decode",
                statistics.median(ours.decode_mbs),
                statistics.median(peer.decode_mbs),
                "MB/s",
            ),
        ]
        line = []
        for metric, mine, theirs, unit in metrics:
            ratio = mine / theirs
            line.append(f"{metric} {ratio:.4f}")
            rows.append(
                {
                    "work": f"{work.name} {metric} (1 thread)",
                    "ours": mine,
                    "peer": "zipnn 0.5.4",
                    "peer_value": theirs,
                    "unit": unit,
                    "ratio": ratio,
                    "goal": f"fphuff {metric} >= zipnn's",
                    "met": ratio >= 1.0,
                }
            )
        print(f"{'':16} fphuff/zipnn: " + ", ".join(line))
    return rows


def reference_rows(works: list[Work], reps: int) -> list[dict[str, Any]]:
    """Decode MB/s of the reference decoder beside the C one on :data:`REFERENCE_WORKS` (one
    payload each, from the C encoder; the two alternate, each decode checked bit for bit)."""
    native, reference = FloatPlaneCodec(), FloatPlaneCodec(fpref)
    rows: list[dict[str, Any]] = []
    for work in (w for w in works if w.name in REFERENCE_WORKS):
        enc = CkptstoreCodec(native).encode(work, work.raw)
        payload, expected = b"".join(enc.payload), work.raw.tobytes()
        speeds: dict[str, list[float]] = {"native": [], "reference": []}
        for rep in range(reps):
            order = [("native", native), ("reference", reference)]
            for name, codec in order if rep % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                out = codec.decode(
                    memoryview(payload),
                    work.raw.nbytes,
                    itemsize=enc.itemsize,
                    params=enc.params,
                    where=work.name,
                )
                t1 = time.perf_counter()
                if bytes(out) != expected:
                    print(f"fpref decode of {work.name} is not bit-exact")
                    sys.exit(1)
                speeds[name].append(work.raw.nbytes / (t1 - t0) / 1e6)
        ours, peer = (statistics.median(speeds[k]) for k in ("reference", "native"))
        print(
            f"{work.name:16} fpref decode MB/s {spread(speeds['reference'])}, "
            f"C decode {spread(speeds['native'])}"
        )
        rows.append(
            {
                "work": f"{work.name} decode, reference fpref (1 thread)",
                "ours": ours,
                "peer": "fphuff C decoder",
                "peer_value": peer,
                "unit": "MB/s",
                "ratio": ours / peer,
                "goal": "info",
                "met": None,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=256, help="raw MiB per tensor")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (medians reported)")
    parser.add_argument("--json", type=Path, help="write the comparison rows here")
    args = parser.parse_args()
    if NATIVE_ERROR is not None:
        raise SystemExit(NATIVE_ERROR)
    torch.set_num_threads(1)
    contenders: list[Any] = [CkptstoreCodec(FloatPlaneCodec()), Zipnn(), CkptstoreCodec(BGZSTD)]
    works = tensors(args.size_mib)
    load_before = os.getloadavg()[0]
    samples = measure(contenders, works, args.reps)
    rows = report(samples, works, [c.name for c in contenders])
    rows += reference_rows(works, args.reps)
    print(
        f"{args.reps} reps, {args.size_mib} MiB per tensor; median (min-max) over reps; "
        f"1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
        f"({os.cpu_count()} CPUs)"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        met = sum(bool(r["met"]) for r in rows)
        print(f"wrote {len(rows)} rows ({met} met) to {args.json}")


if __name__ == "__main__":
    main()
