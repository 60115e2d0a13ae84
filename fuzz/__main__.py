"""``python -m fuzz`` (``make fuzz``): every fuzz target, then a table of figures.

1. The float decoder ``_fpcodec.c`` built with ASan + UBSan, in worker processes
   (:mod:`fuzz.fuzz_fpcodec`): at least a million inputs by default.
2. In a child process under an address-space limit and a time cap per input
   (:mod:`fuzz.parsers`): the blob header, whole blob objects, the component index, DCP
   metadata, and the shipped float decoder against the reference decoder ``fpref``.
3. The surfaces that take hostile input whole, each in such a child (:mod:`fuzz.surfaces`):
   ``ckptstore import`` over mutated DCP and safetensors sources, ``ckptstore serve`` over
   generated requests, ``run.load(into=...)`` over generated targets.

Exit status 1 if anything was found; each finding has a reproducer file under
``build/fuzz/findings/`` (``--replay FILE`` runs a float-codec one under the sanitizers).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fuzz import fuzz_fpcodec, parsers, sanitized, surfaces

FINDINGS = sanitized.BUILD / "findings"


def _row(name: str, inputs: int, seconds: float, outcome: str, findings: int) -> str:
    rate = inputs / seconds if seconds else 0.0
    return f"{name:<22} {inputs:>10,} {seconds:>8.1f} {rate:>9,.0f}  {findings:>3}  {outcome}"


def _fpcodec_outcome(t: dict[str, Any]) -> str:
    parts = [f"exact {t['exact']:,}", f"rejected {t['rejected']:,}"]
    if t["agreed_with_reference"]:
        parts.append(f"other bytes, as fpref {t['agreed_with_reference']:,}")
    if t["unverified"]:
        parts.append(f"other bytes, no fpref to check {t['unverified']:,}")
    if t["refused_large"]:
        parts.append(f"too large to allocate {t['refused_large']:,}")
    return ", ".join(parts)


def _parser_outcome(t: dict[str, Any]) -> str:
    out = f"parsed {t['accepted']:,}, rejected {t['rejected']:,}"
    return out + (f" (too large to allocate {t['refused_large']:,})" if t["refused_large"] else "")


def main() -> int:
    """Run the targets (or replay one reproducer); print the figures; 1 if anything found."""
    p = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__)
    p.add_argument("--inputs", type=int, default=1_000_000, help="sanitized decoder inputs")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--chunk", type=int, default=200_000, help="inputs per worker process")
    p.add_argument("--parser-inputs", type=int, default=60_000, help="per Python parser")
    p.add_argument("--fpref-inputs", type=int, default=20_000)
    p.add_argument("--import-cases", type=int, default=2_000, help="ckptstore import cases")
    p.add_argument("--serve-cases", type=int, default=20_000, help="ckptstore serve requests")
    p.add_argument("--into-cases", type=int, default=20_000, help="load(into=...) cases")
    p.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    p.add_argument("--replay", type=Path, help="decode one float-codec reproducer and exit")
    args = p.parse_args()
    if args.replay:
        print(fuzz_fpcodec.replay(args.replay))
        return 0
    seed = random.randrange(1 << 31) if args.seed is None else args.seed
    shutil.rmtree(FINDINGS, ignore_errors=True)
    print(f"fuzz: seed {seed}; reproducers go to {FINDINGS}", flush=True)
    started = time.perf_counter()
    asan = fuzz_fpcodec.run_sanitized(
        args.inputs, workers=args.workers, chunk=args.chunk, seed=seed, findings=FINDINGS
    )
    counts = dict.fromkeys(parsers.TARGETS, args.parser_inputs)
    counts["fpref"] = args.fpref_inputs
    print("  python parsers ...", flush=True)
    report = parsers.run(counts, seed=seed, findings=FINDINGS, timeout=1800)
    rows = [
        f"{'target':<22} {'inputs':>10} {'seconds':>8} {'inputs/s':>9}  {'found':>3}  outcomes",
        _row(
            "fpcodec (ASan+UBSan)",
            asan.inputs,
            asan.seconds,
            _fpcodec_outcome(asdict(asan)),
            len(asan.findings),
        ),
    ]
    findings = list(asan.findings)
    for name, t in report.items():
        if t is None:
            rows.append(f"{name:<22} not run: ckptstore.cas.fpref does not exist yet")
            continue
        outcome = _fpcodec_outcome(t) if name == "fpref" else _parser_outcome(t)
        label = "fpcodec vs fpref" if name == "fpref" else name
        rows.append(_row(label, t["inputs"], t["seconds"], outcome, len(t["findings"])))
        findings += [{**f, "target": name} for f in t["findings"]]
    cases = {"import": args.import_cases, "serve": args.serve_cases, "into": args.into_cases}
    for family, count in cases.items():
        if not count:
            continue
        print(f"  {family} (issue 40) ...", flush=True)
        t = surfaces.run(family, count, seed=seed, findings=FINDINGS, timeout=7200)
        outcome = f"crashes {t['crashes']}, {surfaces.outcome_line(t)}"
        rows.append(_row(family, t["cases"], t["seconds"], outcome, len(t["findings"])))
        findings += [{**f, "target": family} for f in t["findings"]]
    print("\n".join(rows))
    print(f"total {time.perf_counter() - started:.0f} s, {len(findings)} findings")
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for f in findings:
        headline = f["detail"].splitlines()[0][:160]
        groups.setdefault((f.get("target", "fpcodec"), f["kind"], headline), []).append(f)
    for (target, kind, headline), members in groups.items():
        print(f"  {target}: {kind} x{len(members)}: {headline}")
        reproducer = next((m["reproducer"] for m in members if "reproducer" in m), None)
        if reproducer:
            print(f"    reproducer: {reproducer}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
