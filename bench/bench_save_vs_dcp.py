"""Durable saves against torch.distributed.checkpoint, side by side in one run.

The state is a training checkpoint: fp32 weights (``bench_store.transformer_state``, 340
tensors) plus AdamW's two moments of the same shapes, so ``--weights-gib 1`` makes a 3 GiB save.
Contenders, alternating (the order rotates every repetition), each into a fresh directory,
memory warmed identically before every timed call, everything durable when the call returns:

- ``ckptstore``: ``Run.save`` of the three components (``async_save=False``: encode, hash,
  upload to a LocalStore, one batched flush, SQLite commit), into a run opened before the timed
  call (a training job opens its run once);
- ``dcp.save``: ``FileSystemWriter(thread_count=2, sync_files=True)``, one process;
- ``torch.save`` of the whole state to one file, then fsync (the simplest thing users do);
- safetensors ``save_file`` of each part (weights, exp_avg, exp_avg_sq), each file fsynced.

Every peer's directories are fsynced too (a file whose name is not durable is lost in a power
cut), as ckptstore's flush does for its own.

Then an incremental save: ckptstore's next step with 10% of the weights' bytes changed (and the
moments unchanged) into the same store, against its floor: BLAKE3 over the bytes that did not
change, one tensor per thread on every CPU (a save that finds unchanged bytes by their digest
cannot take less; an information row, also shown against DCP's full save). Two ckptstore runs
save it: one with the default options (every byte hashed: an information row) and one with
``WriterOptions(reuse_unchanged_digests=True)``, which takes the digests of tensors whose
PyTorch version counter did not move (the goal row; see ``ckptstore.serialize.unchanged`` for
the writes that counter misses).

Then bf16 weights alone (``--bf16-gib``, default 1; 0 skips it): ckptstore ``Run.save`` against
safetensors ``save_file`` + fsync and ``dcp.save``, the same way.

Reported: medians, GB/s, and ratios ckptstore / best peer (goal: both saves <= 0.9x the fastest
peer, incremental <= 1.1x its floor) and a floor: the disk's durable write rate (one 1 GiB
file written and fsynced; the state's bytes over that rate). ``--json PATH`` writes
those rows for ``bench/suite.py``. Scratch files live under
``--dir`` (default ``bench/out/``) and are removed after every repetition.

Run: ``.venv/bin/python bench/bench_save_vs_dcp.py [--weights-gib 1] [--reps 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

from bench_store import (  # noqa: E402
    cpu_seconds,
    fsync_path,
    prepare,
    rotated,
    safetensors_save,
    torch_save,
    transformer_state,
)

from ckptstore import Run, open_run  # noqa: E402
from ckptstore.cas.digest import digest_bytes  # noqa: E402
from ckptstore.cas.writer import WriterOptions  # noqa: E402
from ckptstore.serialize.dtypes import byte_view  # noqa: E402

GiB = 1 << 30
State = dict[str, dict[str, torch.Tensor]]


def training_state(weights_gib: float) -> dict[str, dict[str, torch.Tensor]]:
    """Weights plus AdamW's exp_avg and exp_avg_sq (same shapes, different values)."""
    weights = transformer_state(weights_gib, seed=0)
    moments = {k: v.mul(0.01) for k, v in weights.items()}
    squares = {k: v.square().mul_(0.001) for k, v in weights.items()}
    return {"model": weights, "exp_avg": moments, "exp_avg_sq": squares}


def nbytes(state: dict[str, dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for part in state.values() for t in part.values())


def change_fraction(weights: dict[str, torch.Tensor], fraction: float, rep: int) -> set[str]:
    """Change about ``fraction`` of the weights' bytes: whole tensors, largest first, in turn.
    Returns the names of the tensors changed."""
    total = sum(t.numel() * t.element_size() for t in weights.values())
    done = 0
    changed = set()
    names = sorted(weights, key=lambda k: -weights[k].numel())
    start = rep % len(names)
    for name in names[start:] + names[:start]:
        if done >= fraction * total:
            break
        weights[name].add_(1e-3)
        changed.add(name)
        done += weights[name].numel() * weights[name].element_size()
    return changed


def hash_tensors(tensors: list[torch.Tensor]) -> None:
    """The blob digest (BLAKE3) over every byte of ``tensors``, a tensor per thread, one
    thread per CPU: the floor of any save or load that verifies those bytes."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda t: digest_bytes(byte_view(t).numpy()), tensors))


def save_ckptstore(run: Run, step: int) -> Callable[[State, Path], None]:
    """A save into ``run`` (opened untimed: the run's database exists before training)."""

    def save(state: State, where: Path) -> None:
        run.save(step, state)

    return save


def save_dcp(state: dict[str, dict[str, torch.Tensor]], where: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(where / "dcp", thread_count=2, sync_files=True),
        )
    fsync_path(where / "dcp")
    fsync_path(where)


def save_torch(state: State, where: Path) -> None:
    torch_save(state, where / "state.pt")
    fsync_path(where)


def save_safetensors(state: State, where: Path) -> None:
    for name, part in state.items():
        safetensors_save(part, where / f"{name}.safetensors")
    fsync_path(where)


def timed(fn: Callable[[], None]) -> tuple[float, float, float]:
    """(seconds, CPU-seconds of this process, CPU-seconds of other processes)."""
    prepare("warm")
    all0, own0 = cpu_seconds()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    all1, own1 = cpu_seconds()
    return seconds, own1 - own0, max(0.0, (all1 - all0) - (own1 - own0))


Timing = tuple[float, float, float]
OURS = "ckptstore Run.save"
SAFETENSORS = "safetensors save_file + fsync"
DCP = "dcp.save (2 threads, sync)"
FLOOR = "BLAKE3 of the unchanged bytes"
HASHED = "ckptstore incremental (10%, default)"
REUSED = "ckptstore incremental (10%, reuse)"


def open_bench_run(where: Path, **options: Any) -> Run:
    """A synchronous run with its database and store under ``where`` (``options``: the
    writer's, e.g. ``reuse_unchanged_digests=True``)."""
    return open_run(
        "bench",
        db=where / "m.db",
        store=where / "store",
        async_save=False,
        writer_options=WriterOptions(**options),
    )


def measure(
    state: State,
    peers: dict[str, Callable[[State, Path], None]],
    reps: int,
    scratch: str,
    *,
    incremental: dict[str, list[Timing]] | None = None,
) -> dict[str, list[Timing]]:
    """Every contender's durable save of ``state``, alternating; with ``incremental``, also
    ckptstore's next save after 10% of the saved bytes changed, by the run with the default
    options (``HASHED``) and by one that reuses unchanged tensors' digests (``REUSED``, its
    first save untimed), and the time BLAKE3 takes over the bytes that did not change
    (``FLOOR``: the least a save that finds unchanged bytes by their digest can spend)."""
    names = [OURS, *peers]
    results: dict[str, list[Timing]] = {name: [] for name in names}
    for rep in range(reps):
        for name in rotated(names, rep):
            where = Path(tempfile.mkdtemp(dir=scratch))
            try:
                if name in peers:
                    save = peers[name]
                    results[name].append(timed(lambda save=save, where=where: save(state, where)))
                    continue
                with open_bench_run(where / "a") as run:
                    full = save_ckptstore(run, 1)
                    results[name].append(timed(lambda full=full, where=where: full(state, where)))
                    if incremental is None:
                        continue
                    with open_bench_run(where / "b", reuse_unchanged_digests=True) as reusing:
                        save_ckptstore(reusing, 1)(state, where)
                        step_two(state, run, reusing, rep, where, incremental)
            finally:
                shutil.rmtree(where, ignore_errors=True)
    return results


def step_two(
    state: State,
    run: Run,
    reusing: Run,
    rep: int,
    where: Path,
    incremental: dict[str, list[Timing]],
) -> None:
    """10% of the weights' bytes changed, then the incremental saves and the floor."""
    changed = change_fraction(state["model"], 0.10 * len(state), rep)
    for name, saving in rotated([(HASHED, run), (REUSED, reusing)], rep):
        nxt = save_ckptstore(saving, 2)
        incremental[name].append(timed(lambda nxt=nxt: nxt(state, where)))
    same = [
        t
        for part, tensors in state.items()
        for k, t in tensors.items()
        if part != "model" or k not in changed
    ]
    incremental[FLOOR].append(timed(lambda: hash_tensors(same)))


def disk_rate(scratch: str, reps: int = 3) -> float:
    """The disk's durable write rate, bytes/s: 1 GiB written to one file and fsynced (the
    median of ``reps``), the floor of any durable save on this disk."""
    chunk = bytes(range(256)) * (4 << 10)  # 1 MiB, not all zeros
    times = []
    for _ in range(reps):
        where = Path(tempfile.mkdtemp(dir=scratch))
        try:
            prepare("warm")
            t0 = time.perf_counter()
            with open(where / "f", "wb") as f:
                for _ in range(1024):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(where)
            times.append(time.perf_counter() - t0)
        finally:
            shutil.rmtree(where, ignore_errors=True)
            os.sync()
    return GiB / statistics.median(times)


def median(rows: list[Timing], i: int = 0) -> float:
    return statistics.median(r[i] for r in rows)


def print_rows(rows: dict[str, list[Timing]], size: int) -> None:
    print()
    print(f"{'contender':<34} {'median s':>8} {'GB/s':>6} {'CPU-s':>6} {'other CPU-s':>11}  runs")
    for name, timings in rows.items():
        runs = " ".join(f"{r[0]:.2f}" for r in timings)
        print(
            f"{name:<34} {median(timings):8.3f} {size / median(timings) / 1e9:6.2f} "
            f"{median(timings, 1):6.2f} {median(timings, 2):11.2f}  {runs}"
        )


def info_row(work: str, ours: float, peer: str, theirs: float) -> dict[str, Any]:
    """A row measured beside a goal, not a goal (``bench/suite.py`` prints it as "info")."""
    return {
        "work": work,
        "ours": ours,
        "peer": peer,
        "peer_value": theirs,
        "unit": "s",
        "ratio": ours / theirs,
        "goal": "info",
        "met": None,
    }


def goal_row(work: str, ours: float, peer: str, theirs: float, goal: float) -> dict[str, Any]:
    print(f"{work}: ckptstore / {peer} = {ours / theirs:.2f}x (goal <= {goal}x)")
    return {
        **info_row(work, ours, peer, theirs),
        "goal": f"<= {goal}x",
        "met": ours / theirs <= goal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights-gib", type=float, default=1.0, help="fp32 weights (x3 saved)")
    parser.add_argument("--bf16-gib", type=float, default=1.0, help="bf16 weights (0: skip)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=str(BENCH_DIR / "out"))
    parser.add_argument("--json", type=Path, help="write the goal rows here (bench/suite.py)")
    args = parser.parse_args()

    state = training_state(args.weights_gib)
    size = nbytes(state)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    print(
        f"{sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(f"state: {size / GiB:.2f} GiB fp32 (weights + AdamW moments); reps {args.reps}; medians")

    peers: dict[str, Callable[[State, Path], None]] = {
        DCP: save_dcp,
        "torch.save + fsync": save_torch,
        SAFETENSORS: save_safetensors,
    }
    # One untimed save each first: imports and first-use set-up are not what is measured.
    tiny = {"model": {"w": torch.ones(4)}, "exp_avg": {"w": torch.ones(4)}}
    where = Path(tempfile.mkdtemp(dir=args.dir))
    with open_bench_run(where) as run:
        save_ckptstore(run, 1)(tiny, where)
    for peer in peers.values():
        peer(tiny, where)
    shutil.rmtree(where, ignore_errors=True)
    rate = disk_rate(args.dir)
    print(f"the disk's durable write rate (1 GiB file + fsync): {rate / 1e9:.2f} GB/s")
    incremental: dict[str, list[Timing]] = {HASHED: [], REUSED: [], FLOOR: []}
    results = measure(state, peers, args.reps, args.dir, incremental=incremental)
    print_rows({**results, **incremental}, size)
    dcp_s = median(results[DCP])
    best = min(peers, key=lambda n: median(results[n]))
    ours = median(results[OURS])
    floor_s = median(incremental[FLOOR])
    floor_name = f"BLAKE3 of the unchanged bytes, {os.cpu_count()} threads"
    print()
    best_s = median(results[best])
    fp32 = f"durable save {size / GiB:.2f} GiB fp32"
    beside = [] if best == DCP else [info_row(fp32, ours, DCP, dcp_s)]
    rows = [
        goal_row(f"durable save {size / GiB:.2f} GiB fp32 (+AdamW)", ours, best, best_s, 0.9),
        info_row(f"floor: {size / GiB:.2f} GiB at the disk's rate", size / rate, best, best_s),
        goal_row(
            "incremental save, 10% changed, reuse_unchanged_digests=True",
            median(incremental[REUSED]),
            floor_name,
            floor_s,
            1.1,
        ),
        info_row(
            "incremental save, 10% changed, default (every byte hashed)",
            median(incremental[HASHED]),
            floor_name,
            floor_s,
        ),
    ]
    print(
        f"{FLOOR}: {floor_s:.3f} s = {floor_s / dcp_s:.2f}x {DCP} (an incremental save that "
        "hashes what it keeps cannot take less)"
    )
    rows.append(info_row(f"floor: {floor_name}", floor_s, DCP, dcp_s))
    rows += beside
    print(f"save: ckptstore / best peer ({best}) = {ours / median(results[best]):.2f}x")
    del state
    if args.bf16_gib > 0:
        # transformer_state sizes fp32 bytes: twice the GiB give --bf16-gib of bf16.
        weights = transformer_state(2 * args.bf16_gib)
        bf16 = {"model": {k: v.bfloat16() for k, v in weights.items()}}
        del weights
        bf16_size = nbytes(bf16)
        bf16_peers: dict[str, Callable[[State, Path], None]] = {
            SAFETENSORS: save_safetensors,
            DCP: save_dcp,
        }
        print(f"\nbf16 weights: {bf16_size / GiB:.2f} GiB")
        bf16_results = measure(bf16, bf16_peers, args.reps, args.dir)
        print_rows(bf16_results, bf16_size)
        best = min(bf16_peers, key=lambda n: median(bf16_results[n]))
        print()
        rows.append(
            goal_row(
                f"durable save {bf16_size / GiB:.2f} GiB bf16",
                median(bf16_results[OURS]),
                best,
                median(bf16_results[best]),
                0.9,
            )
        )
        rows.append(
            info_row(
                f"floor: {bf16_size / GiB:.2f} GiB at the disk's rate",
                bf16_size / rate,
                best,
                median(bf16_results[best]),
            )
        )
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
