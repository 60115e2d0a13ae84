"""Issue 13's whole table in one run: every benchmark's goal rows as ratios against the peers
measured in the same run (``make bench``).

Each benchmark runs as its own process, one after another (never two at once: they would
measure each other), and writes its goal rows with ``--json``. For each one this script also
records the share of the machine's CPUs that *other* processes used meanwhile (``/proc/stat``
minus this process tree; a high share means that benchmark's figures are noise on a shared
machine) and the memory available before it started. Every benchmark warms memory the same way
before each timed call (see its docstring). The table is printed at the end; ``--json PATH``
also writes it. Exit status 1 if a benchmark failed (a ckptstore result that was not bit-exact
fails its benchmark).

Run: ``.venv/bin/python bench/suite.py [--quick] [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from bench_store import cpu_seconds  # noqa: E402


@dataclass(frozen=True)
class Bench:
    """One benchmark script and its arguments (full run, ``--quick`` run)."""

    name: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]


BENCHES = [
    Bench(
        "save",
        "bench_save_vs_dcp.py",
        ("--weights-gib", "1", "--bf16-gib", "1", "--reps", "3"),
        ("--weights-gib", "0.1", "--bf16-gib", "0.1", "--reps", "3"),
    ),
    Bench(
        "load",
        "bench_load.py",
        ("--weights-gib", "1", "--reps", "3"),
        ("--weights-gib", "0.1", "--reps", "3"),
    ),
    Bench(
        "async",
        "bench_async_save.py",
        ("--size-mib", "1024", "--reps", "3"),
        ("--size-mib", "64", "--reps", "3", "--skip-s3"),
    ),
    Bench("codec", "bench_codec.py", (), ("--size-mib", "16", "--reps", "3")),
    Bench("replay", "bench_replay_codec.py", (), ("--groups", "64", "--reps", "3")),
    Bench("s3", "bench_s3.py", ("--size-gib", "1"), ("--size-gib", "0.1")),
    Bench(
        "s3-dcp",
        "bench_s3_dcp.py",
        ("--size-gib", "1", "--reps", "3", "--no-obstore"),
        ("--size-gib", "0.1", "--reps", "3", "--no-obstore"),
    ),
    Bench(
        "read-once",
        "bench_read_once.py",
        ("--size-mib", "128", "--reps", "3", "--s3"),
        ("--size-mib", "32", "--reps", "1"),
    ),
    Bench("cli", "bench_cli.py", (), ("--reps", "10")),
    Bench("tiers", "bench_tiers.py", ("--reps", "3"), ("--quick",)),
]


def mem_available_mib() -> int:
    with open("/proc/meminfo") as f:
        line = next(line for line in f if line.startswith("MemAvailable"))
    return int(line.split()[1]) // 1024


def run_bench(bench: Bench, quick: bool, scratch: Path) -> tuple[list[dict[str, Any]], str]:
    """The benchmark's goal rows (each with its ``other_cpu`` and ``mem_available_mib``) and
    a line describing the run."""
    out = scratch / f"{bench.name}.json"
    args = bench.quick if quick else bench.full
    command = [sys.executable, str(BENCH_DIR / bench.script), *args, "--json", str(out)]
    available = mem_available_mib()
    busy0, _ = cpu_seconds()
    children0 = os.times()
    started = time.perf_counter()
    print(f"$ {' '.join(command[1:])}", flush=True)
    done = subprocess.run(command, check=False)
    wall = time.perf_counter() - started
    busy1, _ = cpu_seconds()
    children1 = os.times()
    ours = (children1.children_user - children0.children_user) + (
        children1.children_system - children0.children_system
    )
    other = max(0.0, (busy1 - busy0) - ours) / (wall * (os.cpu_count() or 1))
    if done.returncode != 0 or not out.exists():
        return [], f"{bench.name}: FAILED (exit {done.returncode})"
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    for row in rows:
        row.update(bench=bench.name, other_cpu=other, mem_available_mib=available)
    return rows, f"{bench.name}: {wall:.0f} s, other processes {other:.0%} of the CPUs"


def print_table(rows: list[dict[str, Any]]) -> None:
    print()
    print(
        f"{'work':<64} {'ckptstore':>10} {'peer':>10} {'ratio':>7}  {'goal':<16} {'met':<4} "
        f"{'other%':>6}  peer"
    )
    for row in rows:
        unit = row["unit"]
        print(
            f"{row['work'][:64]:<64} {row['ours']:>9.3g}{unit[:1]} {row['peer_value']:>9.3g}"
            f"{unit[:1]} {row['ratio']:>6.2f}x  {row['goal']:<16} "
            f"{verdict(row['met']):<4} {row['other_cpu']:>5.0%}  {row['peer']}"
        )
    goals = [row for row in rows if row["met"] is not None]
    met = sum(bool(row["met"]) for row in goals)
    units = "s seconds, M MiB or MB/s, C CPU-s/GiB"
    print(f"\n{met} of {len(goals)} goals met in this run (units: {units})")
    if len(goals) < len(rows):
        print("rows marked 'info' are floors measured beside a goal, not goals")


def verdict(met: bool | None) -> str:
    """A goal row's verdict; None marks an information row (a floor, not a goal)."""
    return "info" if met is None else "yes" if met else "NO"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (~5 min)")
    parser.add_argument("--only", nargs="+", choices=[b.name for b in BENCHES])
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    print(
        f"{os.cpu_count()} CPUs, MemAvailable {mem_available_mib()} MiB, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; memory: WARM before every timed call"
    )
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        for bench in BENCHES:
            if args.only and bench.name not in args.only:
                continue
            got, note = run_bench(bench, args.quick, Path(scratch))
            rows += got
            notes.append(note)
    print()
    print("\n".join(notes))
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any("FAILED" in note for note in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
