"""Storage benchmark: ckptstore against torch.save/torch.load and safetensors on one local disk.

Run: ``.venv/bin/python bench/bench_store.py [--size-gib 1.0] [--reps 3] [--dir DIR]``.

Every contender saves the same transformer-like fp32 state dict into the same directory tree and
loads it back; saves are timed until the bytes are fsynced. Memory temperature is controlled as
/work/shared/ENVIRONMENT.md asks: immediately before every timed operation of every contender the
allocator is warmed the same way (~1.25 GiB allocated, every page written, freed), and the
contenders alternate A B C A B C within each repetition. Nothing is dropped from the page cache
between a save and its load, so every load reads from a hot page cache. Results are medians.

Optional extras (off by default, not part of ``make bench``):
``--sweep`` times ckptstore saves and loads with other ``WriterOptions`` / ``max_workers`` values,
``--stages`` times the stages of a ckptstore save and load on their own (hashing, codec choice,
writes, fsyncs, reads), and ``--memory cold`` measures cold memory (idle 5 s before each op).

Everything is written under ``--dir`` (default ``bench/out/``), in a scratch folder that is
removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ckptstore.cas import BlobWriter, Kind, WriterOptions, put_blob
from ckptstore.cas import codec as codecs
from ckptstore.cas.digest import blob_key, digest_bytes
from ckptstore.objectstore import LocalStore
from ckptstore.serialize import load_component, write_component
from ckptstore.serialize.compare import first_difference

MiB = 1 << 20
GiB = 1 << 30
WARM_BYTES = int(1.25 * GiB)
COLD_IDLE_S = 5.0
BENCH_DIR = Path(__file__).resolve().parent
VOCAB = 32000
LAYERS = 28
MIN_OTHER_WALL = 0.2


# --------------------------------------------------------------------------------------------
# The state dict


def transformer_state(size_gib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A GPT-like fp32 state dict of about ``size_gib`` GiB: 28 layers, 340 tensors.

    Per layer: two layernorms (weight, bias), fused qkv, attention out, mlp fc1 (4x) and fc2,
    each with a bias (12 tensors); plus the token embedding, the final layernorm and the head.
    The width is chosen to hit the size; the tensor count does not change with it.
    """
    target = size_gib * GiB / 4  # fp32 elements

    def params(d: int) -> int:
        return 2 * VOCAB * d + LAYERS * (12 * d * d + 13 * d) + 2 * d

    dim = min(range(32, 8193, 32), key=lambda d: abs(params(d) - target))
    gen = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).mul_(0.02)

    def norm(d: int) -> torch.Tensor:
        return torch.randn(d, generator=gen).mul_(0.02).add_(1.0)

    state: dict[str, torch.Tensor] = {"embed.weight": weight(VOCAB, dim)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        state[p + "ln1.weight"] = norm(dim)
        state[p + "ln1.bias"] = weight(dim)
        state[p + "attn.qkv.weight"] = weight(3 * dim, dim)
        state[p + "attn.qkv.bias"] = weight(3 * dim)
        state[p + "attn.out.weight"] = weight(dim, dim)
        state[p + "attn.out.bias"] = weight(dim)
        state[p + "ln2.weight"] = norm(dim)
        state[p + "ln2.bias"] = weight(dim)
        state[p + "mlp.fc1.weight"] = weight(4 * dim, dim)
        state[p + "mlp.fc1.bias"] = weight(4 * dim)
        state[p + "mlp.fc2.weight"] = weight(dim, 4 * dim)
        state[p + "mlp.fc2.bias"] = weight(dim)
    state["final_ln.weight"] = norm(dim)
    state["final_ln.bias"] = weight(dim)
    state["head.weight"] = weight(VOCAB, dim)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# --------------------------------------------------------------------------------------------
# Memory temperature and timing


def warm_memory() -> None:
    """Touch ~1.25 GiB (write every page) and free it: later allocations find warm pages."""
    buf = np.empty(WARM_BYTES, dtype=np.uint8)
    buf.fill(0x5A)
    del buf


def prepare(memory: str) -> None:
    """Bring memory to the same state before a timed operation."""
    gc.collect()
    if memory == "warm":
        warm_memory()
    else:
        time.sleep(COLD_IDLE_S)


def _kernel_thread_ticks() -> int:
    """CPU ticks used so far by kernel threads (writeback, journal), which work for us too."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[1] == "2" or entry.name == "2":  # parent is kthreadd
            total += int(fields[11]) + int(fields[12])
    return total


def cpu_seconds() -> tuple[float, float]:
    """(CPU-seconds used by all user-space processes, CPU-seconds used by this process)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4] - _kernel_thread_ticks()  # minus idle, iowait
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


@dataclass
class Row:
    op: str
    contender: str
    note: str = ""
    times: list[float] = field(default_factory=list)
    #: Share of the machine's CPUs that other user-space processes used while timed.
    foreign: list[float] = field(default_factory=list)
    #: CPU-seconds (user + system, all threads) this process used per run.
    cpu: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def timed(memory: str, row: Row, fn: Callable[[], Any]) -> Any:
    prepare(memory)
    busy0, own0 = cpu_seconds()
    t0 = time.perf_counter()
    result = fn()
    wall = time.perf_counter() - t0
    busy1, own1 = cpu_seconds()
    row.times.append(wall)
    row.cpu.append(own1 - own0)
    if wall >= MIN_OTHER_WALL:  # /proc/stat counts 10 ms ticks: shorter runs say nothing
        other = max(0.0, (busy1 - busy0) - (own1 - own0))
        row.foreign.append(other / (wall * (os.cpu_count() or 1)))
    return result


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Contenders


def ckpt_save(state: Any, root: Path, options: WriterOptions | None = None) -> str:
    with BlobWriter(LocalStore(root), options) as writer:
        return write_component(writer, state).index_digest


def ckpt_load(root: Path, digest: str, max_workers: int = 0) -> Any:
    return load_component(LocalStore(root), digest, max_workers=max_workers)


def torch_save(state: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def safetensors_save(state: dict[str, torch.Tensor], path: Path) -> None:
    save_file(state, path)
    fsync_path(path)


def first_calls(scratch: Path) -> None:
    """Untimed warm-up of every contender on a tiny state: one-time costs (lazy imports, thread
    pools) stay out of the medians. The first ckptstore call is timed and reported."""
    tiny = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    d = scratch / "first"
    d.mkdir()
    t0 = time.perf_counter()
    digest = ckpt_save(tiny, d / "store")
    t1 = time.perf_counter()
    ckpt_load(d / "store", digest)
    t2 = time.perf_counter()
    torch_save(tiny, d / "t.pt")
    torch.load(d / "t.pt", weights_only=True)
    torch.load(d / "t.pt", weights_only=True, mmap=True)
    safetensors_save(tiny, d / "t.st")
    load_file(d / "t.st")
    load_file(d / "t.st", backend="pread")
    t3 = time.perf_counter()
    shutil.rmtree(d)
    print(
        f"first calls (untimed warm-up, tiny state): ckptstore save {t1 - t0:.3f} s, "
        f"load {t2 - t1:.3f} s; all torch + safetensors calls together {t3 - t2:.3f} s"
    )


def run_main(
    state: dict[str, torch.Tensor], scratch: Path, reps: int, memory: str, mismatches: list[str]
) -> tuple[list[Row], dict[str, Row]]:
    """The headline comparison; returns the rows and, by key, the ones ratios are taken from.

    Every ckptstore load is compared bit for bit with the state (untimed); differences are
    appended to ``mismatches``.
    """
    r = {
        "ck_save": Row("save", "ckptstore write_component", "LocalStore, fsync per object"),
        "pt_save": Row("save", "torch.save + fsync"),
        "st_save": Row("save", "safetensors save_file + fsync"),
        "ck_load": Row("load", "ckptstore load_component", "eager, every digest verified"),
        "pt_load": Row("load", "torch.load(weights_only=True)", "eager"),
        "pt_mmap": Row("load", "torch.load(mmap=True) [extra]", "lazy mmap, bytes not read"),
        "st_load": Row("load", "safetensors load_file", "lazy mmap (default), bytes not read"),
        "st_pread": Row("load", "safetensors load_file(pread)", "eager"),
    }
    first_calls(scratch)
    for rep in range(reps):
        rep_dir = scratch / f"rep{rep}"
        rep_dir.mkdir()
        # A: ckptstore, into a fresh empty store so nothing deduplicates.
        store_dir = rep_dir / "store"
        digest = timed(memory, r["ck_save"], lambda d=store_dir: ckpt_save(state, d))
        loaded = timed(memory, r["ck_load"], lambda d=store_dir, g=digest: ckpt_load(d, g))
        # Outside timing, every repetition (a race would not show every time).
        difference = first_difference(state, loaded)
        if difference:
            mismatches.append(f"repetition {rep + 1}: {difference}")
        del loaded
        # B: torch.save / torch.load.
        pt_path = rep_dir / "state.pt"
        timed(memory, r["pt_save"], lambda p=pt_path: torch_save(state, p))
        loaded = timed(
            memory, r["pt_load"], lambda p=pt_path: torch.load(p, weights_only=True, mmap=False)
        )
        del loaded
        loaded = timed(
            memory, r["pt_mmap"], lambda p=pt_path: torch.load(p, weights_only=True, mmap=True)
        )
        del loaded
        # C: safetensors.
        st_path = rep_dir / "state.safetensors"
        timed(memory, r["st_save"], lambda p=st_path: safetensors_save(state, p))
        loaded = timed(memory, r["st_load"], lambda p=st_path: load_file(p))
        del loaded
        loaded = timed(memory, r["st_pread"], lambda p=st_path: load_file(p, backend="pread"))
        del loaded
        shutil.rmtree(rep_dir)
        print(f"  repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    order = [
        "ck_save",
        "pt_save",
        "st_save",
        "ck_load",
        "pt_load",
        "st_pread",
        "pt_mmap",
        "st_load",
    ]
    return [r[k] for k in order], r


def other_cpu(row: Row) -> str:
    return f"{max(row.foreign):.0%}" if row.foreign else "n/a"


def print_table(rows: list[Row], nbytes: int, ours: dict[str, Row]) -> None:
    print(
        f"{'op':<5} {'contender':<31} {'median s':>8} {'GB/s':>6} {'ckpt/peer':>9} "
        f"{'cpu s':>6} {'other%':>6}  note"
    )
    for row in rows:
        mine = ours[row.op]
        ratio = "" if row is mine else f"{mine.median / row.median:.2f}x"
        gbps = nbytes / row.median / 1e9
        print(
            f"{row.op:<5} {row.contender:<31} {row.median:>8.3f} {gbps:>6.2f} {ratio:>9} "
            f"{statistics.median(row.cpu):>6.2f} {other_cpu(row):>6}  {row.note}"
        )
        print(f"{'':<5} {'':<31} runs: {' '.join(f'{t:.3f}' for t in row.times)}")
    print(
        "cpu s = median CPU-seconds (user+system, all threads) of this process per run; "
        "other% = largest\nshare of the machine's CPUs used by OTHER user-space processes during "
        "a timed run (/proc/stat\nminus this process and kernel threads; 10 ms ticks, so n/a for "
        "runs under 0.2 s)"
    )


# --------------------------------------------------------------------------------------------
# Compression ratios


def compression_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    n32 = 64 * MiB // 4
    w = torch.randn(2 * n32, generator=gen).mul_(0.02)
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.zipf(1.2, 64 * MiB // 8) % VOCAB)
    return [
        ("fp32 weights (randn*0.02)", w[:n32].clone()),
        ("bf16 weights (same dist.)", w.to(torch.bfloat16)),
        ("int64 token ids (Zipf 1.2, 32k)", ids),
    ]


def tensor_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy().data)


def run_compression(scratch: Path, reps: int) -> None:
    store = LocalStore(scratch / "compress")
    auto = codecs.min_gain(codecs.Compression.AUTO, store.write_bandwidth_hint)
    print(
        f"threshold: always = {codecs.MIN_GAIN:.0%} saving; auto on LocalStore = {auto:.0%} "
        f"(write_bandwidth_hint {store.write_bandwidth_hint / 1e9:.1f} GB/s / "
        f"COMPRESS_BYTES_PER_S {codecs.COMPRESS_BYTES_PER_S / 1e9:.1f} GB/s)"
    )
    print(
        f"{'tensor':<32} {'MiB':>5} {'codec(always)':>14} {'ratio':>6} {'enc MB/s':>9} "
        f"{'dec MB/s':>9} {'auto picks':>11}"
    )
    for name, tensor in compression_tensors():
        view = tensor_view(tensor)
        itemsize = tensor.element_size()
        float_like = tensor.is_floating_point()
        ref = put_blob(
            store,
            view,
            Kind.CHUNK,
            itemsize=itemsize,
            float_like=float_like,
            threshold=codecs.MIN_GAIN,
        )
        enc_t, dec_t = [], []
        enc = None
        for _ in range(reps):
            warm_memory()
            t0 = time.perf_counter()
            enc = codecs.encode(
                view, itemsize=itemsize, float_like=float_like, threshold=codecs.MIN_GAIN
            )
            enc_t.append(time.perf_counter() - t0)
        assert enc is not None
        payload = memoryview(b"".join(enc.payload))
        for _ in range(reps):
            warm_memory()
            t0 = time.perf_counter()
            out = enc.codec.decode(
                payload, view.nbytes, itemsize=enc.itemsize, params=enc.params, where=name
            )
            dec_t.append(time.perf_counter() - t0)
        if out.tobytes() != view.tobytes():
            raise SystemExit(f"{name}: codec round trip is not exact")
        del out, payload
        picked = codecs.encode(view, itemsize=itemsize, float_like=float_like, threshold=auto)
        mb = view.nbytes / 1e6
        codec_name = ref.codec or "?"
        print(
            f"{name:<32} {view.nbytes / MiB:>5.0f} {codec_name:>14} "
            f"{ref.logical_bytes / ref.stored_bytes:>5.2f}x "
            f"{mb / statistics.median(enc_t):>9.0f} {mb / statistics.median(dec_t):>9.0f} "
            f"{picked.codec.name:>11}"
        )
        del enc, picked
    shutil.rmtree(store.root)


# --------------------------------------------------------------------------------------------
# Extras: WriterOptions sweep and stage timings


def rotated(items: list[Any], n: int) -> list[Any]:
    n %= len(items)
    return items[n:] + items[:n]


def run_sweep(state: dict[str, torch.Tensor], scratch: Path, reps: int, memory: str) -> None:
    """ckptstore save/load under other settings, with torch.save/torch.load as the reference."""
    nbytes = state_bytes(state)
    variants: list[tuple[str, WriterOptions]] = [("defaults", WriterOptions())]
    variants += [(f"max_workers={n}", WriterOptions(max_workers=n)) for n in (1, 2, 3, 4, 8)]
    variants += [
        (f"chunk_bytes={c} MiB", WriterOptions(chunk_bytes=c * MiB)) for c in (16, 32, 128, 256)
    ]
    variants += [
        (f"max_inflight_bytes={m} MiB", WriterOptions(max_inflight_bytes=m * MiB))
        for m in (128, 256, 1024)
    ]
    variants += [
        ("max_workers=2, chunk 128 MiB", WriterOptions(max_workers=2, chunk_bytes=128 * MiB)),
        ("compression=never", WriterOptions(compression="never")),
    ]
    saves = [Row("save", name) for name, _ in variants]
    loads = [Row("load", f"max_workers={n or 'default'}") for n in (0, 1, 2, 4, 8)]
    ref_save, ref_load = Row("save", "torch.save + fsync"), Row("load", "torch.load")
    for rep in range(reps):
        d = scratch / f"sweep{rep}"
        d.mkdir()
        timed(memory, ref_save, lambda p=d / "s.pt": torch_save(state, p))
        timed(memory, ref_load, lambda p=d / "s.pt": torch.load(p, weights_only=True))
        digest = ckpt_save(state, d / "store")  # loaded below; untimed
        # The order rotates every repetition, so no setting always runs first or last.
        order = rotated(list(range(len(variants))), rep)
        for i in order:
            root = d / f"store{i}"
            timed(memory, saves[i], lambda r=root, o=variants[i][1]: ckpt_save(state, r, o))
            shutil.rmtree(root)
        for row, n in rotated(list(zip(loads, (0, 1, 2, 4, 8), strict=True)), rep):
            timed(memory, row, lambda r=d / "store", g=digest, w=n: ckpt_load(r, g, w))
        shutil.rmtree(d)
        print(f"  sweep repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    print(
        f"{'op':<5} {'ckptstore setting':<32} {'median s':>9} {'GB/s':>6} {'vs torch':>9} "
        f"{'other%':>6}"
    )
    for row in [ref_save, *saves, ref_load, *loads]:
        ref = ref_save if row.op == "save" else ref_load
        print(
            f"{row.op:<5} {row.contender:<32} {row.median:>9.3f} "
            f"{nbytes / row.median / 1e9:>6.2f} {row.median / ref.median:>8.2f}x "
            f"{other_cpu(row):>6}"
        )


def chunk_views(state: dict[str, torch.Tensor], options: WriterOptions) -> list[memoryview]:
    """The byte ranges write_component stores as chunks (small tensors left out)."""
    out = []
    for t in state.values():
        view = tensor_view(t)
        if view.nbytes < options.pack_threshold:
            continue
        step = options.chunk_bytes // t.element_size() * t.element_size()
        out += [view[s : s + step] for s in range(0, view.nbytes, step)]
    return out


class BatchedDirSyncStore(LocalStore):
    """PROTOTYPE, not library code: LocalStore that fsyncs each file as it is written but each
    directory only once, in :meth:`flush` (which the caller runs before declaring the save
    durable). Relies on LocalStore's private ``_fsync_dir``."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self._dirs: set[Path] = set()
        self._dirs_lock = threading.Lock()

    def _fsync_dir(self, directory: Path) -> None:
        with self._dirs_lock:
            self._dirs.add(directory)

    def flush(self) -> None:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(fsync_path, sorted(self._dirs)))


class DeferredSyncStore(LocalStore):
    """PROTOTYPE, not library code: LocalStore that writes without fsync and makes everything
    durable in :meth:`flush` (every new file, then every directory, once)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, fsync=False)
        self._paths: set[Path] = set()
        self._paths_lock = threading.Lock()

    def put(self, key: str, data: Any) -> bool:
        created = super().put(key, data)
        if created:
            with self._paths_lock:
                self._paths.add(self.root / key)
        return created

    def flush(self) -> None:
        dirs = {d for p in self._paths for d in p.relative_to(self.root).parents}
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(fsync_path, sorted(self._paths)))
            list(pool.map(fsync_path, sorted((self.root / d for d in dirs), reverse=True)))


class MmapStore(LocalStore):
    """PROTOTYPE, not library code: LocalStore whose ``get_view`` maps the object file
    (MAP_PRIVATE, copy-on-write) instead of reading it into anonymous memory. Digest
    verification still reads every byte (through the mapping); a raw chunk's tensor is then
    backed by the page cache until it is written to."""

    def get_view(self, key: str) -> memoryview:
        with open(self.root / key, "rb") as f:
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            return memoryview(mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=prot))


def ckpt_save_prototype(state: Any, store: BatchedDirSyncStore | DeferredSyncStore) -> str:
    with BlobWriter(store) as writer:
        digest = write_component(writer, state).index_digest
    store.flush()
    return digest


def run_stages(state: dict[str, torch.Tensor], scratch: Path, reps: int, memory: str) -> None:
    """The pieces of a ckptstore save and load timed alone, over the chunks a default save
    produces, interleaved with the real calls, prototypes of changes, and torch."""
    import blake3

    options = WriterOptions()
    views = chunk_views(state, options)
    nbytes = sum(v.nbytes for v in views)
    keys = [blob_key(digest_bytes(v)) for v in views]
    workers = options.workers()
    auto = codecs.min_gain(codecs.Compression.AUTO, LocalStore.write_bandwidth_hint)
    counter = iter(range(1 << 30))

    def fresh() -> Path:
        return scratch / f"stage{next(counter)}"

    def pool_map(fn: Callable[[Any], Any], items: list[Any], n: int) -> list[Any]:
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(fn, items))

    def put_all(n: int, fsync: bool = True) -> None:
        store = LocalStore(fresh(), fsync=fsync)
        pool_map(lambda kv: store.put(*kv), list(zip(keys, views, strict=True)), n)

    def single_file() -> None:
        with open(fresh(), "wb", buffering=0) as f:
            for v in views:
                f.write(v)
            os.fsync(f.fileno())

    def encode(v: memoryview) -> Any:
        return codecs.encode(v, itemsize=4, float_like=True, threshold=auto)

    def digest_1t(v: memoryview) -> bytes:
        return blake3.blake3(v, max_threads=1).digest()  # type: ignore[no-any-return]

    stages: list[tuple[str, Callable[[], Any]]] = [
        ("hash: digest_bytes, serial", lambda: [digest_bytes(v) for v in views]),
        (f"hash: digest_bytes, {workers} threads", lambda: pool_map(digest_bytes, views, workers)),
        ("hash: blake3 1 thread each, 2 threads", lambda: pool_map(digest_1t, views, 2)),
        (f"codec choice (auto), {workers} threads", lambda: pool_map(encode, views, workers)),
        (f"LocalStore.put, {workers} threads", lambda: put_all(workers)),
        (f"LocalStore.put, no fsync, {workers} thr", lambda: put_all(workers, fsync=False)),
        ("one file: write + fsync (floor)", single_file),
        ("write_component (defaults)", lambda: ckpt_save(state, fresh())),
        (
            "PROTOTYPE dir fsyncs once, at the end",
            lambda: ckpt_save_prototype(state, BatchedDirSyncStore(fresh())),
        ),
        (
            "PROTOTYPE all fsyncs deferred to the end",
            lambda: ckpt_save_prototype(state, DeferredSyncStore(fresh())),
        ),
        ("torch.save + fsync", lambda: torch_save(state, fresh())),
    ]
    rows = [Row("stage", name) for name, _ in stages]
    for rep in range(reps):
        for (_, fn), row in zip(stages, rows, strict=True):
            timed(memory, row, fn)
        for p in scratch.glob("stage*"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        print(f"  save-stage repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    dirs = len({k.split("/")[1] for k in keys})
    print(
        f"save stages over the {len(views)} chunks ({dirs} cas/ directories), "
        f"{nbytes / GiB:.2f} GiB:"
    )
    print_stage_rows(rows, nbytes)

    # Load stages: read every object of a stored component, then verify digests.
    from ckptstore.cas import get_blob
    from ckptstore.cas.digest import digest_from_key

    root = fresh()
    digest = ckpt_save(state, root)
    torch_path = fresh()
    torch_save(state, torch_path)
    store = LocalStore(root)
    difference = first_difference(state, load_component(MmapStore(root), digest))
    if difference:
        raise SystemExit(f"mmap prototype did not reload the state bit for bit: {difference}")
    objects = [info.key for info in store.list("cas/")]
    total = sum(store.head(k).size for k in objects)
    digests = [digest_from_key(k) for k in objects]

    load_stages: list[tuple[str, Callable[[], Any]]] = [
        (f"LocalStore.get all, {workers} threads", lambda: pool_map(store.get, objects, workers)),
    ]
    if hasattr(store, "get_view"):
        load_stages.append(
            (
                f"LocalStore.get_view all, {workers} thr",
                lambda: pool_map(store.get_view, objects, workers),
            )
        )
    load_stages += [
        (
            f"get_blob (read + verify), {workers} thr",
            lambda: pool_map(lambda g: get_blob(store, g), digests, workers),
        ),
        ("load_component (defaults)", lambda: ckpt_load(root, digest)),
        ("load_component, max_workers=2", lambda: ckpt_load(root, digest, 2)),
        (
            "PROTOTYPE load_component, mmap get_view",
            lambda: load_component(MmapStore(root), digest),
        ),
        ("torch.load(weights_only=True)", lambda: torch.load(torch_path, weights_only=True)),
    ]
    load_rows = [Row("stage", name) for name, _ in load_stages]
    for rep in range(reps):
        for (_, fn), row in zip(load_stages, load_rows, strict=True):
            result = timed(memory, row, fn)
            del result
        print(f"  load-stage repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    print(f"load stages over the {len(objects)} stored objects, {total / GiB:.2f} GiB:")
    print_stage_rows(load_rows, total)
    shutil.rmtree(root)
    torch_path.unlink()


def print_stage_rows(rows: list[Row], nbytes: int) -> None:
    print(f"  {'':<42} {'median s':>8} {'GB/s':>6} {'cpu s':>6} {'other%':>6}")
    for row in rows:
        print(
            f"  {row.contender:<42} {row.median:>8.3f} {nbytes / row.median / 1e9:>6.2f} "
            f"{statistics.median(row.cpu):>6.2f} {other_cpu(row):>6}"
        )


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="state size (default 1.0)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported")
    parser.add_argument(
        "--dir", type=Path, default=BENCH_DIR / "out", help="parent of the scratch folder"
    )
    parser.add_argument("--memory", choices=["warm", "cold"], default="warm")
    parser.add_argument("--sweep", action="store_true", help="also sweep WriterOptions")
    parser.add_argument("--stages", action="store_true", help="also time save/load stages")
    parser.add_argument("--no-compression", action="store_true", help="skip the codec table")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.size_gib <= 0:
        parser.error("--reps must be >= 1 and --size-gib > 0")

    scratch = args.dir.resolve() / f"bench-store-{os.getpid()}"
    mismatches: list[str] = []
    scratch.mkdir(parents=True)
    try:
        state = transformer_state(args.size_gib)
        nbytes = state_bytes(state)
        mem = (
            "WARM: before every timed op, 1.25 GiB allocated, every page written, then freed"
            if args.memory == "warm"
            else f"COLD: {COLD_IDLE_S:.0f} s idle before every timed op"
        )
        print(
            f"state: {len(state)} fp32 tensors, {nbytes / GiB:.3f} GiB "
            f"({nbytes / 1e9:.3f} GB), width {state['embed.weight'].shape[1]}, {LAYERS} layers"
        )
        print(f"disk:  {scratch}")
        print(f"reps:  {args.reps}, medians; contenders alternate A B C per repetition")
        print(f"memory: {mem}")
        print("loads: from a HOT page cache (nothing dropped between save and load)")
        print(
            f"torch {torch.__version__}, {os.cpu_count()} CPUs; ckptstore library defaults: "
            f"{WriterOptions().workers()} writer threads, "
            f"{getattr(LocalStore, 'read_concurrency', 'default')} load threads"
        )
        print()
        rows, r = run_main(state, scratch, args.reps, args.memory, mismatches)
        ours = {"save": r["ck_save"], "load": r["ck_load"]}
        print_table(rows, nbytes, ours)
        if mismatches:
            print(f"ckptstore round trip: NOT BIT-EXACT in {len(mismatches)}/{args.reps} loads:")
            for m in mismatches:
                print(f"  {m}")
        else:
            print(f"ckptstore round trip: bit-exact (all {args.reps} loads checked, untimed)")
        ck = r["ck_save"].median + r["ck_load"].median
        pt = r["pt_save"].median + r["pt_load"].median
        print()
        print("target: ckptstore within 1.0x of torch.save+fsync / torch.load (wall time)")
        for op, a, b in (
            ("save", r["ck_save"], r["pt_save"]),
            ("load", r["ck_load"], r["pt_load"]),
        ):
            ratio = a.median / b.median
            print(f"  {op}: {ratio:.2f}x  -> {'MET' if ratio <= 1.0 else 'MISSED'}")
        print(
            f"  save+load: {ck:.3f} s vs {pt:.3f} s = {ck / pt:.2f}x  -> "
            f"{'MET' if ck <= pt else 'MISSED'}"
        )
        if not args.no_compression:
            print()
            print("compression (ckptstore.cas.put_blob, compression='always' threshold):")
            run_compression(scratch, args.reps)
        if args.stages:
            print()
            run_stages(state, scratch, args.reps, args.memory)
        if args.sweep:
            print()
            run_sweep(state, scratch, args.reps, args.memory)
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(scratch)
    if mismatches:
        print("FAILED: ckptstore did not reload the state bit for bit (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
