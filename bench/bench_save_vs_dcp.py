"""Durable saves against torch.distributed.checkpoint, side by side in one run.

The state is a training checkpoint: fp32 weights (``bench_store.transformer_state``, 340
tensors) plus AdamW's two moments of the same shapes, so ``--weights-gib 1`` makes a 3 GiB save.
Contenders, alternating (the order rotates every repetition), each into a fresh directory,
memory warmed identically before every timed call, everything durable when the call returns:

- ``ckptstore``: ``Run.save`` of the three components (``async_save=False``: snapshot, encode,
  hash, upload to a LocalStore, one batched flush, SQLite commit);
- ``dcp.save``: ``FileSystemWriter(thread_count=2, sync_files=True)``, one process;
- ``torch.save`` of the whole state to one file, then fsync (the simplest thing users do).

Then an incremental save: ckptstore's next step with 10% of the weights' bytes changed (and the
moments unchanged) into the same store, against DCP's full save of the same state.

Reported: medians, GB/s, and ratios ckptstore / best peer (goal: save <= 0.9x DCP,
incremental <= 0.2x DCP's full save). Scratch files live under ``--dir`` (default
``bench/out/``) and are removed after every repetition.

Run: ``.venv/bin/python bench/bench_save_vs_dcp.py [--weights-gib 1] [--reps 3]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

from bench_store import cpu_seconds, transformer_state, warm_memory  # noqa: E402

from ckptstore import open_run  # noqa: E402

GiB = 1 << 30


def training_state(weights_gib: float) -> dict[str, dict[str, torch.Tensor]]:
    """Weights plus AdamW's exp_avg and exp_avg_sq (same shapes, different values)."""
    weights = transformer_state(weights_gib, seed=0)
    moments = {k: v.mul(0.01) for k, v in weights.items()}
    squares = {k: v.square().mul_(0.001) for k, v in weights.items()}
    return {"model": weights, "exp_avg": moments, "exp_avg_sq": squares}


def nbytes(state: dict[str, dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for part in state.values() for t in part.values())


def change_fraction(weights: dict[str, torch.Tensor], fraction: float, rep: int) -> None:
    """Change about ``fraction`` of the weights' bytes: whole tensors, largest first, in turn."""
    total = sum(t.numel() * t.element_size() for t in weights.values())
    done = 0
    names = sorted(weights, key=lambda k: -weights[k].numel())
    start = rep % len(names)
    for name in names[start:] + names[:start]:
        if done >= fraction * total:
            break
        weights[name].add_(1e-3)
        done += weights[name].numel() * weights[name].element_size()


def save_ckptstore(state: dict[str, dict[str, torch.Tensor]], where: Path) -> None:
    with open_run("bench", db=where / "m.db", store=where / "store", async_save=False) as run:
        run.save(1, state)


def save_dcp(state: dict[str, dict[str, torch.Tensor]], where: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(where / "dcp", thread_count=2, sync_files=True),
        )


def save_torch(state: dict[str, dict[str, torch.Tensor]], where: Path) -> None:
    path = where / "state.pt"
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def timed(fn: Callable[[], None]) -> tuple[float, float, float]:
    """(seconds, CPU-seconds of this process, CPU-seconds of other processes)."""
    warm_memory()
    all0, own0 = cpu_seconds()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    all1, own1 = cpu_seconds()
    return seconds, own1 - own0, max(0.0, (all1 - all0) - (own1 - own0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights-gib", type=float, default=1.0, help="fp32 weights (x3 saved)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=str(BENCH_DIR / "out"))
    args = parser.parse_args()

    state = training_state(args.weights_gib)
    size = nbytes(state)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    print(
        f"{sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(f"state: {size / GiB:.2f} GiB fp32 (weights + AdamW moments); reps {args.reps}; medians")

    contenders: dict[str, Callable[[dict[str, dict[str, torch.Tensor]], Path], None]] = {
        "ckptstore Run.save": save_ckptstore,
        "dcp.save (2 threads, sync)": save_dcp,
        "torch.save + fsync": save_torch,
    }
    # One untimed save each first: imports and first-use set-up are not what is measured.
    tiny = {"model": {"w": torch.ones(4)}, "exp_avg": {"w": torch.ones(4)}}
    for save in contenders.values():
        where = Path(tempfile.mkdtemp(dir=args.dir))
        save(tiny, where)
        shutil.rmtree(where, ignore_errors=True)
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in contenders}
    incremental: list[tuple[float, float, float]] = []
    for rep in range(args.reps):
        names = list(contenders)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        for name in names:
            where = Path(tempfile.mkdtemp(dir=args.dir))
            try:
                save = contenders[name]
                results[name].append(timed(lambda save=save, where=where: save(state, where)))
                if name == "ckptstore Run.save":
                    change_fraction(state["model"], 0.10 * 3, rep)  # 10% of all saved bytes

                    def again(where: Path = where) -> None:
                        with open_run(
                            "bench", db=where / "m.db", store=where / "store", async_save=False
                        ) as run:
                            run.save(2, state)

                    incremental.append(timed(again))
            finally:
                shutil.rmtree(where, ignore_errors=True)

    def median(rows: list[tuple[float, float, float]], i: int) -> float:
        return statistics.median(r[i] for r in rows)

    dcp_s = median(results["dcp.save (2 threads, sync)"], 0)
    best_peer = min(median(results[n], 0) for n in contenders if not n.startswith("ckptstore"))
    print()
    print(f"{'contender':<34} {'median s':>8} {'GB/s':>6} {'CPU-s':>6} {'other CPU-s':>11}  runs")
    for name, rows in [*results.items(), ("ckptstore incremental (10%)", incremental)]:
        runs = " ".join(f"{r[0]:.2f}" for r in rows)
        print(
            f"{name:<34} {median(rows, 0):8.3f} {size / median(rows, 0) / 1e9:6.2f} "
            f"{median(rows, 1):6.2f} {median(rows, 2):11.2f}  {runs}"
        )
    ours = median(results["ckptstore Run.save"], 0)
    inc = median(incremental, 0)
    print()
    print(f"save: ckptstore / dcp.save = {ours / dcp_s:.2f}x (goal <= 0.9x)")
    print(f"save: ckptstore / best peer = {ours / best_peer:.2f}x")
    print(
        f"incremental: ckptstore (10% changed) / dcp.save full = {inc / dcp_s:.2f}x (goal <= 0.2x)"
    )
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
