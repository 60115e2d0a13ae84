"""2-rank torch.distributed.checkpoint (DCP) save and load: ckptstore against DCP's own
FileSystemWriter/FileSystemReader, side by side in one run.

Two gloo processes on CPU (``bench/dcp_multirank_child.py``, one per rank, started like torchrun
would: ``OMP_NUM_THREADS=1``) hold the transformer-like fp32 state of ``bench_store.py`` (340
tensors, the smallest width that reaches ``--size-gib`` in total) as DTensors sharded Shard(0)
over a 2-rank CPU mesh; each rank builds only its own slices. Per repetition, in an order that
alternates (A B, B A, ...), every contender writing into a fresh directory on the same disk:

- ckptstore (``ckptstore.integrations.dcp``): ``save(state, run_or_store, 1)`` on every rank
  (rank 0 with a writable run over SQLite + LocalStore, opened untimed; rank 1 with the store
  path), ``load(dest, read_only_run, 1)``, then an unchanged re-save as step 2 into the same run
  (reported with the bytes it uploaded);
- DCP: ``dcp.save(state, storage_writer=FileSystemWriter(dir, thread_count=2,
  sync_files=True))`` and ``dcp.load(dest, storage_reader=FileSystemReader(dir))``.

Both saves are durable when they return (DCP fsyncs its files; LocalStore flushes every object
and directory before the commit). Loads go into preallocated DTensors (zeroed, untimed, before
each load) from a hot page cache, and every load is compared bit for bit with the saved slices
(untimed; exit status 1 on any difference). Each operation is timed on rank 0 from a barrier
before it to a barrier after it. Memory temperature (/work/shared/ENVIRONMENT.md): before every
timed operation of both contenders each rank touches and frees 1.25 GiB (warm memory). One
untimed save + load of a tiny state per contender runs first.

Reported, medians: seconds, GB/s (total bytes over both ranks), the ratio ckptstore / DCP, the
CPU-seconds of both ranks together, ``other%`` (the largest share of the CPUs other processes
used during a timed run), and rank 0's peak RSS above its RSS at the start of the operation.

Run: ``.venv/bin/python bench/bench_dcp_multirank.py [--size-gib 1.0] [--reps 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
CHILD = BENCH_DIR / "dcp_multirank_child.py"
WORLD = 2
GiB = 1 << 30
#: A run during which other processes used more than this share of the CPUs is flagged.
NOISY = 0.10

ROWS = [
    # key, op, contender, ratio against (key), note
    ("ck_save", "save", "ckptstore dcp.save", "dcp_save", "fresh store + SQLite"),
    ("dcp_save", "save", "DCP FileSystemWriter", None, "thread_count=2, sync_files"),
    ("ck_load", "load", "ckptstore dcp.load", "dcp_load", "into DTensors, digests checked"),
    ("dcp_load", "load", "DCP FileSystemReader", None, "into DTensors"),
    ("ck_resave", "re-save", "ckptstore unchanged re-save", "dcp_save", "vs DCP full save"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mem_available_mib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return -1


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def launch(scratch: Path, size_gib: float, reps: int, timeout: float) -> dict[str, Any]:
    """Start both ranks, wait for them (killing the other when one fails), return rank 0's
    results."""
    out = scratch / "results.json"
    port = str(free_port())
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    root = str(BENCH_DIR.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    args = [str(scratch), str(size_gib), str(reps), str(out)]
    children = [
        subprocess.Popen(
            [sys.executable, str(CHILD), str(rank), str(WORLD), port, *args],
            env=env,
            cwd=scratch,
        )
        for rank in range(WORLD)
    ]
    deadline = time.monotonic() + timeout
    try:
        while any(c.poll() is None for c in children):
            failed = [c for c in children if c.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = "timed out" if not failed else f"a rank exited {failed[0].returncode}"
                raise SystemExit(f"benchmark failed: {why}")
            time.sleep(0.2)
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
    codes = [c.returncode for c in children]
    if any(codes):
        raise SystemExit(f"benchmark failed: rank exit codes {codes}")
    return dict(json.loads(out.read_text()))


def median(samples: list[dict[str, float]], field: str) -> float:
    return statistics.median(s[field] for s in samples)


def other_share(samples: list[dict[str, float]]) -> str:
    shares = [s["other"] for s in samples if s["other"] >= 0]
    return f"{max(shares):.0%}" if shares else "n/a"


def print_results(result: dict[str, Any]) -> None:
    samples: dict[str, list[dict[str, float]]] = result["samples"]
    total = result["total_bytes"]
    print(
        "| op | contender | median s | GB/s | x DCP | CPU-s | other% | rank-0 peak RSS "
        "+MiB | note | runs (s) |"
    )
    print("|---|---|--:|--:|--:|--:|--:|--:|---|---|")
    noisy: list[str] = []
    for key, op, contender, against, note in ROWS:
        rows = samples[key]
        s = median(rows, "s")
        ratio = f"{s / median(samples[against], 's'):.2f}x" if against else ""
        runs = ", ".join(
            f"{r['s']:.2f}" + (f" ({r['other']:.0%})" if r["other"] >= 0 else "") for r in rows
        )
        print(
            f"| {op} | {contender} | {s:.3f} | {total / s / 1e9:.2f} | {ratio} | "
            f"{median(rows, 'cpu'):.2f} | {other_share(rows)} | "
            f"{median(rows, 'rss_extra_mib'):.0f} | {note} | {runs} |"
        )
        if any(r["other"] > NOISY for r in rows):
            noisy.append(f"{op} {contender}")
    print()
    notes = [
        "x DCP = ckptstore median / DCP median (re-save: / DCP's full save)",
        "GB/s = total bytes of both ranks / median seconds",
        "CPU-s = median CPU-seconds of both ranks together (user + system, all threads)",
        "other% = largest share of the CPUs used by OTHER user-space processes during a timed",
        "  run (/proc/stat minus both ranks and kernel threads; n/a for runs under 0.2 s)",
        "rank-0 peak RSS +MiB = median of rank 0's VmHWM during the operation minus its RSS at",
        f"  the start (baseline {result['rss_baseline_mib']:.0f} MiB: its slices, the load "
        "targets, torch)",
        "runs = every repetition's seconds (other% of that run)",
    ]
    print("\n".join(notes))
    if noisy:
        print(
            f"WARNING: other processes took more than {NOISY:.0%} of the CPUs during some runs of: "
            f"{'; '.join(noisy)}; those runs are noise, rerun on a quiet machine"
        )
    save = median(samples["ck_save"], "s") / median(samples["dcp_save"], "s")
    load = median(samples["ck_load"], "s") / median(samples["dcp_load"], "s")
    resave = median(samples["ck_resave"], "s") / median(samples["dcp_save"], "s")
    uploaded = statistics.median(result["resave_uploaded"])
    logical = statistics.median(result["resave_logical"])
    first = statistics.median(result["save_uploaded"])
    print()
    print(f"save 2 ranks:    ckptstore / DCP = {save:.2f}x")
    print(f"load 2 ranks:    ckptstore / DCP = {load:.2f}x")
    print(
        f"unchanged re-save: ckptstore / DCP full save = {resave:.2f}x; uploaded "
        f"{uploaded:,.0f} bytes of {logical:,.0f} logical ({uploaded / logical:.4%}); "
        f"the full save uploaded {first:,.0f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="total over both ranks")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=str(BENCH_DIR / "out"), help="scratch parent")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the ranks")
    args = parser.parse_args()
    if args.reps < 1 or args.size_gib <= 0:
        parser.error("--reps must be >= 1 and --size-gib > 0")

    Path(args.dir).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="dcp-multirank-", dir=args.dir))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = load_average()
    print(
        f"{started}; {os.cpu_count()} CPUs, MemAvailable {mem_available_mib()} MiB, "
        f"load average {load_start}"
    )
    t0 = time.perf_counter()
    try:
        result = launch(scratch, args.size_gib, args.reps, args.timeout)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - t0
    print(
        f"Python {result['python']}, torch {result['torch']}; {result['world']} ranks (gloo, "
        f"CPU), torch threads per rank {result['omp_threads']}"
    )
    print(
        f"state: {result['total_bytes'] / GiB:.2f} GiB fp32 over {result['world']} ranks "
        f"({result['rank_bytes'] / GiB:.2f} GiB each), {result['tensors']} DTensors "
        f"Shard(0), width {result['dim']}; reps {args.reps}; medians"
    )
    print(
        f"memory: WARM: before every timed call each rank allocated "
        f"{result['warm_bytes'] / GiB:.2f} GiB, wrote every page, freed it"
    )
    first = result["first_calls"]
    print(
        f"first calls (untimed warm-up, tiny state): ckptstore save+load {first['ckptstore']:.2f}"
        f" s, DCP save+load {first['dcp']:.2f} s; building the state {result['build_s']:.1f} s"
    )
    print()
    print_results(result)
    print()
    print(f"load average at the end: {load_average()}; whole run {wall:.0f} s")
    if result["mismatches"]:
        print("LOAD MISMATCHES (a load differed from the saved state):")
        for line in result["mismatches"][:20]:
            print("  " + line)
        return 1
    print("every load was bit-identical to the saved slices (both contenders, every repetition)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
