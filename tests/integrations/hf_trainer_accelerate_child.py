"""A tiny GPT-2 trained four ways in one process (test_hf_trainer_accelerate.py).

``hf_trainer_accelerate_child.py DB STORE OUT``: a 2-layer GPT-2 built from a config (no
download), a fixed random token dataset, dropout, AdamW and a linear schedule, 12 steps with a
checkpoint every 5, trained by

- ``plain``: ``transformers.Trainer`` saving its own ``checkpoint-N`` folders;
- ``plain_resumed``: the same, resumed from its ``checkpoint-5`` folder;
- ``ours``: ``CkptStoreTrainer`` saving to the ckptstore run ``trainer``;
- ``ours_resumed``: the same, resumed from that run's step 5.

Every resume starts with scrambled generators. Writes ``OUT/<name>.safetensors`` (final
weights) and ``OUT/report.json`` (each one's losses by step, and the committed steps).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

import ckptstore
from ckptstore.integrations.accelerate.trainer import CkptStoreTrainer


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (40, 16), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(out: Path, name: str, run: ckptstore.Run | None, resume: Any) -> dict[str, float]:
    set_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(out / ("plain-folders" if run is None else "ours-folders")),
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        save_strategy="steps",
        save_steps=5,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    if run is None:
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    else:
        trainer = CkptStoreTrainer(model=model, args=args, train_dataset=Tokens(), ckpt_target=run)
    if resume is not None:
        random.seed(99)
        np.random.seed(99)
        torch.manual_seed(99)
    trainer.train(resume_from_checkpoint=resume)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    save_file(weights, str(out / f"{name}.safetensors"))
    return {str(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h}


def main() -> None:
    db, store, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "plain": train(out, "plain", None, None),
        "plain_resumed": train(out, "plain_resumed", None, str(out / "plain-folders/checkpoint-5")),
    }
    with ckptstore.open_run("trainer", db=db, store=store) as run:
        report["ours"] = train(out, "ours", run, None)
        report["committed"] = [c.step for c in run.checkpoints(["committed"])]
        report["ours_resumed"] = train(out, "ours_resumed", run, 5)
        report["components"] = sorted(c.name for c in run.checkpoint(5).components)
    (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
