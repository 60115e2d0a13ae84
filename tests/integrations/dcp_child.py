"""One rank of the multi-process DCP tests (tests/integrations/test_dcp_multirank.py).

Run as ``python dcp_child.py RANK WORLD DB STORE OUT``: every rank runs the same scenarios
in order over gloo on CPU; rank 0 writes what it observed to ``OUT`` (JSON) for the test to
check. Any failed expectation exits non-zero with the traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptstore
from ckptstore.errors import SaveError
from ckptstore.integrations import dcp as ckpt_dcp

RUN = "dcp-multirank"


def expected() -> dict[str, torch.Tensor]:
    """The full tensors every scenario saves (the test recomputes them)."""
    gen = torch.Generator().manual_seed(1234)
    return {
        "w": torch.randn(64, 48, generator=gen),
        # 5 rows over 2 ranks: an uneven split (3 + 2).
        "b": torch.arange(30, dtype=torch.bfloat16).reshape(5, 6),
        "plain": torch.linspace(0, 1, 7),
    }


def state(mesh: Any, placement: Any, fill: float | None = None) -> dict[str, Any]:
    full = expected()
    if fill is not None:
        full = {k: torch.full_like(v, fill) for k, v in full.items()}
    return {
        "w": distribute_tensor(full["w"], mesh, [placement]),
        "b": distribute_tensor(full["b"], mesh, [placement]),
        "plain": full["plain"],
        "meta": {"epoch": 3, "betas": (0.9, 0.95), "name": "ok"}
        if fill is None
        else {"epoch": 0, "betas": None, "name": ""},
    }


def check_equal(loaded: dict[str, Any]) -> None:
    full = expected()
    for key in ("w", "b"):
        value = loaded[key]
        got = value.full_tensor() if isinstance(value, DTensor) else value
        assert torch.equal(got, full[key]), f"{key} differs after load"
    assert torch.equal(loaded["plain"], full["plain"])
    assert loaded["meta"] == {"epoch": 3, "betas": (0.9, 0.95), "name": "ok"}, loaded["meta"]


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    db, store, out = sys.argv[3], sys.argv[4], sys.argv[5]
    # A file rendezvous, not rank 0's TCP store: with the store in rank 0, a rank still in
    # destroy_process_group when rank 0 has exited aborts ("terminate called ...").
    rendezvous = Path(out).with_name("pg-rendezvous")
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{rendezvous}")
    mesh = init_device_mesh("cpu", (world,))
    observed: dict[str, Any] = {}
    # Only rank 0 holds the writable run (it commits); the others write with nothing but the
    # store URL, and read through a read-only run.
    writer = ckptstore.open_run(RUN, db=db, store=store) if rank == 0 else None
    dist.barrier()
    reader = ckptstore.open_run(RUN, db=db, store=store, writable=False)
    target: Any = writer if writer is not None else store

    # 1. Save Shard(0); load as Shard(1), as replicated, and partially.
    info = ckpt_dcp.save(state(mesh, Shard(0)), target, 1)
    if rank == 0:
        assert info is not None
        observed["components"] = sorted(c.name for c in info.components)
        observed["step1_uploaded"] = info.uploaded_bytes
        observed["step1_logical"] = info.logical_bytes
    else:
        assert info is None
    as_shard1 = state(mesh, Shard(1), fill=0.0)
    assert ckpt_dcp.load(as_shard1, reader, 1).step == 1
    check_equal(as_shard1)
    assert as_shard1["w"].to_local().shape == (64, 48 // world)
    replicated = state(mesh, Replicate(), fill=0.0)
    ckpt_dcp.load(replicated, reader)
    check_equal(replicated)
    partial = {"w": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(1)])}
    ckpt_dcp.load(partial, reader, 1, planner=ckpt_dcp.NoPickleLoadPlanner(allow_partial_load=True))
    assert torch.equal(partial["w"].full_tensor(), expected()["w"])

    # 2. An unchanged re-save uploads (almost) nothing.
    info = ckpt_dcp.save(state(mesh, Shard(0)), target, 2)
    if rank == 0:
        assert info is not None
        observed["resave_uploaded"] = info.uploaded_bytes

    # 3. A rank failing mid-write: every rank gets SaveError, nothing is committed.
    class FailOnRank1(ckpt_dcp.NoPickleSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            if rank == 1 and write_item.index.fqn == "w":
                raise OSError("simulated disk failure on rank 1")
            return super().resolve_data(write_item)

    try:
        ckpt_dcp.save(state(mesh, Shard(0)), target, 3, planner=FailOnRank1())
    except SaveError as exc:
        observed["failure"] = str(exc)
    else:
        raise AssertionError("a failed rank must fail the save on every rank")

    # 4. async_save: returns after staging; the future holds the committed checkpoint.
    future = ckpt_dcp.save(state(mesh, Shard(0)), target, 4, async_save=True)
    assert not isinstance(future, ckptstore.CheckpointInfo)
    committed = future.result(timeout=60)  # type: ignore[union-attr]
    if rank == 0:
        assert committed is not None
        observed["async_step"] = committed.step
    dist.barrier()
    as_shard1 = state(mesh, Shard(1), fill=0.0)
    assert ckpt_dcp.load(as_shard1, reader).step == 4
    check_equal(as_shard1)

    # 5. FSDP2 model + AdamW round trip.
    def fsdp_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(seed + 100 + rank)
        model(torch.randn(4, 32)).sum().backward()
        optim.step()
        optim.zero_grad()
        return model, optim

    model, optim = fsdp_model(1)
    msd, osd = get_state_dict(model, optim)
    ckpt_dcp.save({"model": msd, "optim": osd}, target, 5)
    model2, optim2 = fsdp_model(2)
    msd2, osd2 = get_state_dict(model2, optim2)
    ckpt_dcp.load({"model": msd2, "optim": osd2}, reader, 5)
    set_state_dict(model2, optim2, model_state_dict=msd2, optim_state_dict=osd2)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), f"FSDP2 parameter {name} differs"
    s1, s2 = get_state_dict(model, optim)[1], get_state_dict(model2, optim2)[1]
    for key, moments in s1["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            a, b = moments[name], s2["state"][key][name]
            a = a.full_tensor() if isinstance(a, DTensor) else a
            b = b.full_tensor() if isinstance(b, DTensor) else b
            assert torch.equal(a, b), f"optimizer {key}.{name} differs"
    assert s1["param_groups"] == s2["param_groups"]

    dist.barrier()
    if rank == 0:
        observed["steps"] = [c.step for c in reader.checkpoints(["committed"])]
        with open(out, "w") as f:
            json.dump(observed, f)
    reader.close()
    if writer is not None:
        writer.close()
    dist.barrier()  # tear the group down together (see the note at the bottom)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every scenario passed and the process group is destroyed. Leave without the interpreter's
    # teardown: torch's native threads (gloo) sometimes abort in their static destructors
    # ("terminate called without an active exception", exit -6) after all work is done, which
    # would fail the test for something that is neither ckptstore's nor the test's doing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
