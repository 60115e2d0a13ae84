"""One rank of the read-once DCP load test (tests/integrations/test_dcp_read_once.py).

Run as ``python dcp_read_once_child.py RANK WORLD STORE PLAN OUT SHARE CASE``: every rank
joins a gloo group, loads the checkpoint ``PLAN`` names (its JSON) from ``STORE`` (a local
directory or an ``s3://`` URL, ``AWS_ENDPOINT_URL`` naming the server) through a store that
counts the bytes read of each object, into a replicated state of zeros, and writes
``OUT.<rank>.json``: the per-object bytes it read, the blobs it sent and received, whether its
state equals the saved one, and the error it raised. ``SHARE``: 1, 0, or "default" (the
reader's own choice). ``CASE`` "damaged": the test damaged a blob, so every rank must raise,
naming it; "api": the load through ``ckptstore.integrations.dcp.load``, as a user calls it.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from ckptstore.errors import IntegrityError
from ckptstore.integrations import dcp as ckpt_dcp
from ckptstore.integrations.dcp import CkptStoreReader, LoadPlan
from ckptstore.objectstore import ObjectStore, open_store


def counting(store: ObjectStore) -> Counter[str]:
    """Make ``store`` (a real one) add up the bytes read of each key, whole or ranged."""
    read: Counter[str] = Counter()
    get_view, get = store.get_view, store.get

    def counted_view(key: str) -> memoryview:
        view = get_view(key)
        read[key] += view.nbytes
        return view

    def counted_get(key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        data = get(key, byte_range)
        read[key] += len(data)
        return data

    store.get_view = counted_view  # type: ignore[method-assign]
    store.get = counted_get  # type: ignore[method-assign]
    return read


def saved() -> dict[str, torch.Tensor]:
    """The replicated state the test saved: 2 MiB tensors, each its own blob."""
    gen = torch.Generator().manual_seed(7)
    return {f"layer{i}.weight": torch.randn(512, 1024, generator=gen) for i in range(6)}


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    where, plan_file, out = sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5])
    share, case = {"1": True, "0": False}.get(sys.argv[6]), sys.argv[7]
    rendezvous = out.with_name("rendezvous")
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{rendezvous}")
    plan = LoadPlan.from_json(plan_file.read_text())
    store = open_store(where, create=False)
    read_bytes = counting(store)
    state = {k: torch.zeros_like(v) for k, v in saved().items()}
    reader = CkptStoreReader.for_plan(store, plan)
    if share is not None:
        reader.share = share
    error = ""
    try:
        if case == "api":  # as a user calls it: read-once is on by default
            ckpt_dcp.load(state, plan, store=store)
        else:
            from torch.distributed.checkpoint import load as dcp_load

            dcp_load(state, storage_reader=reader, planner=ckpt_dcp.NoPickleLoadPlanner())
    except BaseException as exc:  # DCP's CheckpointException is one
        causes = [exc, *getattr(exc, "failures", {}).values()]
        error = "; ".join(str(c) for c in causes)
        integrity = any(isinstance(c, IntegrityError) for c in causes) or "corrupt" in error
        error = ("IntegrityError: " if integrity else "") + error
    exact = all(torch.equal(state[k], v) for k, v in saved().items())
    result = {
        "read_bytes": dict(read_bytes),
        "sent": reader.shared_out,
        "received": reader.shared_in,
        "exact": exact,
        "untouched": all(not state[k].any() for k in state),
        "error": error,
    }
    Path(f"{out}.{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
