"""One rank of the two-rank DCP save that tests/cli/test_export_hf.py exports.

Run as ``python export_dcp_child.py RANK WORLD DB STORE``: both ranks save ``state()`` sharded
``Shard(0)`` over gloo on CPU through ``ckptstore.integrations.dcp`` as step 1 of run
``RUN`` (rank 0 commits), so every tensor is stored in two pieces, one per rank component.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptstore
from ckptstore.integrations import dcp as ckpt_dcp

RUN = "dcp-export"


def expected() -> dict[str, torch.Tensor]:
    """The model's full tensors (the test recomputes them)."""
    gen = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(96, 32, generator=gen),
        # 5 rows over 2 ranks: an uneven split (3 + 2).
        "layers.0.norm.weight": torch.randn(5, generator=gen).to(torch.bfloat16),
        "layers.0.attn.weight": torch.randn(64, 32, generator=gen),
        "layers.0.count": torch.arange(6, dtype=torch.int64),
    }


def state(mesh: Any) -> dict[str, Any]:
    """What each rank saves: the model's tensors as DTensors, and a plain value."""
    model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in expected().items()}
    return {"model": model, "step": 7}


def main() -> None:
    """Save once from this rank."""
    rank, world, db, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    rendezvous = Path(db).with_name("pg-rendezvous")
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{rendezvous}")
    mesh = init_device_mesh("cpu", (world,))
    run = ckptstore.open_run(RUN, db=db, store=store) if rank == 0 else None
    dist.barrier()
    ckpt_dcp.save(state(mesh), run if run is not None else store, 1)
    if run is not None:
        run.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
