"""One rank of ``bench_dcp_multirank.py`` (2-rank DCP save/load: ckptstore against DCP's own
FileSystemWriter/Reader). Not meant to be run by hand.

Run as ``python dcp_multirank_child.py RANK WORLD PORT SCRATCH SIZE_GIB REPS OUT``. Every rank
builds its own Shard(0) slices of the transformer-like state (the full tensors never exist), then
all ranks run the same sequence of timed operations, each between two barriers. Rank 0 times
from the barrier before to the barrier after, gathers every rank's CPU-seconds and writes the
samples to ``OUT`` (JSON) for the parent to print.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

from bench_store import LAYERS, MIN_OTHER_WALL, VOCAB, cpu_seconds, rotated  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore.integrations import dcp as ckpt_dcp  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
RUN = "bench-dcp-multirank"
State = dict[str, DTensor]


# --------------------------------------------------------------------------------------------
# The state: bench_store.transformer_state's 340 tensors, each rank holding its Shard(0) slice


def layout(size_gib: float) -> tuple[int, list[tuple[str, tuple[int, ...], bool]]]:
    """(width, [(name, global shape, is_norm)]): the layout of ``bench_store.transformer_state``
    with the smallest width (a multiple of 32) whose fp32 total is at least ``size_gib``."""

    def params(d: int) -> int:
        return 2 * VOCAB * d + LAYERS * (12 * d * d + 13 * d) + 2 * d

    target = size_gib * GiB / 4
    dim = next((d for d in range(32, 16385, 32) if params(d) >= target), 16384)
    out: list[tuple[str, tuple[int, ...], bool]] = [("embed.weight", (VOCAB, dim), False)]
    for i in range(LAYERS):
        p = f"layers.{i}."
        out += [
            (p + "ln1.weight", (dim,), True),
            (p + "ln1.bias", (dim,), False),
            (p + "attn.qkv.weight", (3 * dim, dim), False),
            (p + "attn.qkv.bias", (3 * dim,), False),
            (p + "attn.out.weight", (dim, dim), False),
            (p + "attn.out.bias", (dim,), False),
            (p + "ln2.weight", (dim,), True),
            (p + "ln2.bias", (dim,), False),
            (p + "mlp.fc1.weight", (4 * dim, dim), False),
            (p + "mlp.fc1.bias", (4 * dim,), False),
            (p + "mlp.fc2.weight", (dim, 4 * dim), False),
            (p + "mlp.fc2.bias", (dim,), False),
        ]
    out += [
        ("final_ln.weight", (dim,), True),
        ("final_ln.bias", (dim,), False),
        ("head.weight", (VOCAB, dim), False),
    ]
    return dim, out


def sharded(local: torch.Tensor, shape: tuple[int, ...], mesh: DeviceMesh) -> DTensor:
    """A Shard(0) DTensor of global ``shape`` whose local slice is ``local`` (no copy)."""
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
    )


def build(
    size_gib: float, mesh: DeviceMesh, rank: int, world: int
) -> tuple[State, State, int, int]:
    """(state to save, preallocated zeroed state to load into, global bytes, width)."""
    dim, shapes = layout(size_gib)
    gen = torch.Generator().manual_seed(1000 + rank)
    source: State = {}
    dest: State = {}
    total = 0
    for name, shape, is_norm in shapes:
        assert shape[0] % world == 0, (name, shape)
        local_shape = (shape[0] // world, *shape[1:])
        local = torch.randn(*local_shape, generator=gen).mul_(0.02)
        if is_norm:
            local.add_(1.0)
        source[name] = sharded(local, shape, mesh)
        dest[name] = sharded(torch.zeros(local_shape), shape, mesh)
        total += 4 * int(np.prod(shape))
    return source, dest, total, dim


def mismatches(source: State, dest: State) -> list[str]:
    """Keys whose loaded local slice is not bit-identical to the saved one."""
    return [k for k in source if not torch.equal(source[k].to_local(), dest[k].to_local())]


def clear(dest: State) -> None:
    for value in dest.values():
        value.to_local().zero_()


# --------------------------------------------------------------------------------------------
# Memory temperature, CPU and RSS accounting, timing


def warm_memory(nbytes: int) -> None:
    """Touch ``nbytes`` (write every page) and free it: later allocations find warm pages."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0x5A)
    del buf


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


class Timer:
    """Runs one operation on every rank between barriers, after the same memory preparation."""

    def __init__(self, rank: int, world: int, warm_bytes: int) -> None:
        self.rank = rank
        self.world = world
        self.warm_bytes = warm_bytes
        self.samples: dict[str, list[dict[str, float]]] = {}

    def __call__(self, key: str, fn: Callable[[], Any]) -> Any:
        gc.collect()
        warm_memory(self.warm_bytes)
        dist.barrier()  # every rank has warmed before anyone's CPU snapshot
        _reset_peak_rss()
        rss0 = _status_kib("VmRSS")
        busy0 = cpu_seconds()[0] if self.rank == 0 else 0.0
        own0 = _own_cpu()
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        dist.barrier()
        wall = time.perf_counter() - t0
        own = _own_cpu() - own0
        busy = cpu_seconds()[0] - busy0 if self.rank == 0 else 0.0
        peak = _status_kib("VmHWM")
        owns: list[Any] = [None] * self.world
        dist.all_gather_object(owns, own)
        if self.rank == 0:
            ranks_cpu = float(sum(owns))
            other = max(0.0, busy - ranks_cpu)
            self.samples.setdefault(key, []).append(
                {
                    "s": wall,
                    "cpu": ranks_cpu,
                    "other": other / (wall * (os.cpu_count() or 1))
                    if wall >= MIN_OTHER_WALL
                    else -1.0,
                    "rss_peak_mib": peak / 1024,
                    "rss_extra_mib": max(0, peak - rss0) / 1024,
                }
            )
        return result


# --------------------------------------------------------------------------------------------
# The contenders


def dcp_writer(where: Path) -> FileSystemWriter:
    return FileSystemWriter(where, thread_count=2, sync_files=True)


def ckpt_round(
    timer: Timer, where: Path, source: State, dest: State, rank: int, out: dict[str, Any]
) -> list[str]:
    """ckptstore: a full save into a fresh store + SQLite manifest, a load, an unchanged
    re-save (the next step, same state, same store). Returns mismatched keys of the load."""
    db, store = str(where / "manifest.db"), str(where / "store")
    run = None
    if rank == 0:
        where.mkdir()
        run = ckptstore.open_run(RUN, db=db, store=store, async_save=False)  # untimed
    dist.barrier()
    target: Any = run if run is not None else store
    info = timer("ck_save", lambda: ckpt_dcp.save(source, target, 1))
    reader = ckptstore.open_run(RUN, db=db, store=store, writable=False)
    clear(dest)
    loaded = timer("ck_load", lambda: ckpt_dcp.load(dest, reader, 1))
    bad = mismatches(source, dest)
    assert loaded.step == 1
    again = timer("ck_resave", lambda: ckpt_dcp.save(source, target, 2))
    if rank == 0:
        assert info is not None
        assert again is not None
        out.setdefault("save_uploaded", []).append(info.uploaded_bytes)
        out.setdefault("save_logical", []).append(info.logical_bytes)
        out.setdefault("resave_uploaded", []).append(again.uploaded_bytes)
        out.setdefault("resave_logical", []).append(again.logical_bytes)
    reader.close()
    if run is not None:
        run.close()
    return bad


def dcp_round(timer: Timer, where: Path, source: State, dest: State, rank: int) -> list[str]:
    """DCP: save with FileSystemWriter into a fresh directory, load with FileSystemReader."""
    if rank == 0:
        where.mkdir()
    dist.barrier()
    timer("dcp_save", lambda: dcp_save(source, storage_writer=dcp_writer(where)))
    clear(dest)
    timer("dcp_load", lambda: dcp_load(dest, storage_reader=FileSystemReader(where)))
    return mismatches(source, dest)


def first_calls(scratch: Path, mesh: DeviceMesh, rank: int, world: int) -> dict[str, float]:
    """Untimed warm-up of both contenders on a tiny state (imports, planners, thread pools)."""
    tiny = {"w": sharded(torch.ones(8 // world, 4), (8, 4), mesh)}
    back = {"w": sharded(torch.zeros(8 // world, 4), (8, 4), mesh)}
    where = scratch / "first"
    if rank == 0:
        where.mkdir()
    dist.barrier()
    t0 = time.perf_counter()
    run = None
    if rank == 0:
        run = ckptstore.open_run(
            RUN, db=str(where / "m.db"), store=str(where / "s"), async_save=False
        )
    dist.barrier()
    ckpt_dcp.save(tiny, run if run is not None else str(where / "s"), 1)
    reader = ckptstore.open_run(RUN, db=str(where / "m.db"), store=str(where / "s"), writable=False)
    ckpt_dcp.load(back, reader, 1)
    reader.close()
    if run is not None:
        run.close()
    dist.barrier()
    t1 = time.perf_counter()
    dcp_save(tiny, storage_writer=dcp_writer(where / "dcp"))
    dcp_load(back, storage_reader=FileSystemReader(where / "dcp"))
    dist.barrier()
    t2 = time.perf_counter()
    if rank == 0:
        shutil.rmtree(where)
    dist.barrier()
    return {"ckptstore": t1 - t0, "dcp": t2 - t1}


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    scratch, size_gib, reps, out_path = (
        Path(sys.argv[4]),
        float(sys.argv[5]),
        int(sys.argv[6]),
        sys.argv[7],
    )
    # A file rendezvous: with rank 0 hosting a TCP store, a rank still shutting down its
    # process group after rank 0 exited can abort ("terminate called ..."). The port stays
    # in the arguments for the launcher's sake only.
    del port
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, init_method=f"file://{scratch / 'pg-rendezvous'}"
    )
    mesh = init_device_mesh("cpu", (world,))
    t0 = time.perf_counter()
    source, dest, total, dim = build(size_gib, mesh, rank, world)
    built = time.perf_counter() - t0
    rank_bytes = total // world
    # As bench_store: 1.25 GiB per rank touched and freed before every timed call (more for
    # states whose per-rank share is larger, so the warm pages always cover the operation).
    warm_bytes = max(int(1.25 * GiB), int(1.25 * rank_bytes))
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "world": world,
        "tensors": len(source),
        "total_bytes": total,
        "rank_bytes": rank_bytes,
        "dim": dim,
        "warm_bytes": warm_bytes,
        "build_s": built,
        "omp_threads": torch.get_num_threads(),
    }
    out["first_calls"] = first_calls(scratch, mesh, rank, world)
    out["rss_baseline_mib"] = _status_kib("VmRSS") / 1024
    timer = Timer(rank, world, warm_bytes)
    bad: list[str] = []
    for rep in range(reps):
        for name in rotated(["ckptstore", "dcp"], rep):
            where = scratch / f"rep{rep}-{name}"
            if name == "ckptstore":
                wrong = ckpt_round(timer, where, source, dest, rank, out)
            else:
                wrong = dcp_round(timer, where, source, dest, rank)
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, wrong)
            for r, keys in enumerate(gathered):
                bad += [f"repetition {rep + 1}, {name}, rank {r}: {k}" for k in keys]
            dist.barrier()
            if rank == 0:
                shutil.rmtree(where, ignore_errors=True)
            dist.barrier()
        if rank == 0:
            print(f"  repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    if rank == 0:
        out["samples"] = timer.samples
        out["mismatches"] = bad
        Path(out_path).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
