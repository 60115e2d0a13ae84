"""Asynchronous saves: how long a save blocks the caller, and what an upload in flight costs a
train step.

For a GPT-like fp32 state dict (``bench_store.transformer_state``; 256 MiB by default), on a
local directory (LocalStore, fsync per object) and on a local SeaweedFS S3 server:

1. **Blocked time**, the contenders alternating (the order rotates every repetition) and the
   allocator warmed identically before every timed call:
   - ``memcpy``: copying the state into preallocated host buffers that are reused -- the floor
     any snapshot must pay;
   - ``ShardWriter.save``: a worker's asynchronous save (snapshot, then return);
   - ``Run.save`` of a run opened with ``async_save=True`` (snapshot, then return; a SQLite
     manifest).
   Each save is waited for (untimed) before the next timed call, so uploads never overlap a
   measurement. The first save of each contender allocates its reusable buffers and is not
   timed. The ratio blocked/memcpy has a goal of at most 1.5x.
2. **Train step** (a fixed number of fixed-size fp32 matmuls), timed alone and while a
   ``ShardWriter.save`` of the state is uploading in the background; the two alternate
   (alone first, then in-flight first) in every repetition. The upload's own time is reported
   with and without training beside it.

Every repetition changes every tensor in place (untimed) so that nothing deduplicates.

Run: ``.venv/bin/python bench/bench_async_save.py [--size-mib 256] [--reps 5] [--skip-s3]``.
Scratch files live under ``--dir`` (default ``bench/out/``) and are removed at the end.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH_DIR))

from bench_store import cpu_seconds, state_bytes, transformer_state, warm_memory  # noqa: E402

from ckptstore import ObjectStore, S3Store, ShardWriter, open_run  # noqa: E402
from ckptstore.objectstore import LocalStore  # noqa: E402

MiB = 1 << 20
GOAL = 1.5


@dataclass
class Timings:
    """Samples of one measurement, in seconds."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


@dataclass
class TargetResult:
    """Every measurement on one store."""

    name: str
    blocked: dict[str, Timings] = field(default_factory=dict)
    upload_idle: Timings = field(default_factory=Timings)
    run_save: Timings = field(default_factory=Timings)
    step_alone: Timings = field(default_factory=Timings)
    step_in_flight: Timings = field(default_factory=Timings)
    upload_training: Timings = field(default_factory=Timings)
    #: Share of the machine's CPUs that other processes used while this target was measured.
    other_cpu: float = 0.0


# -- the pieces ---------------------------------------------------------------------------------


def prepare() -> None:
    """The same memory state before every timed call (see /work/shared/ENVIRONMENT.md)."""
    gc.collect()
    warm_memory()


def touch(state: dict[str, torch.Tensor], rep: int) -> None:
    """New values in every tensor, so no blob of the next save is already stored."""
    for tensor in state.values():
        tensor.add_(1e-3 * (rep + 1))


class TrainStep:
    """A synthetic train step: ``count`` fp32 matmuls of ``size`` x ``size``."""

    def __init__(self, size: int, count: int) -> None:
        gen = torch.Generator().manual_seed(1)
        self.a = torch.randn(size, size, generator=gen)
        self.b = torch.randn(size, size, generator=gen)
        self.out = torch.empty(size, size)
        self.count = count

    def __call__(self) -> float:
        started = time.perf_counter()
        for _ in range(self.count):
            torch.mm(self.a, self.b, out=self.out)
        return time.perf_counter() - started


def state_of_at_least(nbytes: float) -> dict[str, torch.Tensor]:
    """``transformer_state`` of at least ``nbytes`` (its width is rounded to the nearest)."""
    gib = nbytes / (1 << 30)
    state = transformer_state(gib)
    while state_bytes(state) < nbytes:
        gib *= 1.03
        state = transformer_state(gib)
    return state


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    prepare()
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


# -- measurements -------------------------------------------------------------------------------


def measure_blocked(
    state: dict[str, torch.Tensor],
    new_store: StoreFactory,
    scratch: Path,
    reps: int,
    out: TargetResult,
) -> None:
    """Part 1: memcpy floor, ShardWriter.save and Run.save (async), alternating."""
    buffers = {k: torch.empty_like(v) for k, v in state.items()}

    def memcpy() -> None:
        for key, tensor in state.items():
            buffers[key].copy_(tensor)

    names = ["memcpy into reused buffers", "ShardWriter.save", "Run.save (async_save=True)"]
    out.blocked = {name: Timings() for name in names}
    with (
        # One store per contender: a save never finds the other's blobs already stored.
        ShardWriter(new_store("shards")) as writer,
        open_run("bench-async", db=scratch / "manifest.db", store=new_store("run")) as run,
    ):
        steps = iter(range(10**9))
        # Untimed first calls: the reusable buffers are allocated here, once.
        memcpy()
        blocked_shard_save(writer, state, TargetResult("untimed"))
        blocked_run_save(run, next(steps), state, TargetResult("untimed"))
        for rep in range(reps):
            touch(state, rep)
            for name in names[rep % 3 :] + names[: rep % 3]:
                if name == names[0]:
                    seconds, _ = timed(memcpy)
                elif name == names[1]:
                    seconds = blocked_shard_save(writer, state, out)
                else:
                    seconds = blocked_run_save(run, next(steps), state, out)
                out.blocked[name].samples.append(seconds)


def blocked_shard_save(
    writer: ShardWriter, state: dict[str, torch.Tensor], out: TargetResult
) -> float:
    """The caller's time in ``ShardWriter.save``; then waits (untimed) for the upload."""
    seconds, handle = timed(lambda: writer.save({"policy": state}))
    (receipt,) = handle.receipts()
    out.upload_idle.samples.append(receipt.upload_seconds)
    return seconds


def blocked_run_save(
    run: Any, step: int, state: dict[str, torch.Tensor], out: TargetResult
) -> float:
    """The caller's time in ``Run.save``; then waits (untimed) for the commit."""
    seconds, handle = timed(lambda: run.save(step, {"policy": state}))
    info = handle.wait()
    out.run_save.samples.append(info.save_seconds or 0.0)
    return seconds


def measure_train_step(
    state: dict[str, torch.Tensor],
    new_store: StoreFactory,
    train: TrainStep,
    reps: int,
    steps_alone: int,
    out: TargetResult,
) -> None:
    """Part 2: train steps alone and with a ShardWriter.save upload in flight, alternating."""
    with ShardWriter(new_store("train")) as writer:
        writer.save({"policy": state}).receipts()  # allocate the snapshot buffers (untimed)
        for rep in range(reps):
            touch(state, 100 + rep)
            order = (
                [alone_steps, in_flight_steps] if rep % 2 == 0 else [in_flight_steps, alone_steps]
            )
            for measure in order:
                measure(writer, state, train, steps_alone, out)


def alone_steps(
    writer: ShardWriter, state: dict[str, torch.Tensor], train: TrainStep, n: int, out: TargetResult
) -> None:
    """``n`` train steps with nothing in flight."""
    prepare()
    out.step_alone.samples.extend(train() for _ in range(n))


def in_flight_steps(
    writer: ShardWriter, state: dict[str, torch.Tensor], train: TrainStep, n: int, out: TargetResult
) -> None:
    """Train steps from the moment ``save`` returns until its upload is done."""
    prepare()
    handle = writer.save({"policy": state})
    while True:
        out.step_in_flight.samples.append(train())
        if handle.done():
            break
    (receipt,) = handle.receipts()
    out.upload_training.samples.append(receipt.upload_seconds)


# -- targets ------------------------------------------------------------------------------------


#: Opens a fresh, empty store location (a directory, an S3 prefix) named ``name``.
StoreFactory = Callable[[str], ObjectStore]


@contextmanager
def local_target(scratch: Path) -> Iterator[StoreFactory]:
    """Directories under ``scratch`` (LocalStore fsyncs every object, the library default)."""
    opened: list[ObjectStore] = []

    def new_store(name: str) -> ObjectStore:
        opened.append(LocalStore(scratch / name))
        return opened[-1]

    try:
        yield new_store
    finally:
        for store in opened:
            store.close()


@contextmanager
def seaweed_target(scratch: Path) -> Iterator[StoreFactory]:
    """Prefixes of one bucket on a SeaweedFS server started for the benchmark."""
    import boto3

    from tests.s3servers import seaweed_server

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    opened: list[ObjectStore] = []
    with seaweed_server(scratch / "weed") as server:
        client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")
        client.create_bucket(Bucket="bench")

        def new_store(name: str) -> ObjectStore:
            opened.append(
                S3Store("bench", name, endpoint_url=server.endpoint_url, region_name="us-east-1")
            )
            return opened[-1]

        try:
            yield new_store
        finally:
            for store in opened:
                store.close()


# -- report -------------------------------------------------------------------------------------


def report(
    results: list[TargetResult], nbytes: int, train: TrainStep, args: argparse.Namespace
) -> None:
    print(
        f"\nstate: {nbytes / MiB:.0f} MiB fp32 ({nbytes / 1e9:.3f} GB); reps {args.reps}; medians"
    )
    print(
        f"train step: {train.count} x fp32 matmul {args.matmul_size}^2, "
        f"torch threads {torch.get_num_threads()}"
    )
    for result in results:
        floor = result.blocked["memcpy into reused buffers"].median
        print(f"\n[{result.name}]  other processes: {result.other_cpu:.0%} of the CPUs")
        print(f"{'blocked by':<30}{'median s':>10}{'GB/s':>8}{'x memcpy':>10}   runs")
        for name, timings in result.blocked.items():
            runs = " ".join(f"{s:.3f}" for s in timings.samples)
            ratio = timings.median / floor
            print(
                f"{name:<30}{timings.median:>10.3f}{nbytes / timings.median / 1e9:>8.2f}"
                f"{ratio:>9.2f}x   {runs}"
            )
        for name, timings in result.blocked.items():
            if not name.startswith("memcpy"):
                verdict = "MET" if timings.median / floor <= GOAL else "NOT MET"
                print(
                    f"  goal {name} <= {GOAL}x memcpy: {timings.median / floor:.2f}x -> {verdict}"
                )
        idle = result.upload_idle.median
        print(
            f"upload in background (ShardWriter, nothing else running): "
            f"{idle:.3f} s ({nbytes / idle / 1e9:.2f} GB/s)"
        )
        print(f"Run.save save_seconds (snapshot to commit): {result.run_save.median:.3f} s")
        alone, busy = result.step_alone, result.step_in_flight
        print(
            f"train step alone:        {alone.median * 1000:8.1f} ms  (n={len(alone.samples)})\n"
            f"train step, save in flight: {busy.median * 1000:5.1f} ms  (n={len(busy.samples)}, "
            f"{busy.median / alone.median:.2f}x)\n"
            f"upload while training:   {result.upload_training.median:8.3f} s  "
            f"({result.upload_training.median / result.upload_idle.median:.2f}x the idle upload)"
        )


@contextmanager
def other_processes(result: TargetResult) -> Iterator[None]:
    """Record the share of the CPUs that other processes (a SeaweedFS server included) used
    during the block: on a shared machine a high value means the figures are noise."""
    busy0, own0 = cpu_seconds()
    started = time.perf_counter()
    yield
    busy1, own1 = cpu_seconds()
    wall = time.perf_counter() - started
    other = max(0.0, (busy1 - busy0) - (own1 - own0))
    result.other_cpu = other / (wall * (os.cpu_count() or 1))


def machine() -> str:
    with open("/proc/meminfo") as f:
        available = next(line for line in f if line.startswith("MemAvailable")).split()[1]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"MemAvailable {int(available) // 1024} MiB, load average {load}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=float, default=256.0, help="state size (default 256)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")
    parser.add_argument("--skip-s3", action="store_true", help="only the local directory")
    parser.add_argument("--dir", type=Path, default=BENCH_DIR / "out", help="scratch parent")
    parser.add_argument("--matmul-size", type=int, default=1024)
    parser.add_argument("--matmuls", type=int, default=4, help="matmuls per train step")
    parser.add_argument("--steps-alone", type=int, default=5, help="steps per 'alone' sample")
    args = parser.parse_args(argv)
    if args.reps < 3:
        parser.error("--reps must be at least 3 (medians)")
    print(machine())
    print("memory: WARM: before every timed call, 1.25 GiB allocated, every page written, freed")
    state = state_of_at_least(args.size_mib * MiB)
    nbytes = state_bytes(state)
    train = TrainStep(args.matmul_size, args.matmuls)
    train()  # first call: thread pool and kernels, untimed
    args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-async-", dir=args.dir))
    targets: list[tuple[str, Callable[[Path], Any]]] = [
        ("local dir (LocalStore, fsync)", local_target)
    ]
    if not args.skip_s3:
        targets.append(("S3 (SeaweedFS on 127.0.0.1)", seaweed_target))
    results = []
    try:
        for i, (name, target) in enumerate(targets):
            where = scratch / f"target{i}"
            where.mkdir()
            result = TargetResult(name)
            with target(where) as new_store:
                print(f"measuring {name} ...", flush=True)
                with other_processes(result):
                    measure_blocked(state, new_store, where, args.reps, result)
                    measure_train_step(state, new_store, train, args.reps, args.steps_alone, result)
            results.append(result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(results, nbytes, train, args)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
