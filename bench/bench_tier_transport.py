"""How a local save reaches a peer's tier: ``PathTransport`` (the peer's tier is a directory
this process writes) against ``RayTransport`` (the peer's tier agent writes what Ray's object
store hands it), for a 1 GiB local save with R = 2: two nodes simulated on one machine and one
Ray node, the writer on node a replicating to node b; the figure is ``ShardWriter.write`` (call
to fsynced copies on both tiers). Medians of 3, the two alternating.

Run: ``.venv/bin/python bench/bench_tier_transport.py [--gib 1] [--dir /tmp/...]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ckptstore import ShardWriter, TierConfig, writer_store
from ckptstore.tiers.ray import RayTransport

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def one_save(root: Path, state: dict[str, torch.Tensor], transport: RayTransport | None) -> float:
    """Seconds of one R = 2 local save from node a (to a and b) over ``transport``."""
    import ray

    shutil.rmtree(root, ignore_errors=True)
    for node in ("a", "b"):
        (root / f"tier-{node}").mkdir(parents=True)
    template = str(root / "tier-{node}")
    if transport is not None:
        here = ray.get_runtime_context().get_node_id()
        transport.start({"a": here, "b": here})
    cfg = TierConfig(
        local_dir=template, node="a", nodes=("a", "b"), replicas=2, transport=transport
    )
    with writer_store(cfg) as store, ShardWriter(store) as writer:
        began = time.perf_counter()
        writer.write("rank0", state)
        return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    import ray

    scratch = Path(tempfile.mkdtemp(prefix="tier-transport-", dir=args.dir))
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=str(scratch / "ray"),
        log_to_driver=False,
    )
    tensors = max(1, round(args.gib * 16))
    state = {f"p{i}": torch.randn(16 << 20) for i in range(tensors)}  # 64 MiB each
    times: dict[str, list[float]] = {"path": [], "ray": []}
    try:
        for rep in range(3):
            for label in ("path", "ray") if rep % 2 == 0 else ("ray", "path"):
                transport = (
                    None if label == "path" else RayTransport(str(scratch / "t" / "tier-{node}"))
                )
                times[label].append(one_save(scratch / "t", state, transport))
    finally:
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    gib = tensors / 16
    for label, seconds in times.items():
        median = statistics.median(seconds)
        runs = ", ".join(f"{s:.2f}" for s in seconds)
        print(
            f"{label:5s} median {median:.2f} s ({runs}): {gib / median:.2f} GiB/s of state, R = 2"
        )


if __name__ == "__main__":
    main()
