"""The float codec's fuzz: the sanitized native decoder in worker processes.

The sanitized run splits its inputs into chunks, each a worker process (:mod:`fuzz.worker`)
with its own seed, a few at a time. A worker that dies (an ASan or UBSan report, any signal)
or stops making progress (a loop) leaves the input under test in its crash slot: it becomes a
reproducer file beside the sanitizer's report, and the rest of that chunk runs in a new worker.
Decodes that no mutation predicted are checked afterwards against the pure-Python reference
decoder, in plain processes (it is too slow to run under the sanitizers).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuzz import native, sanitized, worker
from fuzz.mutate import Engine

#: A worker whose input count has not moved for this long is looping.
HANG_SECONDS = 30.0
#: After this many dead workers the rest of the inputs are not run: the reproducers say enough.
MAX_DEAD = 5


@dataclass(slots=True)
class _Chunk:
    seed: int
    inputs: int
    index: int


class _Running:
    """One worker process and the files it reports through."""

    def __init__(self, chunk: _Chunk, build: tuple[Path, Path], work: Path, findings: Path) -> None:
        self.chunk = chunk
        self.slot = work / f"slot-{chunk.index}.bin"
        self.report = work / f"report-{chunk.index}.json"
        self.log = work / f"worker-{chunk.index}.log"
        self.spool = work / f"spool-{chunk.index}.bin"
        self.report.unlink(missing_ok=True)
        native.Slot(self.slot)  # created (zeroed) before the worker maps it
        command = [
            sys.executable,
            "-m",
            "fuzz.worker",
            f"--extension={build[0]}",
            f"--probe={build[1]}",
            f"--slot={self.slot}",
            f"--report={self.report}",
            f"--spool={self.spool}",
            f"--findings={findings}",
            f"--seed={chunk.seed}",
            f"--inputs={chunk.inputs}",
        ]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, cwd=sanitized.ROOT, env=sanitized.environment(), stdout=log, stderr=log
            )
        self.progress, self.moved = -1, time.monotonic()

    def hung(self) -> bool:
        """Whether the input count stood still for :data:`HANG_SECONDS`."""
        done, _ = native.Slot.read(self.slot)
        if done != self.progress:
            self.progress, self.moved = done, time.monotonic()
        return time.monotonic() - self.moved > HANG_SECONDS


def run_sanitized(
    inputs: int, *, workers: int, chunk: int, seed: int, findings: Path, quiet: bool = False
) -> native.Tally:
    """``inputs`` mutants through the sanitized build, ``workers`` processes at a time."""
    build = sanitized.build()
    with tempfile.TemporaryDirectory(dir=sanitized.BUILD, prefix="run-") as work:
        total = _run_chunks(inputs, workers, chunk, seed, build, Path(work), findings, quiet)
    return total


def _run_chunks(
    inputs: int,
    workers: int,
    chunk: int,
    seed: int,
    build: tuple[Path, Path],
    work: Path,
    findings: Path,
    quiet: bool,
) -> native.Tally:
    queue = [
        _Chunk(seed + i, min(chunk, inputs - start), i)
        for i, start in enumerate(range(0, inputs, chunk))
    ]
    total, started = native.Tally(), time.perf_counter()
    running: list[_Running] = []
    done: list[tuple[int, Path]] = []
    next_index = len(queue)
    while queue or running:
        while queue and len(running) < workers:
            running.append(_Running(queue.pop(0), build, work, findings))
        time.sleep(0.2)
        for r in list(running):
            rc = r.process.poll()
            if rc is None and not r.hung():
                continue
            running.remove(r)
            if rc == 0 and r.report.exists():
                total.add(native.Tally(**json.loads(r.report.read_text())))
                done.append((r.chunk.seed, r.spool))
                if not quiet:
                    print(f"  sanitized: {total.inputs:,} inputs", flush=True)
                continue
            rest = _dead_worker(r, rc, total, findings)
            if rest and sum(f["kind"] in ("crash", "hang") for f in total.findings) < MAX_DEAD:
                queue.append(_Chunk(r.chunk.seed + 7_919 * next_index, rest, next_index))
                next_index += 1
    if not quiet:
        print(f"  checking {total.unverified:,} unpredicted decodes against fpref", flush=True)
    verify_deferred(done, total, workers, findings)
    total.seconds = time.perf_counter() - started
    return total


def _dead_worker(r: _Running, rc: int | None, total: native.Tally, findings: Path) -> int:
    """Record a crash or hang from its slot; the inputs its chunk has left to run."""
    if rc is None:
        r.process.kill()
        r.process.wait()
    done, mutant = native.Slot.read(r.slot)
    kind = "hang" if rc is None else "crash"
    report = r.log.read_text(errors="replace")[-6000:]
    headline = next(
        (
            line
            for line in report.splitlines()
            if line.startswith("SUMMARY:") or "runtime error" in line
        ),
        f"worker exit status {rc}",
    )
    detail = f"{headline}\n{report}"
    path = native.write_reproducer(findings, "fpcodec-asan", mutant, kind, detail)
    total.findings.append({"kind": kind, "detail": detail[:2000], "reproducer": str(path)})
    total.inputs += done + 1
    return r.chunk.inputs - done - 1


def verify_deferred(
    done: list[tuple[int, Path]], total: native.Tally, workers: int, findings: Path
) -> None:
    """Check the decodes the sanitized workers deferred (``(seed, spool)`` per chunk) against
    the reference decoder, in plain processes; move them from unverified to agreed."""
    if worker.reference() is None:
        return
    # Spawned, not forked: the caller (a test session) may run threads of its own.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(done) or 1), mp_context=context) as pool:
        for agreed, checked, found in pool.map(_verify, done, itertools.repeat(findings)):
            total.agreed_with_reference += agreed
            total.unverified -= checked
            total.findings += found


def _verify(chunk: tuple[int, Path], findings: Path) -> tuple[int, int, list[dict[str, Any]]]:
    """(agreed, checked, findings) for one chunk's spool, its inputs regenerated from its seed
    with the shipped build's encoder (deterministic: the payload hashes must match)."""
    from ckptstore.cas import _fpcodec

    seed, spool = chunk
    reference = worker.reference()
    assert reference is not None
    data = spool.read_bytes()
    wanted = {
        i: (payload, out)
        for i, payload, out in (
            worker.SPOOLED.unpack_from(data, at) for at in range(0, len(data), worker.SPOOLED.size)
        )
    }
    engine = Engine(worker.samples(_fpcodec, seed, worker.CORPUS), seed)
    agreed, found = 0, []
    for i in range(max(wanted, default=-1) + 1):
        m = engine()
        if i not in wanted:
            continue
        payload_hash, out_hash = wanted[i]
        if worker.digest16(m.payload) != payload_hash:
            found.append({"kind": "regeneration", "detail": f"input {i} of seed {seed} differs"})
            continue
        try:
            ref: bytes | None = bytes(reference(m.payload, m.raw_len, m.itemsize, m.block_log2))
        except ValueError:
            ref = None
        if ref is not None and worker.digest16(ref) == out_hash:
            agreed += 1
            continue
        detail = "the sanitized native decoder decoded bytes the reference " + (
            "refuses" if ref is None else "decodes differently"
        )
        path = native.write_reproducer(findings, "fpcodec-asan", m, "disagreement", detail)
        found.append({"kind": "disagreement", "detail": detail, "reproducer": str(path)})
    return agreed, len(wanted), found


def replay(path: Path) -> str:
    """Decode a reproducer with the sanitized build in a fresh process; what happened."""
    extension, _ = sanitized.build()
    code = (
        "import sys, json; from fuzz import sanitized; from fuzz.native import Probe;"
        "m = sanitized.load(sys.argv[1]); d = json.load(open(sys.argv[2]));"
        "payload = Probe.exact_block(bytes.fromhex(d['payload_hex']));"
        "out = m.decode(payload, d['raw_len'], d['itemsize'], d['block_log2']);"
        "print('decoded', len(out), 'bytes')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(extension), str(path)],
        cwd=sanitized.ROOT,
        env=sanitized.environment(),
        capture_output=True,
        text=True,
        check=False,
    )
    return f"exit status {done.returncode}\n{done.stdout}{done.stderr}"
