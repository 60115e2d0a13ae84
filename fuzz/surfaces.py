"""The fuzz of the surfaces that take hostile input whole (issue 40): ``ckptstore import`` over
mutated DCP and safetensors sources (:mod:`fuzz.import_targets`), ``ckptstore serve`` over
generated requests (:mod:`fuzz.serve_targets`) and ``run.load(into=...)`` over generated
targets (:mod:`fuzz.into_targets`).

Each family runs in a child process, as :mod:`fuzz.parsers` does: its setup (imports, a real
store, a running server) comes first, then the address space is capped (2 GiB over what the
child maps) and every case runs under a time cap. A case returns the name of its outcome
(``imported``, ``refused exit 3``, ``404``, ``filled``, ...): the figures are the cases, the
distinct outcomes and their counts. A case that breaks its oracle raises :class:`Finding`;
any other exception, a MemoryError, a case over the cap or a child that dies is a finding
too. The child writes its progress to a small file, so that a dead child's case is known;
every case is regenerated from (seed, case number), and a finding's file says both.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import mmap
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fuzz import limits, sanitized

#: family -> the module whose ``engine(workdir, seed)`` builds its cases.
FAMILIES = {
    "import": "fuzz.import_targets",
    "serve": "fuzz.serve_targets",
    "into": "fuzz.into_targets",
}
HEADROOM = 2 << 30
#: Findings of one kind that get a reproducer file (the rest are counted).
MAX_REPRODUCERS = 10


class Finding(Exception):
    """A case broke its oracle: ``kind`` (a short name) and what happened."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class Engine(Protocol):
    """A family's cases: ``case(i)`` runs case ``i`` and names its outcome."""

    time_cap: float

    def case(self, i: int) -> str: ...

    def reproducer(self, i: int) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class Tally:
    """One family's figures."""

    cases: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    crashes: int = 0
    seconds: float = 0.0
    findings: list[dict[str, Any]] = field(default_factory=list)


def _write(findings: Path, family: str, kind: str, detail: str, repro: dict[str, Any]) -> str:
    findings.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"family": family, "kind": kind, "detail": detail, **repro}, default=repr)
    name = hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    path = findings / f"{family}-{kind}-{name}.json"
    path.write_text(body)
    return str(path)


def _record(
    tally: Tally, findings: Path, family: str, kind: str, detail: str, repro: dict[str, Any]
) -> None:
    entry: dict[str, Any] = {"kind": kind, "detail": detail[:4000], "case": repro.get("case")}
    if sum(f["kind"] == kind for f in tally.findings) < MAX_REPRODUCERS:
        entry["reproducer"] = _write(findings, family, kind, detail, repro)
    tally.findings.append(entry)


def fuzz_family(
    family: str,
    engine: Engine,
    cases: int,
    findings: Path,
    progress: Any,
    first: int = 0,
    on_case: Callable[[Tally], None] | None = None,
) -> Tally:
    """Run cases ``first`` to ``first + cases - 1``; classify each outcome."""
    tally, started = Tally(), time.perf_counter()
    for i in range(first, first + cases):
        if progress is not None:
            struct.pack_into("<Q", progress, 0, i)
        tally.cases += 1
        try:
            with limits.time_cap(engine.time_cap):
                outcome = engine.case(i)
        except limits.InputTimeout:
            kind, detail = "slow", f"took more than {engine.time_cap} s"
        except Finding as exc:
            kind, detail = exc.kind, exc.detail
        except Exception as exc:  # the oracle itself raised: a finding, with its traceback
            kind = "memory" if limits.memory_error_in(exc) else type(exc).__name__
            detail = "".join(traceback.format_exception(exc))[-3000:]
        else:
            tally.outcomes[outcome] = tally.outcomes.get(outcome, 0) + 1
            if on_case is not None:
                on_case(tally)
            continue
        tally.outcomes[f"FINDING {kind}"] = tally.outcomes.get(f"FINDING {kind}", 0) + 1
        _record(tally, findings, family, kind, detail, {"case": i, **engine.reproducer(i)})
    tally.seconds = time.perf_counter() - started
    return tally


def engine_for(family: str, workdir: Path, seed: int) -> Engine:
    """The family's engine, set up in ``workdir``."""
    module = importlib.import_module(FAMILIES[family])
    return module.engine(workdir, seed)  # type: ignore[no-any-return]


def child(args: argparse.Namespace) -> None:
    """The child process: set the family up, cap memory, run its cases."""
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{args.family}-") as work:
        engine = engine_for(args.family, Path(work), args.seed)
        with args.progress.open("r+b") as f:
            progress = mmap.mmap(f.fileno(), 8)
        limits.cap_address_space(HEADROOM)
        try:
            tally = fuzz_family(args.family, engine, args.cases, args.findings, progress)
        finally:
            engine.close()
        args.report.write_text(json.dumps(asdict(tally)))


def run(family: str, cases: int, *, seed: int, findings: Path, timeout: float) -> dict[str, Any]:
    """Run ``cases`` cases of ``family`` in a child process; its tally (a dead child counts
    as a crash, with the case it died on)."""
    sanitized.BUILD.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=sanitized.BUILD, prefix=f"{family}-") as work:
        report_path, progress = Path(work) / "report.json", Path(work) / "progress.bin"
        progress.write_bytes(bytes(8))
        command = [sys.executable, "-m", "fuzz.surfaces", f"--family={family}"]
        command += [f"--cases={cases}", f"--seed={seed}", f"--report={report_path}"]
        command += [f"--findings={findings}", f"--progress={progress}"]
        started = time.perf_counter()
        try:
            done = subprocess.run(
                command, cwd=sanitized.ROOT, capture_output=True, timeout=timeout, check=False
            )
            rc: int | None = done.returncode
            status, output = f"exit status {rc}", done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, status, output = None, f"killed after {timeout} s", exc.stderr or b""
        if rc == 0 and report_path.exists():
            return json.loads(report_path.read_text())  # type: ignore[no-any-return]
        (at,) = struct.unpack("<Q", progress.read_bytes())
    detail = f"{status} at case {at}\n{output.decode(errors='replace')[-4000:]}"
    tally = Tally(cases=at + 1, crashes=1, seconds=time.perf_counter() - started)
    _record(tally, findings, family, "crash", detail, {"case": at, "seed": seed})
    return asdict(tally)


def outcome_line(tally: dict[str, Any]) -> str:
    """``N distinct: a 12, b 3, ...`` (most frequent first)."""
    items = sorted(tally["outcomes"].items(), key=lambda kv: (-kv[1], kv[0]))
    return f"{len(items)} distinct: " + ", ".join(f"{k} {v:,}" for k, v in items)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--cases", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--findings", type=Path, required=True)
    parser.add_argument("--progress", type=Path, required=True)
    child(parser.parse_args())
