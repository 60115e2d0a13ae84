"""A tiny deterministic LightningModule and the Trainer the Lightning plugin tests drive."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ckptstore.integrations.lightning import CkptstoreCheckpointIO

#: Four batches per epoch: epoch e ends at global step 4 * (e + 1).
STEPS_PER_EPOCH = 4


class TinyModel(L.LightningModule):
    """Linear regression on a fixed dataset, AdamW with a step LR schedule; ``train_loss``
    falls every epoch, so ``ModelCheckpoint``'s top-k keeps the newest."""

    def __init__(self, lr: float = 0.05, **extra: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)]

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def trainer(epochs: int, plugin: Any, ckpt_dir: Path, **options: Any) -> L.Trainer:
    """A quiet CPU Trainer keeping the top 2 checkpoints by ``train_loss`` and ``last.ckpt``."""
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, monitor="train_loss", save_top_k=2, save_last=True
    )
    return L.Trainer(
        max_epochs=epochs,
        plugins=[plugin],
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        **options,
    )


def fit(
    epochs: int, plugin: Any, ckpt_dir: Path, ckpt_path: str | None = None, **hparams: Any
) -> tuple[TinyModel, L.Trainer]:
    """Seed, build, fit; the model and its trainer."""
    L.seed_everything(0, verbose=False)
    model = TinyModel(**hparams)
    run = trainer(epochs, plugin, ckpt_dir)
    run.fit(model, ckpt_path=ckpt_path)
    return model, run


def plugin(root: Path, **options: Any) -> CkptstoreCheckpointIO:
    """The plugin on a SQLite manifest and a local store under ``root``."""
    return CkptstoreCheckpointIO(
        "tiny", db=f"sqlite:///{root}/manifest.db", store=str(root / "store"), **options
    )


def assert_same_training_state(a: L.Trainer, b: L.Trainer) -> None:
    """Weights, optimizer and scheduler state and counters equal, bit for bit."""
    assert a.global_step == b.global_step
    assert a.current_epoch == b.current_epoch
    wa, wb = a.lightning_module.state_dict(), b.lightning_module.state_dict()
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = a.optimizers[0].state_dict(), b.optimizers[0].state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    for index, state in oa["state"].items():
        other = ob["state"][index]
        assert state.keys() == other.keys()
        assert all(torch.equal(state[k], other[k]) for k in state)
    assert a.lr_scheduler_configs[0].scheduler.state_dict() == (
        b.lr_scheduler_configs[0].scheduler.state_dict()
    )
