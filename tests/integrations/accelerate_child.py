"""One Accelerate training job for tests/integrations/test_accelerate*.py (one process of it).

``accelerate_child.py DB STORE OUT STEPS [--save-at K] [--resume]``: trains a small model with
dropout, AdamW, a LambdaLR schedule and a shuffled, stateful DataLoader (plus Python and NumPy
randomness in the loss and a registered custom object) for STEPS optimizer steps. ``--save-at
K`` checkpoints at step K through ckptstore; ``--resume`` first loads the newest committed
checkpoint (and scrambles every generator before, so only the load can make it exact). Each
process writes ``OUT/rank<r>.safetensors`` (its final parameters and optimizer state) and
``OUT/rank<r>.json`` (the steps it ran and the sample ids of each batch). Run it as one process,
or as several with torch's RANK/WORLD_SIZE/MASTER_* variables set (gloo on CPU).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import ckptstore
from ckptstore.integrations.accelerate import load_state, save_state


class Counter:
    """A registered custom object: how many batches it saw, and a running sum."""

    def __init__(self) -> None:
        self.count = 0
        self.total = torch.zeros(4)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "total": self.total.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]
        self.total = state["total"].clone()


def build(seed: int) -> tuple[Any, ...]:
    set_seed(seed)
    config = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)
    accelerator = Accelerator(dataloader_config=config)
    data = torch.randn(48, 8, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(48, dtype=torch.float32).unsqueeze(1)
    dataset = TensorDataset(torch.cat([ids, data], dim=1), data[:, :4].sum(1, keepdim=True))
    loader = DataLoader(dataset, batch_size=4, shuffle=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, loader, scheduler, counter


def train(args: argparse.Namespace, out: Path, *, save_at: int, resume: bool) -> None:
    """One job: build, maybe resume, train to ``args.steps``, report into ``out``."""
    accelerator, model, optimizer, loader, scheduler, counter = build(seed=0)
    target: Any = args.store
    if accelerator.is_main_process:
        target = ckptstore.open_run("acc", db=args.db, store=args.store)
    step = 0
    if resume:
        # Nothing that follows may depend on the generators of this process's start.
        set_seed(1234 + accelerator.process_index)
        info = load_state(accelerator, target)
        assert info is not None, "nothing to resume from"
        step = info.step
    first = step
    batches = []
    while step < args.steps:
        for inputs, labels in loader:
            noise = random.random() * 1e-3 + float(np.random.rand()) * 1e-3
            loss = torch.nn.functional.mse_loss(model(inputs[:, 1:]), labels) + noise
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.count += 1
            # The same on every process: registered objects are saved by the main one.
            counter.total += accelerator.gather(inputs[:, 1:5]).sum(0)
            step += 1
            batches.append([int(i) for i in inputs[:, 0].tolist()])
            if step == save_at:
                save_state(accelerator, target, step)
            if step == args.steps:
                break
    rank = accelerator.process_index
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        tensors.update({f"optim.{index}.{k}": v.clone() for k, v in state.items()})
    tensors["counter.total"] = counter.total
    save_file(tensors, str(out / f"rank{rank}.safetensors"))
    committed = None
    if isinstance(target, ckptstore.Run):
        target.finalize()  # the save may still be uploading (open_run saves asynchronously)
        committed = [
            (c.step, sorted(x.name for x in target.checkpoint(c.step).components))
            for c in target.checkpoints()
        ]
        target.close()
    report = {
        "first": first,
        "batches": batches,
        "count": counter.count,
        "lr": scheduler.get_last_lr(),
        "accelerator_step": accelerator.step,
        "python": random.random(),
        "numpy": float(np.random.rand()),
        "torch": float(torch.rand(1)),
        "checkpoints": committed,
        "processes": accelerator.num_processes,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()
    accelerator.free_memory()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("store")
    parser.add_argument("out")
    parser.add_argument("steps", type=int)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--twice",
        action="store_true",
        help="OUT/straight: a job that saves at --save-at; then, in these same processes, "
        "OUT/resumed: a new Accelerator and new objects that resume from it",
    )
    args = parser.parse_args()
    out = Path(args.out)
    if args.twice:
        train(args, out / "straight", save_at=args.save_at, resume=False)
        train(args, out / "resumed", save_at=0, resume=True)
    else:
        train(args, out, save_at=args.save_at, resume=args.resume)
    Accelerator().end_training()


if __name__ == "__main__":
    main()
