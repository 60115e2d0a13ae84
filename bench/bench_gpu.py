"""GPU state: how long an asynchronous save blocks training, against torch DCP's ``async_save``
with its pinned-memory stager, and how close the device-to-host copy comes to the device's peak;
then how long a load into device tensors takes, against ``dcp.load`` and the load's floors.

On one CUDA device, for each size in ``--sizes-gib`` (default 4 and 16), a state of bf16 weights
(a fifth of the bytes) and two fp32 Adam moments (four fifths) is built on the GPU. Then, the
contenders alternating and each save waited for (untimed) before the next:

- ``ckptstore Run.save`` of a run opened with ``async_save=True`` on a local directory store:
  the call returns once the state is in host buffers (pinned, since the source is on the GPU);
  blocked time is the call. The first save allocates the pinned buffers and is reported apart
  ("first"); later ones reuse them ("steady").
- ``dcp.async_save`` with ``DefaultStager(StagingOptions(use_pinned_memory=True,
  use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True))`` and DCP's
  ``FileSystemWriter``: blocked time is the call plus the wait for its staging future (the
  weights may not change before staging is done, so a training step that follows waits that
  long).

Also measured: the device's pinned-copy peak (``copy_(non_blocking=True)`` of a 1 GiB buffer
into a pinned host buffer, best of 5) and its pageable-copy rate; each contender's effective
device-to-host rate is the state's bytes over its steady blocked time, reported as a share of
the pinned peak.

Between repetitions every tensor is bumped in place (``add_(0)``: a new version, the same bytes),
so ckptstore's steady saves deduplicate against the first and the disk holds one copy of the
state per contender; DCP's directories are removed after each save. Disk needed: about 2x the
largest size.

**Loads** (issue 43), for each size: a state of the same kind on the GPU is saved once by
ckptstore (``Run.save`` to a local directory store) and once by ``dcp.save`` (DCP's
``FileSystemWriter``), untimed; each contender's load is checked bit-exact against the saved
state before anything is timed. Then, the contenders alternating (the order rotates every
repetition), each into the same device tensors:

- ``ckptstore Run.load(into=) atomic`` (the default: no tensor written before every blob has
  verified; the device copies go to device scratch while the blobs are read, where the device
  has room, then device-to-device into the tensors) and ``Run.load(into=, atomic=False)`` (each
  blob's bytes copied into the tensors as it verifies): every blob read into reused pinned
  buffers and BLAKE3-verified on the load's threads, the host-to-device copy on side streams,
  overlapped with the reads;
- ``dcp.load`` with DCP's ``FileSystemReader`` (``no_dist=True``);

each **hot** (the contender's own files read just before: in the page cache) and **evicted**
(every file of both stores dropped from the page cache with ``posix_fadvise(DONTNEED)``, as
bench_load.py does, before the timed call). Every timed load ends with the device synchronized.
Measured in the same run, the floors: the **H2D pinned peak** (``copy_(non_blocking=True)`` of a
1 GiB pinned buffer to the device, best of 5; the H2D floor is the state's bytes at that rate)
and the **read+hash floor** (every blob file of ckptstore's store read and BLAKE3-hashed, a file
per thread on every CPU, as bench_load.py does; hot and evicted). Goals printed beside each
ckptstore row: <= 1.0x ``dcp.load`` at the same temperature, and <= 1.2x max(read+hash floor,
H2D floor). Last, the **GPU load time against size** curve: each size's medians in one table.
Disk for the loads: about 2x the largest size more.

Without CUDA it prints one line and exits 0 (``--allow-cpu`` runs the same code on CPU tensors
with small sizes, a smoke test of the script itself, not a measurement).

Run: ``make bench-gpu`` (= ``.venv/bin/python bench/bench_gpu.py``), ``--sizes-gib 4 16``,
``--reps 3``, ``--load-reps 2`` (timed loads per contender and temperature), ``--dir`` (scratch
directory, default ``bench/out/gpu``), ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))

from ckptstore import open_run  # noqa: E402

GiB = 1 << 30
PEAK_COPY_BYTES = 1 << 30
LAYER_ELEMENTS = 64 << 20  # 64 Mi elements per tensor: 128 MiB bf16, 256 MiB fp32


@dataclass
class Row:
    """One contender at one size: blocked seconds of each save, and what they imply."""

    contender: str
    size_gib: float
    first_s: float
    steady_s: list[float] = field(default_factory=list)
    complete_s: list[float] = field(default_factory=list)

    def add(self, rep: int, blocked: float, complete: float) -> None:
        """Repetition ``rep``'s blocked and complete seconds (the first save stands apart)."""
        if rep == 0:
            self.first_s = blocked
        else:
            self.steady_s.append(blocked)
            self.complete_s.append(complete)

    @property
    def steady_median(self) -> float:
        return statistics.median(self.steady_s) if self.steady_s else float("nan")


def build_state(size_gib: float, device: torch.device) -> dict[str, torch.Tensor]:
    """bf16 weights and fp32 first and second moments (2 + 4 + 4 bytes an element), in tensors
    of at most ``LAYER_ELEMENTS`` elements, random so nothing compresses to nothing."""
    weight_elements = int(size_gib * GiB / 10)
    state: dict[str, torch.Tensor] = {}
    layer = 0
    remaining = weight_elements
    while remaining > 0:
        n = min(LAYER_ELEMENTS, remaining)
        weight = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
        state[f"model.layers.{layer}.weight"] = weight
        state[f"optim.layers.{layer}.exp_avg"] = torch.randn(n, device=device) * 1e-3
        state[f"optim.layers.{layer}.exp_avg_sq"] = torch.rand(n, device=device) * 1e-6
        remaining -= n
        layer += 1
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of every tensor in ``state``."""
    return sum(t.numel() * t.element_size() for t in state.values())


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bump(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """A new version of every tensor with the same bytes (a training step's write, without
    changing what deduplicates)."""
    with torch.no_grad():
        for tensor in state.values():
            tensor.add_(0)
    synchronize(device)


def copy_rates(device: torch.device) -> dict[str, float]:
    """Device-to-host GB/s into a pinned buffer (best of 5) and into pageable memory."""
    if device.type != "cuda":
        return {"pinned_gbps": float("nan"), "pageable_gbps": float("nan")}
    source = torch.empty(PEAK_COPY_BYTES, dtype=torch.uint8, device=device)
    rates = {}
    for label, pinned in (("pinned_gbps", True), ("pageable_gbps", False)):
        target = torch.empty(PEAK_COPY_BYTES, dtype=torch.uint8, pin_memory=pinned)
        best = float("inf")
        for _ in range(5):
            synchronize(device)
            start = time.perf_counter()
            target.copy_(source, non_blocking=pinned)
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        rates[label] = PEAK_COPY_BYTES / best / 1e9
        del target
    return rates


def time_ckptstore(
    state: dict[str, torch.Tensor], scratch: Path, reps: int, device: torch.device
) -> Row:
    """Blocked time of ``Run.save`` with ``async_save=True``: first save, then ``reps`` steady."""
    root = scratch / "ckptstore"
    run = open_run("gpu-bench", db=root / "manifest.db", store=root / "store", async_save=True)
    row = Row("ckptstore Run.save (async_save=True)", state_bytes(state) / GiB, first_s=0.0)
    try:
        for rep in range(reps + 1):
            bump(state, device)
            start = time.perf_counter()
            handle = run.save(rep, {"state": state})
            blocked = time.perf_counter() - start
            handle.wait()
            row.add(rep, blocked, time.perf_counter() - start)
    finally:
        run.close()
        shutil.rmtree(root, ignore_errors=True)
    return row


def time_dcp(state: dict[str, torch.Tensor], scratch: Path, reps: int, device: torch.device) -> Row:
    """Blocked time of ``dcp.async_save`` with the pinned-memory ``DefaultStager``: the call
    plus its staging future, first save then ``reps`` steady (the stager keeps its buffers)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    on_gpu = device.type == "cuda"  # (on the CPU, --allow-cpu: DCP refuses non-blocking copies)
    options = StagingOptions(
        use_pinned_memory=on_gpu,
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=on_gpu,
    )
    stager = DefaultStager(options)
    row = Row("dcp.async_save (DefaultStager, pinned)", state_bytes(state) / GiB, first_s=0.0)
    try:
        for rep in range(reps + 1):
            if rep and spent(stager):
                # Older torch (2.11) closes a DefaultStager's copier after every staging, so a
                # second save through it fails: such a torch stages each save with a new one
                # (and new pinned buffers), as its users must.
                stager.close()
                stager = DefaultStager(options)
                row.contender = "dcp.async_save (DefaultStager per save, pinned)"
            bump(state, device)
            target = scratch / f"dcp-{rep}"
            start = time.perf_counter()
            response = dcp.async_save(
                state, checkpoint_id=str(target), async_stager=stager, no_dist=True
            )
            staging = getattr(response, "staging_completion", None)
            if staging is not None:
                staging.result()
            blocked = time.perf_counter() - start
            upload = getattr(response, "upload_completion", response)
            upload.result()
            row.add(rep, blocked, time.perf_counter() - start)
            shutil.rmtree(target, ignore_errors=True)
    finally:
        stager.close()
    return row


def spent(stager: Any) -> bool:
    """Whether this torch's ``DefaultStager`` closed its state-dict copier after staging (its
    copy dispatch table is empty then, and another save through it fails)."""
    copier = getattr(stager, "_state_dict_stager", None)
    table = getattr(copier, "_deepcopy_dispatch", None)
    return table is not None and not table


CONTENDERS: tuple[Callable[[dict[str, torch.Tensor], Path, int, torch.device], Row], ...] = (
    time_ckptstore,
    time_dcp,
)


# -- loads into device tensors ----------------------------------------------------------------

LOAD_ATOMIC = "ckptstore Run.load(into=) atomic"
LOAD_STREAM = "ckptstore Run.load(into=, atomic=False)"
LOAD_DCP = "dcp.load (FileSystemReader)"
TEMPERATURES = ("hot", "evicted")
#: The load contenders' names in the time-against-size curve.
SHORT = {
    LOAD_ATOMIC: "ckptstore atomic",
    LOAD_STREAM: "ckptstore atomic=False",
    LOAD_DCP: "dcp.load",
}


@dataclass
class LoadRow:
    """One load contender at one size and page-cache temperature: seconds of each timed load."""

    contender: str
    size_gib: float
    temperature: str
    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")


def files_of(root: Path) -> Iterator[Path]:
    """Every file under ``root``."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            yield Path(dirpath) / name


def evict(root: Path) -> None:
    """Drop every file under ``root`` from the page cache (fsynced first, so the pages are clean
    and really go), as bench_load.py does."""
    for path in files_of(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(root: Path, *, hashed: bool) -> None:
    """Read every file under ``root``, a file per thread on every CPU; ``hashed``: BLAKE3 every
    byte too (bench_load.py's read+hash floor of an evicted verified load)."""
    from blake3 import blake3

    def one(path: Path) -> None:
        hasher = blake3(max_threads=1)
        with open(path, "rb", buffering=0) as f:
            while piece := f.read(1 << 20):
                if hashed:
                    hasher.update(piece)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(one, files_of(root)))


def h2d_peak(device: torch.device) -> float:
    """Host-to-device GB/s from a pinned 1 GiB buffer (``non_blocking=True``), best of 5."""
    if device.type != "cuda":
        return float("nan")
    source = torch.empty(PEAK_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(PEAK_COPY_BYTES, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source, non_blocking=True)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    del source, target
    return PEAK_COPY_BYTES / best / 1e9


class LoadBench:
    """One size: a device state saved by both contenders, the device tensors they load into,
    and each contender's load (checked bit-exact against the saved state on construction)."""

    def __init__(self, size_gib: float, scratch: Path, device: torch.device) -> None:
        import torch.distributed.checkpoint as dcp

        self.device = device
        self.root = scratch / "loads"
        self.ours, self.theirs = self.root / "ckptstore", self.root / "dcp"
        state = build_state(size_gib, device)
        self.nbytes = state_bytes(state)
        self.run = open_run(
            "gpu-load", db=self.ours / "manifest.db", store=self.ours / "store", async_save=False
        )
        self.run.save(0, {"state": state})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming a single process"
            dcp.save(state, checkpoint_id=str(self.theirs), no_dist=True)
        self.into = {name: torch.empty_like(tensor) for name, tensor in state.items()}
        self.loads: dict[str, tuple[Callable[[], None], Path]] = {
            LOAD_ATOMIC: (lambda: self._ours(atomic=True), self.ours),
            LOAD_STREAM: (lambda: self._ours(atomic=False), self.ours),
            LOAD_DCP: (self._dcp, self.theirs),
        }
        for contender, (load, _) in self.loads.items():
            with torch.no_grad():
                for tensor in self.into.values():
                    tensor.fill_(float("nan"))
            load()
            synchronize(device)
            for name, tensor in state.items():
                if not torch.equal(self.into[name].view(torch.uint8), tensor.view(torch.uint8)):
                    raise AssertionError(f"{contender}: {name} differs from the saved bytes")
        del state

    def _ours(self, *, atomic: bool) -> None:
        self.run.load(0, into={"state": self.into}, atomic=atomic)

    def _dcp(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(self.into, storage_reader=FileSystemReader(str(self.theirs)), no_dist=True)

    def timed(self, contender: str, temperature: str) -> float:
        """One load of ``contender``, its files hot or every file of both stores evicted."""
        load, files = self.loads[contender]
        if temperature == "hot":
            read_files(files, hashed=False)
        else:
            evict(self.ours)
            evict(self.theirs)
        synchronize(self.device)
        start = time.perf_counter()
        load()
        synchronize(self.device)
        return time.perf_counter() - start

    def floor(self, temperature: str) -> float:
        """Seconds to read and BLAKE3-hash every blob file of ckptstore's store."""
        store = self.ours / "store"
        if temperature == "hot":
            read_files(store, hashed=False)
        else:
            evict(store)
        start = time.perf_counter()
        read_files(store, hashed=True)
        return time.perf_counter() - start

    def close(self) -> None:
        """Close the run, drop the device tensors and remove both stores."""
        self.run.close()
        self.into.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def measure_loads(
    size_gib: float, reps: int, scratch: Path, device: torch.device
) -> tuple[list[LoadRow], dict[str, float]]:
    """Every load contender at ``size_gib``, hot and evicted, alternating; and the read+hash
    floor (median seconds, hot and evicted) measured in between."""
    bench = LoadBench(size_gib, scratch, device)
    size = bench.nbytes / GiB
    try:
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0] / GiB
            print(f"loads at {size:.2f} GiB: {free:.1f} GiB free on the device", flush=True)
        rows = {(c, t): LoadRow(c, size, t) for t in TEMPERATURES for c in [*bench.loads, "floor"]}
        contenders = list(bench.loads)
        for rep in range(reps):
            order = contenders[rep % len(contenders) :] + contenders[: rep % len(contenders)]
            for temperature in TEMPERATURES:
                for contender in order:
                    rows[(contender, temperature)].seconds.append(
                        bench.timed(contender, temperature)
                    )
                rows[("floor", temperature)].seconds.append(bench.floor(temperature))
    finally:
        bench.close()
    floors = {t: rows.pop(("floor", t)).median for t in TEMPERATURES}
    for row in rows.values():
        print(
            f"measured {row.contender} at {row.size_gib:.2f} GiB {row.temperature}: "
            f"{[round(s, 3) for s in row.seconds]} s",
            flush=True,
        )
    return list(rows.values()), floors


def check_round_trip(scratch: Path, device: torch.device) -> str:
    """What the timings rest on: an async save of device tensors holds the bytes they had when
    the call returned, though the caller overwrites them at once (a training step), and a load
    into device tensors (``into=``) gives those bytes back bit for bit."""
    root = scratch / "round-trip"
    state = build_state(0.25, device)
    expected = {name: tensor.clone() for name, tensor in state.items()}
    run = open_run("gpu-check", db=root / "manifest.db", store=root / "store", async_save=True)
    try:
        handle = run.save(0, {"state": state})
        with torch.no_grad():
            for tensor in state.values():
                tensor.fill_(float("nan"))
        handle.wait()
        into = {name: torch.empty_like(tensor) for name, tensor in expected.items()}
        run.load(0, into={"state": into})
        synchronize(device)
        for name, tensor in expected.items():
            if not torch.equal(into[name].view(torch.uint8), tensor.view(torch.uint8)):
                raise AssertionError(f"{name}: the loaded bytes differ from the saved ones")
    finally:
        run.close()
        shutil.rmtree(root, ignore_errors=True)
    return f"{len(expected)} {device.type} tensors, overwritten after save returned: bit-exact"


def measure(
    sizes: list[float], reps: int, load_reps: int, scratch: Path, device: torch.device
) -> dict[str, Any]:
    """Every contender at every size, plus the copy rates; then the loads and their floors."""
    print(f"round trip: {check_round_trip(scratch, device)}", flush=True)
    rates = copy_rates(device)
    rates["h2d_pinned_gbps"] = h2d_peak(device)
    rows: list[Row] = []
    for size in sizes:
        state = build_state(size, device)
        synchronize(device)
        for contender in CONTENDERS:
            row = contender(state, scratch, reps, device)
            rows.append(row)
            # Each row as soon as it is measured: a run cut short still reports what it finished.
            print(
                f"measured {row.contender} at {row.size_gib:.2f} GiB: first {row.first_s:.3f} s, "
                f"steady {[round(s, 3) for s in row.steady_s]} s",
                flush=True,
            )
        del state
        if device.type == "cuda":
            torch.cuda.empty_cache()
    loads: list[LoadRow] = []
    floors: dict[float, dict[str, float]] = {}
    for size in sizes:
        found, floor = measure_loads(size, load_reps, scratch, device)
        loads += found
        floors[round(found[0].size_gib, 2)] = floor
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "device": describe(device),
        "rates": rates,
        "rows": rows,
        "loads": loads,
        "load_floors": floors,
    }


def describe(device: torch.device) -> str:
    """The device's name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def print_table(result: dict[str, Any]) -> None:
    """One line per contender and size, and ckptstore's steady blocked time over DCP's."""
    rates = result["rates"]
    print(f"device: {result['device']}")
    print(
        f"device-to-host peak: pinned {rates['pinned_gbps']:.1f} GB/s, "
        f"pageable {rates['pageable_gbps']:.1f} GB/s"
    )
    columns = ("GiB", 6), ("first s", 8), ("steady s", 9), ("done s", 8), ("GB/s", 7), ("% peak", 7)
    print(f"{'contender':48} " + " ".join(f"{name:>{width}}" for name, width in columns))
    by_size: dict[float, dict[str, float]] = {}
    for row in result["rows"]:
        gbps = row.size_gib * GiB / row.steady_median / 1e9
        share = 100 * gbps / rates["pinned_gbps"]
        done = statistics.median(row.complete_s) if row.complete_s else float("nan")
        print(
            f"{row.contender:48} {row.size_gib:6.2f} {row.first_s:8.3f} "
            f"{row.steady_median:9.3f} {done:8.2f} {gbps:7.1f} {share:7.1f}"
        )
        by_size.setdefault(round(row.size_gib, 2), {})[row.contender.split()[0]] = row.steady_median
    for size, medians in by_size.items():
        if "ckptstore" in medians and "dcp.async_save" in medians:
            ratio = medians["ckptstore"] / medians["dcp.async_save"]
            print(f"{size:.2f} GiB: ckptstore blocked / dcp.async_save blocked = {ratio:.2f}x")


def print_loads(result: dict[str, Any]) -> None:
    """The load rows beside ``dcp.load`` and the floors, then the time-against-size curve."""
    h2d = result["rates"]["h2d_pinned_gbps"]
    print(f"host-to-device peak (pinned, 1 GiB, best of 5): {h2d:.1f} GB/s")
    medians = {(r.contender, r.size_gib, r.temperature): r.median for r in result["loads"]}
    print(
        f"{'load':42} {'GiB':>6} {'cache':>8} {'median s':>9} {'GB/s':>6} "
        f"{'x dcp':>6} {'x floor':>8}  goals: <= 1.0x dcp.load, <= 1.2x max(read+hash, H2D)"
    )
    for row in result["loads"]:
        nbytes = row.size_gib * GiB
        floors = result["load_floors"][round(row.size_gib, 2)]
        h2d_s = 0.0 if math.isnan(h2d) else nbytes / (h2d * 1e9)
        floor = max(floors[row.temperature], h2d_s)
        versus = row.median / medians[(LOAD_DCP, row.size_gib, row.temperature)]
        against = "" if row.contender == LOAD_DCP else f"{versus:6.2f} {row.median / floor:8.2f}"
        print(
            f"{row.contender:42} {row.size_gib:6.2f} {row.temperature:>8} {row.median:9.3f} "
            f"{nbytes / row.median / 1e9:6.1f} {against}"
        )
    for size, floors in result["load_floors"].items():
        h2d_s = size * GiB / (h2d * 1e9)
        print(
            f"{size:.2f} GiB floors: read+hash {floors['hot']:.3f} s hot, "
            f"{floors['evicted']:.3f} s evicted; H2D {h2d_s:.3f} s"
        )
    print("GPU load time against size (median s; hot / evicted):")
    contenders = list(dict.fromkeys(r.contender for r in result["loads"]))
    print(f"{'GiB':>6} " + " ".join(f"{SHORT[c]:>24}" for c in contenders))
    for size in sorted({r.size_gib for r in result["loads"]}):
        cells = [
            f"{medians[(c, size, 'hot')]:.3f} / {medians[(c, size, 'evicted')]:.3f}"
            for c in contenders
        ]
        print(f"{size:6.2f} " + " ".join(f"{cell:>24}" for cell in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[4.0, 16.0])
    parser.add_argument("--reps", type=int, default=2, help="steady saves after the first")
    parser.add_argument(
        "--load-reps", type=int, default=2, help="timed loads per contender and cache state"
    )
    parser.add_argument("--dir", type=Path, default=BENCH_DIR / "out" / "gpu")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run on CPU tensors (a smoke test of the script)"
    )
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
    elif args.allow_cpu:
        device = torch.device("cpu")
    else:
        print("bench_gpu: no CUDA device here; nothing measured (the script is ready for one)")
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-", dir=args.dir))
    try:
        result = measure(args.sizes_gib, args.reps, args.load_reps, scratch, device)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table(result)
    print_loads(result)
    if args.json:
        rows = [asdict(row) | {"steady_median": row.steady_median} for row in result["rows"]]
        loads = [asdict(row) | {"median": row.median} for row in result["loads"]]
        floors = {str(size): floor for size, floor in result["load_floors"].items()}
        print(
            json.dumps(
                {
                    "device": result["device"],
                    "rates": result["rates"],
                    "rows": rows,
                    "loads": loads,
                    "load_floors": floors,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
