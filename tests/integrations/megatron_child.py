"""One rank of the Megatron-Core tests (spawned by test_megatron.py), plus the model they share.

The model is a few linear layers split the way Megatron's tensor parallelism splits them:
column-parallel weights along dim 0, row-parallel weights along dim 1, a replicated bias, a
vocab-parallel bf16 embedding and a stack of layers with a prepended layer axis. Its global
values are a pure function of a seed, so every process can compute what a load must return.

Run as ``python megatron_child.py RANK WORLD PORT CONFIG_JSON``; it writes the outcome of every
scenario to ``<out>/rank<RANK>.json`` (the test asserts on it).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from typing import Any

import torch

LAYERS = 2


def full_state(seed: int) -> dict[str, torch.Tensor]:
    """The global (unsplit) tensors of the model for ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embedding.weight": torch.randn(32, 8, generator=gen).to(torch.bfloat16),
        "mlp.fc1.weight": torch.randn(16, 8, generator=gen),
        "mlp.fc1.bias": torch.randn(16, generator=gen),
        "mlp.fc2.weight": torch.randn(8, 16, generator=gen),
        "mlp.fc2.bias": torch.randn(8, generator=gen),
        "layers.qkv.weight": torch.randn(LAYERS, 12, 8, generator=gen),
        "step_count": torch.tensor([seed], dtype=torch.int64),
    }


#: key -> the dim TP splits (None: replicated on every TP rank).
SPLIT = {
    "embedding.weight": 0,
    "mlp.fc1.weight": 0,
    "mlp.fc1.bias": 0,
    "mlp.fc2.weight": 1,
    "mlp.fc2.bias": None,
    "layers.qkv.weight": 1,
    "step_count": None,
}


def local_part(full: torch.Tensor, dim: int | None, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's slice of a global tensor (a contiguous copy)."""
    if dim is None:
        return full.clone()
    return full.chunk(tp, dim)[tp_rank].clone()


def sharded_state_dict(seed: int | None, tp_rank: int, tp: int, *, objects: bool = True) -> Any:
    """A Megatron sharded state dict of the model (zeros if ``seed`` is None, for loading)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    full = full_state(0 if seed is None else seed)
    out: dict[str, Any] = {"model": {}}
    for key, tensor in full.items():
        dim = SPLIT[key]
        part = local_part(tensor, dim, tp_rank, tp)
        if seed is None:
            part = torch.zeros_like(part)
        if key == "layers.qkv.weight":
            # One ShardedTensor per layer, the layer axis prepended (Megatron's layer stacking).
            out["model"][key] = [
                ShardedTensor.from_rank_offsets(
                    key, part[i].clone(), (0, i, LAYERS), (1, tp_rank, tp), prepend_axis_num=1
                )
                for i in range(LAYERS)
            ]
        elif dim is None:
            out["model"][key] = ShardedTensor.from_rank_offsets(key, part, replica_id=tp_rank)
        else:
            out["model"][key] = ShardedTensor.from_rank_offsets(key, part, (dim, tp_rank, tp))
    if objects:
        data = None if seed is None else {"seed": seed, "tp_rank": tp_rank, "ids": [1, 2, 3]}
        out["rng_state"] = ShardedObject("rng_state", data, (tp,), (tp_rank,))
    return out


def expected_local(seed: int, tp_rank: int, tp: int) -> dict[str, Any]:
    """What loading ``seed``'s checkpoint at (tp_rank, tp) must give for ``model``."""
    out: dict[str, Any] = {}
    for key, tensor in full_state(seed).items():
        part = local_part(tensor, SPLIT[key], tp_rank, tp)
        out[key] = [part[i] for i in range(LAYERS)] if key == "layers.qkv.weight" else part
    return out


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of nested tensors (dtype and shape included)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def quiet_imports() -> None:
    """Import Megatron without its import-time warnings (no Apex / TransformerEngine here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.dist_checkpointing  # noqa: F401


def cpu_stand_ins() -> None:
    """Megatron's async caller asks CUDA to synchronize and for a device; this is a CPU job."""
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"


def run_rank(rank: int, world: int, port: int, config: dict[str, Any]) -> dict[str, Any]:
    """Every scenario of one rank (TP = world); returns what the test checks."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import ckptstore
    from ckptstore.integrations import megatron as mcore

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A file rendezvous, not rank 0's TCP store: with the store in rank 0, a rank still in
    # destroy_process_group when rank 0 has exited aborts ("terminate called ...").
    rendezvous = os.path.join(config["out"], "pg-rendezvous")
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{rendezvous}")
    store = ckptstore.open_store(config["store"], **config.get("store_options", {}))
    # Only rank 0 commits, so only rank 0 opens the run for writing (fencing allows one).
    run = ckptstore.open_run(config["run"], db=config["db"], store=store, writable=rank == 0)
    target: Any = run if rank == 0 else store
    report: dict[str, Any] = {"rank": rank}
    tp_rank, tp = rank, world

    # Resharding TP=1 -> TP=world: the test process saved step 10 at TP=1.
    loaded = mcore.load(sharded_state_dict(None, tp_rank, tp, objects=False), run, 10)
    report["load_tp1_step10"] = same(loaded["model"], expected_local(1, tp_rank, tp))

    mcore.save(sharded_state_dict(1, tp_rank, tp), target, 1, training_info={"iteration": 1})
    mcore.save(sharded_state_dict(1, tp_rank, tp), target, 2)  # unchanged: dedup

    cpu_stand_ins()
    queue = AsyncCallsQueue()
    state = sharded_state_dict(2, tp_rank, tp)
    request = mcore.save(state, target, 3, async_save=True)
    queue.schedule_async_request(request)
    state["model"]["mlp.fc1.weight"].data.add_(1.0)  # training goes on: the snapshot holds
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()

    bad = sharded_state_dict(1, tp_rank, tp)
    if rank == world - 1:
        bad["rng_state"].data = {"handle": object()}  # not plain: this rank's upload fails
    try:
        mcore.save(bad, target, 4)
        report["failed_save"] = None
    except ckptstore.SaveError as exc:
        report["failed_save"] = str(exc)

    for step, seed in ((1, 1), (3, 2)):
        loaded = mcore.load(sharded_state_dict(None, tp_rank, tp), run, step)
        report[f"load_step{step}"] = same(loaded["model"], expected_local(seed, tp_rank, tp))
        report[f"objects_step{step}"] = loaded["rng_state"] == {
            "seed": seed,
            "tp_rank": tp_rank,
            "ids": [1, 2, 3],
        }
    if rank == 0:
        report["steps"] = [c.step for c in run.checkpoints()]
        report["uploaded"] = {c.step: c.uploaded_bytes for c in run.checkpoints()}
        report["stored"] = {c.step: c.stored_bytes for c in run.checkpoints()}
    run.close()
    dist.barrier()
    dist.destroy_process_group()
    return report


def main() -> None:
    """Run one rank and leave its report (or its traceback) in the output directory."""
    rank, world, port = (int(a) for a in sys.argv[1:4])
    config = json.loads(sys.argv[4])
    quiet_imports()
    try:
        report = run_rank(rank, world, port, config)
    except BaseException:
        report = {"rank": rank, "traceback": traceback.format_exc()}
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w", encoding="utf-8") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main()
