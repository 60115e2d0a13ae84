"""The pure-Python parsers' fuzz, in a child process under an address-space limit and a time
cap per input: the blob header, whole blob objects, the component index, DCP metadata, and
the shipped native float decoder against the reference decoder ``fpref`` where it exists.

Every input must parse or raise one of the library's own errors (``CkptStoreError``); any
other exception, a MemoryError (an allocation past the limit that a few bytes asked for), an
input that takes longer than the cap, or a child that dies is a finding with a reproducer.
The child counts its inputs in a small shared file; if it dies, the parent regenerates the
input it died on (the engines are deterministic for a seed) and writes its reproducer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fuzz import limits, native, parser_targets, sanitized, worker

TARGETS: dict[str, Callable[[int], parser_targets.Mutants]] = {
    "header": parser_targets.header_mutants,
    "object": parser_targets.object_mutants,
    "index": parser_targets.index_mutants,
    "dcp-metadata": parser_targets.metadata_mutants,
}
#: A parser taking longer than this on one small input is looping (or close to it).
TIME_CAP = 2.0
#: What the child may allocate beyond what it has mapped once set up.
HEADROOM = 2 << 30
#: A blob whose header declares at least this many raw bytes, and whose caller allows them,
#: may fail to allocate them; for anything smaller a MemoryError is a finding.
LARGE = 256 << 20


@dataclass(slots=True)
class ParserTally:
    """One parser's figures."""

    inputs: int = 0
    #: Parsed (for ``object``: decoded, verified and equal to the original bytes).
    accepted: int = 0
    #: Refused with a CkptStoreError.
    rejected: int = 0
    #: A blob declaring more than :data:`HEADROOM` that a caller allowed, refused for memory.
    refused_large: int = 0
    seconds: float = 0.0
    findings: list[dict[str, Any]] = field(default_factory=list)


def _write(findings: Path, target: str, kind: str, detail: str, reproducer: dict[str, Any]) -> str:
    findings.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(json.dumps(reproducer).encode("utf-8", "surrogatepass")).hexdigest()
    path = findings / f"{target}-{kind}-{name[:12]}.json"
    path.write_text(json.dumps({"target": target, "kind": kind, "detail": detail, **reproducer}))
    return str(path)


def fuzz_parser(
    target: str, mutants: parser_targets.Mutants, inputs: int, findings: Path, progress: Any
) -> ParserTally:
    """Feed ``inputs`` mutants to one parser; classify each outcome."""
    from ckptstore.errors import CkptStoreError

    tally, started = ParserTally(), time.perf_counter()
    for i in range(inputs):
        struct.pack_into("<Q", progress, 0, i)
        reproducer, call = next(mutants)
        tally.inputs += 1
        try:
            with limits.time_cap(TIME_CAP):
                call()
        except limits.InputTimeout:
            kind, detail = "slow", f"took more than {TIME_CAP} s"
        except CkptStoreError as exc:
            tally.rejected += 1
            if not limits.memory_error_in(exc):
                continue
            if (
                min(reproducer.get("declared_raw_len", 0), reproducer.get("max_raw_len", 0))
                >= LARGE
            ):
                tally.refused_large += 1
                continue
            kind, detail = "memory", f"{type(exc).__name__} from a MemoryError: {exc}"
        except Exception as exc:  # anything but the library's own errors is a finding
            kind, detail = type(exc).__name__, f"{type(exc).__name__}: {str(exc)[:500]}"
        else:
            tally.accepted += 1
            continue
        entry = {"kind": kind, "detail": detail}
        if sum(f["kind"] == kind for f in tally.findings) < native.MAX_REPRODUCERS:
            entry["reproducer"] = _write(findings, target, kind, detail, reproducer)
        tally.findings.append(entry)
    tally.seconds = time.perf_counter() - started
    return tally


def _fpcodec_against_reference(inputs: int, seed: int, findings: Path) -> dict[str, Any] | None:
    """The shipped native decoder in this process, every outcome compared with ``fpref``'s."""
    reference = worker.reference()
    if reference is None or not inputs:
        return None
    from ckptstore.cas import _fpcodec

    tally = native.run(
        _fpcodec,
        worker.samples(_fpcodec, seed, 300),
        seed=seed,
        inputs=inputs,
        findings_dir=findings,
        target="fpref",
        checks=native.Checks(
            reference=reference, reference_on_all=True, large=LARGE, time_cap=TIME_CAP
        ),
    )
    return asdict(tally)


def child(args: argparse.Namespace) -> None:
    """The child process: set up every engine, then cap memory and fuzz."""
    counts: dict[str, int] = json.loads(args.counts)
    # Seeds are built (imports, a real save) before the cap, which is on what comes after.
    engines = {name: TARGETS[name](args.seed) for name in counts if name in TARGETS}
    with args.progress.open("r+b") as f:
        progress = mmap.mmap(f.fileno(), 8)
    limits.cap_address_space(HEADROOM)
    report: dict[str, Any] = {}
    for name, engine in engines.items():
        report[name] = asdict(fuzz_parser(name, engine, counts[name], args.findings, progress))
        args.report.write_text(json.dumps(report))
    fpref = _fpcodec_against_reference(counts.get("fpref", 0), args.seed, args.findings)
    report["fpref"] = fpref
    args.report.write_text(json.dumps(report))


def run(counts: dict[str, int], *, seed: int, findings: Path, timeout: float) -> dict[str, Any]:
    """Run the child for ``counts`` inputs per target; its report (a dead child's target gets
    a finding with the reproducer of the input it died on)."""
    sanitized.BUILD.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=sanitized.BUILD, prefix="parsers-") as work:
        report_path, progress = Path(work) / "report.json", Path(work) / "progress.bin"
        progress.write_bytes(bytes(8))
        command = [sys.executable, "-m", "fuzz.parsers", f"--seed={seed}"]
        command += [f"--counts={json.dumps(counts)}", f"--report={report_path}"]
        command += [f"--findings={findings}", f"--progress={progress}"]
        try:
            done = subprocess.run(
                command, cwd=sanitized.ROOT, capture_output=True, timeout=timeout, check=False
            )
            rc: int | None = done.returncode
            status, output = f"exit status {rc}", done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, status, output = None, f"killed after {timeout} s", exc.stderr or b""
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        (at,) = struct.unpack("<Q", progress.read_bytes())
    if rc != 0:
        dead = next((name for name in counts if name in TARGETS and name not in report), "fpref")
        detail = f"{status}\n{output.decode(errors='replace')[-4000:]}"
        report[dead] = asdict(_dead(dead, seed, at, findings, detail))
    return report


def _dead(target: str, seed: int, at: int, findings: Path, detail: str) -> ParserTally:
    """The reproducer of input number ``at`` of ``target`` (regenerated, not parsed)."""
    tally = ParserTally(inputs=at + 1)
    if target in TARGETS:
        mutants = TARGETS[target](seed)
        for _ in range(at):
            next(mutants)
        reproducer, _ = next(mutants)
        path = _write(findings, target, "crash", detail, reproducer)
        tally.findings.append({"kind": "crash", "detail": detail[:2000], "reproducer": path})
    else:
        tally.findings.append({"kind": "crash", "detail": detail[:2000]})
    return tally


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--counts", required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--findings", type=Path, required=True)
    parser.add_argument("--progress", type=Path, required=True)
    child(parser.parse_args())
