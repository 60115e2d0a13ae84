"""GPU state: how long an asynchronous save blocks training, against torch DCP's ``async_save``
with its pinned-memory stager, and how close the device-to-host copy comes to the device's peak.

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

Without CUDA it prints one line and exits 0 (``--allow-cpu`` runs the same code on CPU tensors
with small sizes, a smoke test of the script itself, not a measurement).

Run: ``make bench-gpu`` (= ``.venv/bin/python bench/bench_gpu.py``), ``--sizes-gib 4 16``,
``--reps 3``, ``--dir`` (scratch directory, default ``bench/out/gpu``), ``--json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
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


def measure(sizes: list[float], reps: int, scratch: Path, device: torch.device) -> dict[str, Any]:
    """Every contender at every size, plus the copy rates."""
    print(f"round trip: {check_round_trip(scratch, device)}", flush=True)
    rates = copy_rates(device)
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
    return {"device": describe(device), "rates": rates, "rows": rows}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[4.0, 16.0])
    parser.add_argument("--reps", type=int, default=2, help="steady saves after the first")
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
        result = measure(args.sizes_gib, args.reps, scratch, device)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table(result)
    if args.json:
        rows = [asdict(row) | {"steady_median": row.steady_median} for row in result["rows"]]
        print(json.dumps({"device": result["device"], "rates": result["rates"], "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
