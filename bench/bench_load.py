"""Loads against torch.distributed.checkpoint and the mmap loaders, side by side in one run.

The state is ``bench_save_vs_dcp.training_state``: fp32 weights plus AdamW's two moments
(``--weights-gib 1`` makes 3 GiB), saved once by each contender (untimed). Then, alternating
(the order rotates every repetition), memory warmed identically before every timed call:

- ``ckptstore Run.load``: the newest checkpoint of a run opened before the timed call, every
  blob's BLAKE3 digest verified, the tensors in memory the process owns;
- ``dcp.load``: ``FileSystemReader`` into a state dict of empty tensors of the right shapes
  (allocated untimed, untouched, so both pay the first touch of the destination pages);
- ``torch.load(mmap=True)`` and safetensors ``load_file`` (which maps the file), each followed
  by a pass that reads every byte (a sum over every tensor): a lazy mmap load that never reads
  its bytes measures nothing; these two are "the mmap loaders", which verify nothing.

Each load twice: from a **hot** page cache (the contender's files read just before, the other
contenders' files dropped from it, so that memory holds the contender's own), and with the
files **evicted** (every file of the contender's checkpoint dropped from the page cache with
``posix_fadvise(DONTNEED)`` before the timed call; the files were fsynced, so the pages are
clean and really go).

- ``ckptstore Run.load(into=, atomic=False)``: the same load into a state dict of empty tensors
  of the right shapes, as ``dcp.load`` gets, streamed (issue 26: filled in place, no second
  copy); and ``Run.load(into=)`` as a user calls it, atomic (issue 40: no tensor written until
  every blob has verified, so the load holds the bytes and copies them in at the end).

- ``ckptstore Run.load(into=, atomic=False)`` into tensors whose every page is resident
  already (those a previous load filled, as a model's state dict is), page cache hot: issue
  26's "hot load", a resume into the model's own tensors. The loads into empty tensors above
  also pay the kernel's first touch (a fault and a zeroed page) of every destination page.

Goals (issue 13): hot <= 1.0x the faster mmap loader, evicted <= 1.0x dcp.load; (issue 26) the
load into existing tensors evicted <= 1.0x dcp.load and <= 1.2x the read+hash floor, hot <=
1.25x its floor: into resident tensors the BLAKE3 floor, into empty tensors the first-touch
floor (below).

Beside the loads, the **peak resident memory of a load into existing tensors**: the tensors
a previous load filled (resident already) loaded into again, files evicted, the process's
peak resident set (``VmHWM``, reset first) above what it held before; goal (issue 26) <= +256
MiB. A load that allocates a second copy of the state grows it by the state's size.

A second floor, of an evicted verified load: **reading every blob file of ckptstore's store and
BLAKE3-hashing every byte**, on as many threads as there are CPUs, files evicted first.

Beside them, the floor of a verified load: **BLAKE3 over every byte** of the state already in
memory, on as many threads as there are CPUs (each tensor hashed on one thread, the GIL
released), timed like the loads. A load that checks every byte's digest cannot take less; on a
machine where this floor exceeds the mmap loaders' time, the hot goal cannot be met without
skipping verification. Printed, and written to ``--json`` as an information row.

And the floor of a verified load into **empty** tensors (allocated, never touched): **the
first touch of every destination page, then BLAKE3 over every byte**, a tensor per thread
(each thread writes one byte of every page of a fresh empty tensor -- the kernel's fault and
zeroed page, which no loader writing there can skip -- then hashes the state's tensor of the
same size). The BLAKE3 floor alone leaves that out: it hashes memory already resident.

Run: ``.venv/bin/python bench/bench_load.py [--weights-gib 1] [--reps 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

from bench_save_vs_dcp import (  # noqa: E402
    State,
    hash_tensors,
    info_row,
    nbytes,
    training_state,
)
from bench_store import Row, rotated, timed  # noqa: E402

from ckptstore import open_run  # noqa: E402
from ckptstore.serialize.compare import first_difference  # noqa: E402

GiB = 1 << 30
OURS = "ckptstore Run.load (verified)"
INTO = "ckptstore Run.load(into=, atomic=False) (verified)"
ATOMIC = "ckptstore Run.load(into=) atomic (verified)"
DCP = "dcp.load (FileSystemReader)"
TORCH_MMAP = "torch.load(mmap) + read all"
ST_MMAP = "safetensors load_file + read all"
MMAP_LOADERS = (TORCH_MMAP, ST_MMAP)
FLOOR = "BLAKE3 of every byte in memory"
TOUCH_FLOOR = "first touch of empty tensors + BLAKE3"
READ_FLOOR = "read + BLAKE3 of every blob file"
RESIDENT = "Run.load(into=, atomic=False) resident tensors"
#: Issue 26: a load into existing tensors grows the process's resident memory by this at most.
PEAK_GOAL_MIB = 256


def read_every_byte(state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Read every byte of every tensor (what a lazy mmap load leaves undone)."""
    for part in state.values():
        for t in part.values():
            flat = t.reshape(-1).view(torch.uint8)
            if flat.numel() % 8 == 0:
                flat = flat.view(torch.int64)
            flat.sum()


def touch_and_hash(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """For each (empty tensor, state tensor): write one byte of every page of the empty one
    (its first touch: a fault and a page the kernel zeroes), then BLAKE3 the state tensor; a
    pair per thread, one thread per CPU -- the floor of a verified load into empty tensors."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptstore.cas.digest import digest_bytes
    from ckptstore.serialize.dtypes import byte_view

    page = os.sysconf("SC_PAGE_SIZE")

    def one(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        empty, tensor = pair
        flat = byte_view(empty)
        flat[::page].fill_(0)  # an op: torch releases the GIL while it runs
        flat[-1:].fill_(0)  # the last page, if the stride stepped over it
        digest_bytes(byte_view(tensor).numpy())  # as hash_tensors does

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(one, pairs))


def files_of(root: Path) -> Iterator[Path]:
    for dirpath, _, names in os.walk(root):
        for name in names:
            yield Path(dirpath) / name


def evict(root: Path) -> None:
    """Drop every file under ``root`` from the page cache (they are clean: fsynced)."""
    for path in files_of(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_and_hash(root: Path) -> None:
    """Read every file under ``root`` and BLAKE3 every byte, a file per thread on every CPU:
    the floor of an evicted load that verifies what it reads."""
    from concurrent.futures import ThreadPoolExecutor

    from blake3 import blake3

    def one(path: Path) -> None:
        hasher = blake3(max_threads=1)
        with open(path, "rb", buffering=0) as f:
            while piece := f.read(1 << 20):
                hasher.update(piece)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(one, files_of(root)))


def resident_kib(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field}: the memory row needs Linux")


def load_peak_mib(load: Callable[[], Any]) -> float:
    """The peak resident memory of ``load()`` above what the process held before, in MiB."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from what is resident now
    except OSError as exc:
        raise SystemExit(
            f"cannot reset the peak resident memory ({exc}): the memory row "
            "needs a Linux kernel that takes /proc/self/clear_refs"
        ) from exc
    before = resident_kib("VmRSS")
    load()
    return (resident_kib("VmHWM") - before) / 1024


def empty_like(state: State) -> State:
    return {c: {k: torch.empty_like(v) for k, v in part.items()} for c, part in state.items()}


class Contenders:
    """Each contender's checkpoint, saved once, and its load."""

    def __init__(self, state: State, where: Path) -> None:
        import safetensors.torch
        import torch.distributed.checkpoint as dcp

        self.state, self.where = state, where
        self.run = open_run("bench", db=where / "m.db", store=where / "store", async_save=False)
        self.run.save(1, state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to ... single process"
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(where / "dcp", thread_count=2, sync_files=True),
            )
        (where / "pt").mkdir()
        torch.save(state, where / "pt" / "state.pt")
        (where / "st").mkdir()
        for name, part in state.items():
            safetensors.torch.save_file(part, where / "st" / f"{name}.safetensors")
        self.dirs = {
            OURS: where / "store",
            INTO: where / "store",
            ATOMIC: where / "store",
            DCP: where / "dcp",
            TORCH_MMAP: where / "pt",
            ST_MMAP: where / "st",
        }

    def load(self, name: str) -> Callable[[], Any]:
        if name == OURS:
            return lambda: self.run.load().state
        if name == INTO:
            into = empty_like(self.state)
            return lambda: self.run.load(into=into, atomic=False).state
        if name == ATOMIC:
            into = empty_like(self.state)
            return lambda: self.run.load(into=into).state
        if name == DCP:
            import torch.distributed.checkpoint as dcp

            target = empty_like(self.state)

            def dcp_load() -> State:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dcp.load(target, storage_reader=dcp.FileSystemReader(self.dirs[DCP]))
                return target

            return dcp_load
        if name == TORCH_MMAP:

            def torch_mmap() -> State:
                path = self.dirs[TORCH_MMAP] / "state.pt"
                loaded = torch.load(path, mmap=True, weights_only=True)
                read_every_byte(loaded)
                return loaded  # type: ignore[no-any-return]

            return torch_mmap

        def st_mmap() -> State:
            import safetensors.torch

            loaded = {
                part: safetensors.torch.load_file(self.dirs[ST_MMAP] / f"{part}.safetensors")
                for part in self.state
            }
            read_every_byte(loaded)
            return loaded

        return st_mmap

    def evict_others(self, name: str) -> None:
        """Drop the other contenders' files from the page cache before a hot load of
        ``name``: five copies of the state's files, besides the process's own copies of it,
        fill this machine's memory, and the kernel would then evict some of the files a hot
        load is about to read (its own, read once since, before the others' read twice)."""
        for where in set(self.dirs.values()) - {self.dirs[name]}:
            evict(where)

    def into_resident(self, hot: Row) -> float:
        """Loads into tensors that exist, every page of them resident (those a previous load
        filled): one timed into ``hot`` (files cached), then one with the files evicted, whose
        peak resident memory (MiB above before) is returned."""
        self.evict_others(INTO)
        filled = self.load(INTO)()
        timed("warm", hot, lambda: self.run.load(into=filled, atomic=False))
        evict(self.dirs[INTO])
        return load_peak_mib(lambda: self.run.load(into=filled, atomic=False))

    def close(self) -> None:
        self.run.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights-gib", type=float, default=1.0, help="fp32 weights (x3 loaded)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=str(BENCH_DIR / "out"))
    parser.add_argument("--json", help="write the goal rows here (for bench/suite.py)")
    args = parser.parse_args()

    state = training_state(args.weights_gib)
    size = nbytes(state)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    where = Path(tempfile.mkdtemp(dir=args.dir))
    print(
        f"{sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(f"state: {size / GiB:.2f} GiB fp32 (weights + AdamW moments); reps {args.reps}; medians")
    names = [OURS, INTO, ATOMIC, DCP, TORCH_MMAP, ST_MMAP]
    rows = {(cache, n): Row(f"load {cache}", n) for cache in ("hot", "evicted") for n in names}
    floor = Row("floor", FLOOR)
    touch_floor = Row("floor", TOUCH_FLOOR)
    read_floor = Row("floor evicted", READ_FLOOR)
    resident = Row("load hot", RESIDENT)
    everything = [t for part in state.values() for t in part.values()]
    contenders = Contenders(state, where)
    try:
        for name in names:  # untimed first call each: imports, first-use set-up
            contenders.load(name)()
        for name in (OURS, INTO, ATOMIC):
            loaded = contenders.load(name)()
            for part in state:
                if (difference := first_difference(state[part], loaded[part])) is not None:
                    raise SystemExit(f"{name} of {part!r} differs: {difference}")
            del loaded
        peaks: list[float] = []
        for rep in range(args.reps):
            for cache in ("hot", "evicted"):
                for name in rotated(names, rep):
                    if cache == "evicted":
                        evict(contenders.dirs[name])
                    else:
                        contenders.evict_others(name)
                        contenders.load(name)()  # bring its files into the page cache
                    result = timed("warm", rows[cache, name], contenders.load(name))
                    del result
            timed("warm", floor, lambda: hash_tensors(everything))
            # Fresh empty tensors each repetition, allocated untimed (freed after the floor).
            pairs = [(torch.empty_like(t), t) for t in everything]
            timed("warm", touch_floor, lambda pairs=pairs: touch_and_hash(pairs))
            del pairs
            evict(contenders.dirs[OURS])
            timed("warm", read_floor, lambda: read_and_hash(contenders.dirs[OURS]))
            peaks.append(contenders.into_resident(resident))
    finally:
        contenders.close()
        shutil.rmtree(where, ignore_errors=True)

    print()
    header = f"{'op':<13} {'contender':<36} {'median s':>8} {'GB/s':>6} {'CPU-s':>6}"
    print(f"{header} {'other%':>6}  runs")
    for row in [*rows.values(), resident, floor, touch_floor, read_floor]:
        runs = " ".join(f"{t:.3f}" for t in row.times)
        other = f"{100 * max(row.foreign):5.0f}%" if row.foreign else "   n/a"
        cpu = sorted(row.cpu)[len(row.cpu) // 2]
        print(
            f"{row.op:<13} {row.contender:<36} {row.median:8.3f} {size / row.median / 1e9:6.2f} "
            f"{cpu:6.2f} {other}  {runs}"
        )
    hot_peer = min(MMAP_LOADERS, key=lambda n: rows["hot", n].median)
    goals = [
        ("load 3 GiB-class state, page cache hot", "hot", hot_peer, "<= 1.0x the mmap loaders"),
        ("load, files evicted", "evicted", DCP, "<= 1.0x dcp.load"),
    ]
    into_goals = [
        (
            "load into existing tensors, files evicted",
            rows["evicted", INTO],
            rows["evicted", DCP],
            1.0,
            "<= 1.0x dcp.load",
        ),
        (
            "load into existing tensors, files evicted",
            rows["evicted", INTO],
            read_floor,
            1.2,
            "<= 1.2x read+hash floor",
        ),
        (
            "load into resident tensors, page cache hot",
            resident,
            floor,
            1.25,
            "<= 1.25x BLAKE3 floor",
        ),
        (
            "load into existing tensors, page cache hot",
            rows["hot", INTO],
            touch_floor,
            1.25,
            "<= 1.25x first-touch floor",
        ),
    ]
    out = []
    print()
    for work, cache, peer, goal in goals:
        ours, theirs = rows[cache, OURS].median, rows[cache, peer].median
        print(f"{work}: ckptstore / {peer} = {ours / theirs:.2f}x (goal {goal})")
        out.append(
            {
                "work": f"{work} ({size / GiB:.2f} GiB)",
                "ours": ours,
                "peer": peer,
                "peer_value": theirs,
                "unit": "s",
                "ratio": ours / theirs,
                "goal": goal,
                "met": ours <= theirs,
            }
        )
    for work, ours_row, peer_row, bound, goal in into_goals:
        ours, theirs = ours_row.median, peer_row.median
        print(f"{work}: ckptstore / {peer_row.contender} = {ours / theirs:.2f}x (goal {goal})")
        out.append(
            {
                "work": f"{work} ({size / GiB:.2f} GiB)",
                "ours": ours,
                "peer": peer_row.contender,
                "peer_value": theirs,
                "unit": "s",
                "ratio": ours / theirs,
                "goal": goal,
                "met": ours <= bound * theirs,
            }
        )
    theirs = rows["hot", hot_peer].median
    print(
        f"{FLOOR} ({os.cpu_count()} threads): {floor.median:.3f} s = "
        f"{floor.median / theirs:.2f}x {hot_peer} (a verified load cannot take less)"
    )
    floor_work = f"floor: BLAKE3 of every byte in memory, {os.cpu_count()} threads"
    out.insert(1, info_row(floor_work, floor.median, hot_peer, theirs))
    print(
        f"{TOUCH_FLOOR} ({os.cpu_count()} threads): {touch_floor.median:.3f} s = "
        f"{touch_floor.median / floor.median:.2f}x the BLAKE3 floor (the first touch of 3 GiB "
        "of empty tensors, which a load into them cannot skip)"
    )
    out.append(
        info_row(
            f"floor: first touch of empty tensors + BLAKE3, {os.cpu_count()} threads",
            touch_floor.median,
            FLOOR,
            floor.median,
        )
    )
    peak = sorted(peaks)[len(peaks) // 2]
    print(
        f"peak resident memory of a load into existing tensors, files evicted: +{peak:.0f} MiB "
        f"(goal <= +{PEAK_GOAL_MIB} MiB; runs {' '.join(f'{p:.0f}' for p in peaks)})"
    )
    out.append(
        {
            "work": f"peak resident memory of a load into existing tensors ({size / GiB:.2f} GiB)",
            "ours": peak,
            "peer": f"+{PEAK_GOAL_MIB} MiB",
            "peer_value": PEAK_GOAL_MIB,
            "unit": "MiB",
            "ratio": peak / PEAK_GOAL_MIB,
            "goal": f"<= +{PEAK_GOAL_MIB} MiB",
            "met": peak <= PEAK_GOAL_MIB,
        }
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
