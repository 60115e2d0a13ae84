"""One sanitized fuzz worker: loads the ASan/UBSan build of ``_fpcodec`` into this process
(started with :func:`fuzz.sanitized.environment`) and runs the decode loop on it.

It writes the input under test to a crash slot before every decode and its figures to a JSON
report at the end; a worker that ASan or UBSan kills leaves the slot for its parent to read.
A decode no mutation predicted goes to a spool (input number, payload and output hashes): the
pure-Python reference decoder is too slow to run under the sanitizers, so the parent checks
those afterwards in plain processes, regenerating each input from the seed.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import struct
from pathlib import Path
from typing import BinaryIO

from fuzz import native, payloads, sanitized, synth
from fuzz.mutate import Mutant


def samples(codec: object, seed: int, size: int) -> list[payloads.Sample]:
    """The corpus: encoder payloads and synthetic ones (a fifth), the same for a seed."""
    rng = random.Random(seed)
    made = payloads.corpus(codec, size - size // 5, seed)  # type: ignore[arg-type]
    return made + [synth.sample(rng, i) for i in range(size // 5)]


def reference() -> native.Reference | None:
    """``ckptstore.cas.fpref.decode``, the pure-Python reference decoder, if it exists."""
    try:
        from ckptstore.cas import fpref
    except ImportError:
        return None
    decode: native.Reference = fpref.decode
    return decode


#: Samples in a worker's corpus.
CORPUS = 600
#: One spooled decode: input number, hashes of its payload and of the bytes it decoded to.
SPOOLED = struct.Struct("<I16s16s")


def digest16(data: bytes) -> bytes:
    """A short hash of ``data`` for the spool."""
    return hashlib.blake2b(data, digest_size=16).digest()


def spooler(spool: BinaryIO) -> native.Defer:
    """A ``Checks.defer`` that appends each deferred decode to ``spool``."""

    def defer(i: int, m: Mutant, out: bytes) -> None:
        spool.write(SPOOLED.pack(i, digest16(m.payload), digest16(out)))

    return defer


def main() -> None:
    """Parse the arguments, run the loop, write the report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--extension", type=Path, required=True)
    parser.add_argument("--probe", type=Path, required=True)
    parser.add_argument("--slot", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--spool", type=Path, required=True)
    parser.add_argument("--findings", type=Path, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--inputs", type=int, required=True)
    parser.add_argument("--corpus", type=int, default=CORPUS)
    args = parser.parse_args()
    codec = sanitized.load(args.extension)
    with args.spool.open("wb") as spool:
        checks = native.Checks(
            defer=spooler(spool),
            probe=native.Probe(args.probe),
            slot=native.Slot(args.slot),
            large=sanitized.MAX_ALLOCATION_MB << 20,
        )
        tally = native.run(
            codec,
            samples(codec, args.seed, args.corpus),
            seed=args.seed,
            inputs=args.inputs,
            findings_dir=args.findings,
            target="fpcodec-asan",
            checks=checks,
        )
    args.report.write_text(native.tally_json(tally))


if __name__ == "__main__":
    main()
