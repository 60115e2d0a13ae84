"""Issue 40 for the torchtitan resume: ``CkptStoreCheckpointManager.load`` either fills every
target -- the model's parameters, the optimizer's and schedulers' state, the other states -- from
verified bytes, or refuses, naming the entry, before any target is written.

Its load is torch DCP's ``load`` over ckptstore's reader (not ``ckpt_dcp.load``), planned by
DCP with the Stateful states expanded, so the targets are checked in the planner: a tensor of a
Stateful's state dict is as much a target as a parameter. The bad target sits in a Stateful
state of the job ('extra'), the other targets hold a sentinel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from ckptstore.errors import CkptStoreError, ConfigError
from ckptstore.integrations.torchtitan import CkptStoreCheckpointManager

pytestmark = [
    # torchtitan's LRSchedulersContainer.load_state_dict calls get_lr() outside step().
    pytest.mark.filterwarnings("ignore:To get the last learning rate:UserWarning"),
]
SENTINEL = -7.0
#: The target of 'extra.y' (4 x 4 float32), given the target of 'extra.x' (16 float32).
BAD: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "expanded": lambda x: torch.full((4,), SENTINEL).expand(4, 4),
    "overlapping": lambda x: torch.full((16,), SENTINEL).as_strided((4, 4), (1, 1)),
    "meta": lambda x: torch.empty(4, 4, device="meta"),
    "shares-memory": lambda x: x[:16].view(4, 4),
}
WHY = {"expanded": "overlap", "overlapping": "overlap", "meta": "meta", "shares": "shares"}


class Extra:
    """A Stateful state of the job holding two tensors, 'x' and 'y'."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def state_dict(self) -> dict[str, Any]:
        return {"x": self.x, "y": self.y}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.x, self.y = state["x"], state["y"]


class Job:
    """A torchtitan job's model, optimizers, schedulers, 'extra' state and checkpointer."""

    def __init__(self, folder: Path, extra: Extra, *, tied: bool = False) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Embedding(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, bias=False)
        )
        if tied:
            self.model[2].weight = self.model[0].weight
        self.optimizers = default_adamw(lr=1e-2).build(model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=10
        )
        self.extra = extra
        self.checkpointer = CkptStoreCheckpointManager.Config(
            enable=True, interval=1, keep_latest_k=0
        ).build(
            dataloader=None,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.schedulers,
            states={"extra": extra},
            base_folder=str(folder),
        )

    def train_and_save(self, step: int) -> None:
        self.model(torch.arange(8)).square().mean().backward()
        self.optimizers.step()
        self.schedulers.step()
        self.optimizers.zero_grad()
        self.checkpointer.save(step, last_step=False)

    def targets(self) -> dict[str, torch.Tensor]:
        """Every tensor the resume writes into, by name (the optimizer state included)."""
        found = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        for name, state in self.optimizers.state_dict().items():
            if isinstance(state, torch.Tensor):
                found[f"optimizer.{name}"] = state
        return found


def saved_extra() -> Extra:
    return Extra(torch.arange(16.0) + 1, -torch.arange(16.0).view(4, 4))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A checkpoint of step 1 (trained once) in ``tmp_path``."""
    job = Job(tmp_path, saved_extra())
    job.train_and_save(1)
    job.checkpointer.close()
    return tmp_path


def sentinel_job(folder: Path, y: Callable[[torch.Tensor], torch.Tensor]) -> Job:
    """A job whose every target holds the sentinel, but 'extra.y', which ``y`` makes."""
    x = torch.full((16,), SENTINEL)
    job = Job(folder, Extra(x, y(x)))
    with torch.no_grad():
        for tensor in job.targets().values():
            tensor.fill_(SENTINEL)
    return job


def assert_untouched(job: Job, before: dict[str, torch.Tensor]) -> None:
    after = {**job.targets(), "extra.x": job.extra.x}
    assert after.keys() == before.keys()
    for name, tensor in after.items():
        assert torch.equal(tensor, before[name]), f"{name} was written before the refusal"


def snapshot(job: Job) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in {**job.targets(), "extra.x": job.extra.x}.items()}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_target_no_load_can_fill_is_refused_before_any_target_is_written(
    folder: Path, kind: str
) -> None:
    """Before: DCP filled the model, the optimizer state and 'extra.x', then raised on the
    expanded target (torch's copy) or silently lost elements of the overlapping ones."""
    job = sentinel_job(folder, BAD[kind])
    before = snapshot(job)
    why = WHY["shares" if kind == "shares-memory" else kind]
    with pytest.raises(ConfigError, match=rf"'extra\.[xy]'.*{why}"):
        job.checkpointer.load()
    assert_untouched(job, before)
    job.checkpointer.close()


def test_a_target_of_another_shape_is_refused_by_name_before_any_target_is_written(
    folder: Path,
) -> None:
    job = sentinel_job(folder, lambda x: torch.full((4, 5), SENTINEL))
    before = snapshot(job)
    with pytest.raises(CkptStoreError, match=r"extra\.y"):
        job.checkpointer.load()
    assert_untouched(job, before)
    job.checkpointer.close()


def test_a_target_of_another_dtype_is_filled_exactly_as_dcp_converts(folder: Path) -> None:
    job = sentinel_job(folder, lambda x: torch.full((4, 4), SENTINEL, dtype=torch.float64))
    assert job.checkpointer.load() is True
    saved = saved_extra()
    assert torch.equal(job.extra.x, saved.x)
    assert torch.equal(job.extra.y, saved.y.double())
    assert not any((t == SENTINEL).all() for t in job.targets().values())
    job.checkpointer.close()


def test_interleaved_targets_and_tied_weights_load_exactly(tmp_path: Path) -> None:
    """Columns of one matrix share no byte; a tied weight (one tensor under two names, as a
    model's state dict gives it) is one target: both load, and resume as saved."""
    saver = Job(tmp_path, saved_extra(), tied=True)
    saver.train_and_save(1)
    weights = {k: v.clone() for k, v in saver.model.state_dict().items()}
    saver.checkpointer.close()
    buffer = torch.full((16, 2), SENTINEL)
    job = Job(tmp_path, Extra(buffer[:, 0], buffer[:, 1].view(4, 4)), tied=True)
    assert job.checkpointer.load() is True
    saved = saved_extra()
    assert torch.equal(buffer, torch.stack([saved.x, saved.y.reshape(-1)], 1))
    for key, value in job.model.state_dict().items():
        assert torch.equal(value, weights[key]), key
    assert job.model[2].weight is job.model[0].weight
    job.checkpointer.close()


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A one-process gloo world, for DTensors (FSDP2's parameters and optimizer state)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["expanded", "shares-memory"])
def test_a_dtensors_local_shard_is_the_target_checked(
    tmp_path: Path, world_of_one: None, kind: str
) -> None:
    """DCP writes a DTensor's local shard: an expanded one, or one sharing memory with another
    target, is refused before any target is written."""
    mesh = init_device_mesh("cpu", (1,))
    saved = saved_extra()
    saver = Job(tmp_path, Extra(distribute_tensor(saved.x, mesh, [Replicate()]), saved.y))
    saver.train_and_save(1)
    saver.checkpointer.close()
    job = sentinel_job(tmp_path, lambda x: torch.full((4, 4), SENTINEL))
    local = job.extra.y.view(16) if kind == "shares-memory" else torch.zeros(1).expand(16)
    job.extra.x = DTensor.from_local(local, mesh, [Replicate()])
    before = snapshot(job)
    why = "shares" if kind == "shares-memory" else "overlap"
    with pytest.raises(ConfigError, match=rf"'extra\.[xy]'.*{why}"):
        job.checkpointer.load()
    assert_untouched(job, before)
    job.checkpointer.close()
