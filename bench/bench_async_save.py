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
     manifest): the default, whose snapshot buffers stay resident between saves, and
     ``keep_snapshot_buffers=False``, whose buffers' memory goes back to the kernel
     (``MADV_FREE``) after each save.
   Each save is waited for (untimed) before the next timed call, so uploads never overlap a
   measurement. The first save of each contender allocates its reusable buffers and is not
   timed. The ratio blocked/memcpy has a goal of at most 1.5x. Beside each time, the CPU-seconds
   the process used during the call (all threads: on a busy machine a steadier comparison than
   the wall time) and the page faults it took (medians): a snapshot that writes into buffers the
   kernel took back (``MADV_FREE``'d pages are the first it takes once the page cache has
   filled memory -- here the SeaweedFS server's files, and the 1.25 GiB that ``prepare``
   allocates before every call) faults in and zeroes the state's size of fresh pages, 2-3x the
   time of the copy. For both ``Run.save`` modes the process's *held* memory
   (``/proc/self/smaps_rollup``: Rss minus LazyFree, i.e. what the kernel cannot take back at
   will) is sampled every millisecond, on a fresh run of its own: its peak during a save and
   its level once the save is committed, above the level before the run's first save of the
   state -- what the run holds, its kept buffers included (goal: at most the state's size
   S + 512 MiB; issue 13 measured 2 S held for the life of a run).
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
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
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
from ckptstore.testing.memory import held_and_lazily_freed  # noqa: E402

MiB = 1 << 20
GOAL = 1.5
MEMORY_SLACK = 512 * MiB
MEMCPY = "memcpy into reused buffers"
RUN_SAVE = "Run.save (async_save=True)"
RUN_SAVE_GIVE_BACK = "Run.save (buffers given back)"
#: open_run options of each Run.save contender.
RUN_MODES: dict[str, dict[str, Any]] = {
    RUN_SAVE: {},
    RUN_SAVE_GIVE_BACK: {"keep_snapshot_buffers": False},
}


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
    #: contender -> page faults (minor and major) the process took during each timed call
    faults: dict[str, list[int]] = field(default_factory=dict)
    #: contender -> CPU-seconds (all threads) the process used during each timed call
    cpu: dict[str, list[float]] = field(default_factory=dict)
    upload_idle: Timings = field(default_factory=Timings)
    run_save: Timings = field(default_factory=Timings)
    step_alone: Timings = field(default_factory=Timings)
    step_in_flight: Timings = field(default_factory=Timings)
    upload_training: Timings = field(default_factory=Timings)
    #: Share of the machine's CPUs that other processes used while this target was measured.
    other_cpu: float = 0.0
    #: contender -> (peak held memory during a save, held memory after it), bytes above before
    memory: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


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


def held_memory() -> int:
    """Resident memory the kernel cannot take back at will: Rss minus LazyFree."""
    return held_and_lazily_freed()[0]


class MemoryPeak:
    """The peak of :func:`held_memory` while the block runs, sampled every millisecond."""

    def __init__(self) -> None:
        self.before = self.peak = held_memory()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, held_memory())
            time.sleep(0.001)

    def __enter__(self) -> MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, held_memory())


#: Page faults and CPU-seconds of the last :func:`timed` call.
last_faults = [0]
last_cpu = [0.0]


def page_faults() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    prepare()
    faults = page_faults()
    cpu = time.process_time()
    started = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - started
    last_cpu[0] = time.process_time() - cpu
    last_faults[0] = page_faults() - faults
    return seconds, result


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

    names = [MEMCPY, "ShardWriter.save", *RUN_MODES]
    out.blocked = {name: Timings() for name in names}
    out.faults = {name: [] for name in names}
    out.cpu = {name: [] for name in names}
    with (
        # One store per contender: a save never finds the other's blobs already stored.
        ShardWriter(new_store("shards")) as writer,
        open_run("bench-async", db=scratch / "manifest.db", store=new_store("run")) as run,
        open_run(
            "bench-give-back",
            db=scratch / "manifest.db",
            store=new_store("give-back"),
            **RUN_MODES[RUN_SAVE_GIVE_BACK],
        ) as give_back,
    ):
        runs = {RUN_SAVE: run, RUN_SAVE_GIVE_BACK: give_back}
        steps = iter(range(10**9))
        # Untimed first calls: the reusable buffers are allocated here, once.
        memcpy()
        blocked_shard_save(writer, state, TargetResult("untimed"))
        for name, opened in runs.items():
            blocked_run_save(opened, next(steps), state, TargetResult("untimed"), name)
        for rep in range(reps):
            touch(state, rep)
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                if name == MEMCPY:
                    seconds, _ = timed(memcpy)
                elif name == "ShardWriter.save":
                    seconds = blocked_shard_save(writer, state, out)
                else:
                    seconds = blocked_run_save(runs[name], next(steps), state, out, name)
                out.blocked[name].samples.append(seconds)
                out.faults[name].append(last_faults[0])
                out.cpu[name].append(last_cpu[0])
    measure_memory(state, new_store, scratch, out)


def blocked_shard_save(
    writer: ShardWriter, state: dict[str, torch.Tensor], out: TargetResult
) -> float:
    """The caller's time in ``ShardWriter.save``; then waits (untimed) for the upload."""
    seconds, handle = timed(lambda: writer.save({"policy": state}))
    (receipt,) = handle.receipts()
    out.upload_idle.samples.append(receipt.upload_seconds)
    return seconds


def blocked_run_save(
    run: Any, step: int, state: dict[str, torch.Tensor], out: TargetResult, name: str
) -> float:
    """The caller's time in ``Run.save``; then waits (untimed) for the commit."""
    seconds, handle = timed(lambda: run.save(step, {"policy": state}))
    info = handle.wait()
    if name == RUN_SAVE:
        out.run_save.samples.append(info.save_seconds or 0.0)
    return seconds


def measure_memory(
    state: dict[str, torch.Tensor], new_store: StoreFactory, scratch: Path, out: TargetResult
) -> None:
    """Held memory of each ``Run.save`` mode, on a fresh run of its own, after the timed part:
    the peak during a save and the level after its commit, above the level before the run's
    first save of the state (the run's kept buffers count). Untimed saves of their own:
    reading smaps_rollup every millisecond walks the page tables under the mmap lock, which
    would slow the snapshot it watches."""
    for i, (name, options) in enumerate(RUN_MODES.items()):
        out.memory[name] = []
        with open_run(
            f"bench-memory-{i}",
            db=scratch / "manifest.db",
            store=new_store(f"memory-{i}"),
            **options,
        ) as run:
            run.save(0, {"warm": torch.ones(4)}).wait()  # threads, connections, queries
            prepare()
            before = held_memory()
            for step in (1, 2):  # the first allocates the buffers, the second reuses them
                touch(state, 1000 + step)
                prepare()
                with MemoryPeak() as memory:
                    run.save(step, {"policy": state}).wait()
                out.memory[name].append((memory.peak - before, held_memory() - before))


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
        floor = result.blocked[MEMCPY].median
        print(f"\n[{result.name}]  other processes: {result.other_cpu:.0%} of the CPUs")
        cpu_floor = statistics.median(result.cpu[MEMCPY])
        print(
            f"{'blocked by':<30}{'median s':>10}{'GB/s':>8}{'x memcpy':>10}{'CPU-s':>8}"
            f"{'x memcpy':>10}{'faults':>9}   runs"
        )
        for name, timings in result.blocked.items():
            runs = " ".join(f"{s:.3f}" for s in timings.samples)
            ratio = timings.median / floor
            cpu = statistics.median(result.cpu[name])
            faults = statistics.median(result.faults[name])
            print(
                f"{name:<30}{timings.median:>10.3f}{nbytes / timings.median / 1e9:>8.2f}"
                f"{ratio:>9.2f}x{cpu:>8.3f}{cpu / cpu_floor:>9.2f}x{faults:>9.0f}   {runs}"
            )
        for name, timings in result.blocked.items():
            if not name.startswith("memcpy"):
                verdict = "MET" if timings.median / floor <= GOAL else "NOT MET"
                print(
                    f"  goal {name} <= {GOAL}x memcpy: {timings.median / floor:.2f}x -> {verdict}"
                )
        for name, samples in result.memory.items():
            peak = statistics.median(p for p, _ in samples)
            after = statistics.median(a for _, a in samples)
            verdict = "MET" if max(peak, after) <= nbytes + MEMORY_SLACK else "NOT MET"
            print(
                f"  held memory, {name}: peak during a save +{peak / MiB:.0f} MiB, after it "
                f"+{after / MiB:.0f} MiB (S = {nbytes / MiB:.0f} MiB; goal <= S + 512 MiB: "
                f"{verdict})"
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


def goal_rows(results: list[TargetResult], nbytes: int) -> list[dict[str, Any]]:
    """Issue 13's rows for ``bench/suite.py``: blocked time and held memory, per store."""
    rows: list[dict[str, Any]] = []
    for result in results:
        floor = result.blocked[MEMCPY].median
        for name in ("ShardWriter.save", RUN_SAVE):
            ours = result.blocked[name].median
            rows.append(
                {
                    "work": f"async save blocked, {name}, {result.name}",
                    "ours": ours,
                    "peer": MEMCPY,
                    "peer_value": floor,
                    "unit": "s",
                    "ratio": ours / floor,
                    "goal": f"<= {GOAL}x",
                    "met": ours / floor <= GOAL,
                }
            )
        samples = result.memory[RUN_SAVE]
        for when, values in (
            ("peak during", [p for p, _ in samples]),
            ("after", [a for _, a in samples]),
        ):
            ours = statistics.median(values) / MiB
            bound = (nbytes + MEMORY_SLACK) / MiB
            rows.append(
                {
                    "work": f"held memory {when} an async save of S={nbytes / MiB:.0f} MiB, "
                    f"{result.name}",
                    "ours": ours,
                    "peer": "S + 512 MiB",
                    "peer_value": bound,
                    "unit": "MiB",
                    "ratio": ours / bound,
                    "goal": "<= S + 512 MiB",
                    "met": ours <= bound,
                }
            )
    return rows


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
    parser.add_argument("--json", type=Path, help="write the goal rows here (bench/suite.py)")
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
    if args.json:
        args.json.write_text(json.dumps(goal_rows(results, nbytes), indent=1))
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
