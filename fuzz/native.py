"""The decode loop of the float codec's fuzz: one mutant at a time, every outcome checked.

For each input the native decoder must either raise ValueError or return ``raw_len`` bytes;
returned bytes must be the ones the mutation says (an exact mutation, or none at all), or,
where no mutation knows them, the ones the pure-Python reference decoder returns. In a
sanitized process (``fuzz.sanitized``) each payload sits alone in a heap block of exactly its
size, so a read one byte past it is an ASan report, and an allocation probe bounds what the
decode allocates: its output, one block of scratch, the code tables, never more.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import mmap
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from fuzz import limits
from fuzz.mutate import Engine, Mutant
from fuzz.payloads import Sample

#: Bytes a decode may allocate beyond twice its output: 8 planes' code tables and slack for
#: the Python objects a call creates (arguments, the error it raises).
TABLES_AND_SLACK = 8 * 20_488 + (64 << 10)
#: Reproducers written per kind of finding; the first few say all.
MAX_REPRODUCERS = 10
_SLOT_HEAD = struct.Struct("<QqiiII64s")
SLOT_PAYLOAD = 1 << 20


@dataclass(slots=True)
class Tally:
    """What a run of the loop saw."""

    inputs: int = 0
    #: Decoded to exactly the bytes the mutation said (the original for most).
    exact: int = 0
    #: Refused with ValueError.
    rejected: int = 0
    #: Decoded to bytes no mutation predicted, which the reference decoder also returned.
    agreed_with_reference: int = 0
    #: Decoded to bytes no mutation predicted, not (yet) compared with the reference decoder:
    #: deferred by a sanitized worker, or no reference decoder here.
    unverified: int = 0
    #: Declared an output too large to allocate here (MemoryError), larger than the cap.
    refused_large: int = 0
    seconds: float = 0.0
    findings: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        """Add another run's figures to these."""
        for name in ("inputs", "exact", "rejected", "agreed_with_reference", "unverified"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.refused_large += other.refused_large
        self.findings += other.findings


def write_reproducer(directory: Path, target: str, m: Mutant, kind: str, detail: str) -> Path:
    """The mutant as a JSON file ``python -m fuzz --replay`` reads; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    doc = {
        "target": target,
        "kind": kind,
        "detail": detail,
        "raw_len": m.raw_len,
        "itemsize": m.itemsize,
        "block_log2": m.block_log2,
        "source": m.source,
        "tags": m.tags,
        "payload_hex": m.payload.hex(),
    }
    name = hashlib.sha256(m.payload + repr(doc["raw_len"]).encode()).hexdigest()[:12]
    path = directory / f"{target}-{kind}-{name}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


class Slot:
    """The input being decoded, in a shared file mapping that outlives a crash: the parent
    of a worker that ASan killed reads the reproducer from it."""

    def __init__(self, path: Path) -> None:
        with path.open("wb") as f:
            f.truncate(_SLOT_HEAD.size + SLOT_PAYLOAD)
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)

    def record(self, done: int, m: Mutant) -> None:
        """Note ``m`` as the input under test, and ``done`` inputs finished before it."""
        n = len(m.payload)
        if n > SLOT_PAYLOAD:
            raise ValueError(f"a mutant of {n} bytes does not fit the crash slot")
        tags = ",".join(m.tags).encode()[:64]
        head = (done, m.raw_len, m.itemsize, m.block_log2, n, len(tags), tags)
        _SLOT_HEAD.pack_into(self._map, 0, *head)
        self._map[_SLOT_HEAD.size : _SLOT_HEAD.size + n] = m.payload

    @staticmethod
    def read(path: Path) -> tuple[int, Mutant]:
        """Inputs finished, and the input under test when the worker last wrote the slot."""
        data = path.read_bytes()
        done, raw_len, itemsize, block_log2, n, tag_len, tags = _SLOT_HEAD.unpack_from(data)
        payload = data[_SLOT_HEAD.size : _SLOT_HEAD.size + n]
        tag_list = tags[:tag_len].decode(errors="replace").split(",")
        return done, Mutant(payload, raw_len, itemsize, block_log2, tags=tag_list)


class Probe:
    """What a call allocates, through ``alloc_probe.c`` (in a process with libasan preloaded)."""

    def __init__(self, library: Path) -> None:
        self._lib = ctypes.CDLL(str(library))
        self._lib.probe_reset.restype = None
        self._lib.probe_peak.restype = ctypes.c_longlong
        if not self._lib.probe_install():
            raise RuntimeError("ASan refused the allocation hooks (is libasan preloaded?)")

    def reset(self) -> None:
        """Start measuring."""
        self._lib.probe_reset()

    def peak(self) -> int:
        """The most heap bytes held at once since :meth:`reset`, net of frees."""
        return int(self._lib.probe_peak())

    @staticmethod
    def exact_block(payload: bytes) -> np.ndarray:
        """``payload`` copied into a heap block of exactly its size, with ASan's redzones on
        both sides (numpy allocates an array's bytes with malloc, without a header or the
        trailing NUL that ``bytes`` keeps, and reuses a cached block only of the same size)."""
        return np.frombuffer(payload, dtype=np.uint8).copy()


#: ``fpref.decode``: (payload, raw_len, itemsize, block_log2) -> raw bytes, or ValueError.
Reference = Callable[[bytes, int, int, int], Any]
#: Takes (input number, mutant, decoded bytes) of a decode no mutation predicted, for a later
#: comparison with the reference decoder (:func:`fuzz.fuzz_fpcodec.verify_deferred`).
Defer = Callable[[int, Mutant, bytes], None]


@dataclass(frozen=True, slots=True)
class Checks:
    """What :func:`run` checks beyond "bytes of the declared length, or ValueError"."""

    #: ``fpref.decode``: checks the decodes no mutation predicts.
    reference: Reference | None = None
    #: Compare every input's outcome with the reference's, refusals included.
    reference_on_all: bool = False
    #: Without a reference: where decodes no mutation predicts go, to be checked later.
    defer: Defer | None = None
    #: The allocation probe (sanitized runs): payloads in exact-size blocks, allocation bound.
    probe: Probe | None = None
    #: The crash slot each input is written to before it is decoded.
    slot: Slot | None = None
    #: A MemoryError is acceptable only for a declared output of at least this many bytes.
    large: int = 1 << 62
    #: An input (decode and checks) that takes longer is a finding.
    time_cap: float | None = None


def run(
    codec: ModuleType,
    samples: list[Sample],
    *,
    seed: int,
    inputs: int,
    findings_dir: Path,
    target: str,
    checks: Checks = Checks(),
) -> Tally:
    """Decode ``inputs`` mutants of ``samples`` with ``codec`` and check every outcome."""
    loop = _Loop(codec, checks, findings_dir, target)
    engine, started = Engine(samples, seed), time.perf_counter()
    for i in range(inputs):
        m = engine()
        if checks.slot is not None:
            checks.slot.record(i, m)
        loop.tally.inputs += 1
        try:
            with limits.time_cap(checks.time_cap) if checks.time_cap else contextlib.nullcontext():
                loop.one(i, m)
        except limits.InputTimeout:
            loop.finding(m, "slow", f"took more than {checks.time_cap} s")
    loop.tally.seconds = time.perf_counter() - started
    return loop.tally


class _Loop:
    """One run's decoder, checks and figures."""

    def __init__(self, codec: ModuleType, checks: Checks, findings: Path, target: str) -> None:
        self.codec, self.checks, self.findings, self.target = codec, checks, findings, target
        self.tally = Tally()
        self._per_kind: dict[str, int] = {}

    def finding(self, m: Mutant, kind: str, detail: str) -> None:
        """Record a finding; the first few of each kind with a reproducer file."""
        self._per_kind[kind] = self._per_kind.get(kind, 0) + 1
        entry = {"kind": kind, "detail": detail, "source": m.source, "tags": m.tags}
        if self._per_kind[kind] <= MAX_REPRODUCERS:
            path = write_reproducer(self.findings, self.target, m, kind, detail)
            entry["reproducer"] = str(path)
        self.tally.findings.append(entry)

    def one(self, i: int, m: Mutant) -> None:
        """Decode input ``i`` and check its outcome."""
        out = self._decode(m)
        known = out is None or self._check_bytes(m, out)
        reference = self.checks.reference
        if reference is not None and (self.checks.reference_on_all or not known):
            agreed = self._agree(m, out, reference)
            self.tally.agreed_with_reference += agreed and not known
        elif not known:
            assert out is not None
            self.tally.unverified += 1
            if self.checks.defer is not None:
                self.checks.defer(i, m, out)

    def _decode(self, m: Mutant) -> bytes | None:
        probe = self.checks.probe
        buffer = probe.exact_block(m.payload) if probe is not None else m.payload
        if probe is not None:
            probe.reset()
        out = None
        try:
            out = bytes(self.codec.decode(buffer, m.raw_len, m.itemsize, m.block_log2))
        except ValueError:
            self.tally.rejected += 1
        except MemoryError as exc:
            if m.raw_len < self.checks.large:
                self.finding(m, "memory", f"MemoryError ({exc}), {m.raw_len} bytes declared")
            self.tally.refused_large += 1
        except Exception as exc:  # the decoder may raise nothing but ValueError
            self.finding(m, "exception", f"{type(exc).__name__}: {exc}")
        if probe is not None:
            grown, bound = probe.peak(), 2 * max(m.raw_len, 0) + TABLES_AND_SLACK
            if grown > bound:
                self.finding(m, "allocation", f"allocated {grown} bytes, {m.raw_len} declared")
        return out

    def _check_bytes(self, m: Mutant, out: bytes) -> bool:
        """Check a decode against what the mutation implies; False if it implies nothing."""
        if len(out) != m.raw_len:
            self.finding(m, "length", f"decoded {len(out)} bytes, {m.raw_len} declared")
            return True
        expected = m.expected()
        if expected is None:
            return False
        if out != expected:
            self.finding(m, "wrong bytes", "decoded bytes differ from what the mutation implies")
        else:
            self.tally.exact += 1
        return True

    def _agree(self, m: Mutant, out: bytes | None, reference: Reference) -> bool:
        """The reference's outcome must be the native one's: both refuse, or one answer."""
        try:
            ref = bytes(reference(m.payload, m.raw_len, m.itemsize, m.block_log2))
        except ValueError:
            ref = None
        except Exception as exc:  # the reference may raise nothing but ValueError either
            self.finding(m, "reference exception", f"{type(exc).__name__}: {exc}")
            return False
        if ref == out:
            return True
        native = "refuses" if out is None else "decodes"
        says = "refuses" if ref is None else "decodes"
        self.finding(m, "disagreement", f"the native decoder {native}, the reference {says}")
        return False


def tally_json(tally: Tally) -> str:
    """``tally`` as JSON (what a worker hands its parent)."""
    return json.dumps(asdict(tally))
