"""torchtitan's checkpointing on ckptstore, driven through torchtitan's own classes: the manager
is built from its config class as torchtitan's Trainer builds it, with torchtitan's
ModelWrapper, OptimizersContainer and LRSchedulersContainer; only the model is a small
``nn.Sequential`` (torchtitan's llama3 debug model needs triton, which a CPU-only torch lacks).

The two-rank FSDP2 run is docs/torchtitan.md's example (``# train_torchtitan.py``), launched by
torchrun: interrupted and resumed, it ends with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import save as dcp_save
from torchtitan.components.checkpointer import (
    BaseCheckpointManager,
    CheckpointManager,
)
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

import ckptstore
from ckptstore.errors import CheckpointNotFoundError, ConfigError, SaveError
from ckptstore.extending import ComponentReader
from ckptstore.integrations.dcp import CkptStoreWriter, NoPickleSavePlanner
from ckptstore.integrations.torchtitan import CkptStoreCheckpointManager

pytestmark = [
    # torchtitan's LRSchedulersContainer.load_state_dict calls get_lr() outside step().
    pytest.mark.filterwarnings("ignore:To get the last learning rate:UserWarning"),
]
PAGE = Path(__file__).resolve().parents[2] / "docs" / "torchtitan.md"


class TrainState:
    """What torchtitan's Trainer saves as ``train_state`` (it is a Stateful itself)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class Job:
    """One process of a torchtitan job: model, optimizers, schedulers and the checkpointer."""

    def __init__(self, folder: Path, sd_adapter: Any = None, **options: Any) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )
        self.optimizers = default_adamw(lr=1e-2).build(model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=10
        )
        self.train_state = TrainState()
        options = {"enable": True, "interval": 2, "keep_latest_k": 0, **options}
        self.checkpointer = CkptStoreCheckpointManager.Config(**options).build(
            dataloader=None,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.schedulers,
            states={"train_state": self.train_state},
            sd_adapter=sd_adapter,
            base_folder=str(folder),
        )

    def train(self, last: int, *, final: int | None = None, save: bool = True) -> None:
        """Steps after the current one up to ``last``, as torchtitan's train loop runs them;
        ``final`` is the job's last step (default ``last``)."""
        final = last if final is None else final
        for step in range(self.train_state.step + 1, last + 1):
            self.train_state.step = step
            batch = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
            self.model(batch).square().mean().backward()
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.schedulers.step()
            self.optimizers.zero_grad()
            if save:
                self.checkpointer.save(step, last_step=step == final)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def statuses(self) -> list[tuple[int, str]]:
        return [(c.step, c.status) for c in self.checkpointer.run.checkpoints()]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_torchtitan_builds_the_manager_from_its_config_class(tmp_path: Path) -> None:
    job = Job(tmp_path)
    assert type(job.checkpointer) is CkptStoreCheckpointManager
    assert isinstance(job.checkpointer, BaseCheckpointManager)
    assert isinstance(job.checkpointer.config, BaseCheckpointManager.Config)
    assert job.checkpointer.load() is False  # a fresh start
    job.checkpointer.close()


def test_keep_latest_k_1_that_torchtitan_refuses_keeps_only_the_newest_commit(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        CheckpointManager.Config(keep_latest_k=1)
    job = Job(tmp_path, keep_latest_k=1, last_save_model_only=False)
    job.train(5)
    assert job.statuses() == [(2, "deleted"), (4, "deleted"), (5, "committed")]
    job.checkpointer.close()
    # Resume is a query, not a folder listing: there are no step folders to list.
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [
        "manifest.db",
        "store",
    ]


def test_an_interrupted_job_resumes_exactly_where_it_stopped(tmp_path: Path) -> None:
    straight = Job(tmp_path / "straight")
    straight.train(6)
    first = Job(tmp_path / "resumed")
    first.train(4, final=6)  # saves steps 2 and 4, then stops (preempted)
    first.checkpointer.close()
    second = Job(tmp_path / "resumed")
    assert second.checkpointer.load() is True
    assert second.train_state.step == 4
    second.train(6)
    assert_same(second.weights(), straight.weights())
    assert [s.last_epoch for s in second.schedulers] == [s.last_epoch for s in straight.schedulers]
    for job in (straight, second):
        job.checkpointer.close()


def test_load_step_takes_a_step_or_torchtitans_step_name(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.train(2, final=4)
    at_two = job.weights()
    job.train(4)
    job.checkpointer.close()
    for step in (2, "step-2", "checkpoint/step-2"):
        again = Job(tmp_path)
        assert again.checkpointer.load(step) is True
        assert again.train_state.step == 2
        assert_same(again.weights(), at_two)
        again.checkpointer.close()
    missing = Job(tmp_path)
    with pytest.raises(CheckpointNotFoundError):
        missing.checkpointer.load(3)
    with pytest.raises(ConfigError, match=r"checkpoint.load_step='ckpt/x'.*step-N"):
        missing.checkpointer.load("ckpt/x")
    missing.checkpointer.close()


def test_async_save_commits_in_the_background(tmp_path: Path) -> None:
    job = Job(tmp_path, async_save=True)
    job.train(2, save=False)
    assert job.checkpointer.save(2) is True
    assert job.checkpointer.save_future is not None
    saved = job.weights()
    job.train(3, save=False)  # the optimizer changes the weights while the save uploads
    job.checkpointer.maybe_wait_for_saving()
    assert job.checkpointer.save_future is None
    assert job.statuses() == [(2, "committed")]
    job.checkpointer.close()
    again = Job(tmp_path, async_save=True)
    assert again.checkpointer.load() is True
    assert_same(again.weights(), saved)
    again.checkpointer.close()


def test_a_failed_async_save_is_raised_at_the_next_wait(tmp_path: Path) -> None:
    job = Job(tmp_path, async_save=True)
    job.train(2, save=False)
    job.checkpointer.states["train_state"] = {"not storable": object()}
    assert job.checkpointer.save(2) is True  # the failure is in the background
    with pytest.raises(SaveError, match=r"step 2 .*not storable"):
        job.checkpointer.maybe_wait_for_saving()
    assert job.statuses() == []
    job.checkpointer.close()


def test_a_damaged_newest_checkpoint_is_marked_corrupt_and_resume_falls_back(
    tmp_path: Path,
) -> None:
    job = Job(tmp_path)
    job.train(4, final=10)
    job.checkpointer.close()
    with ckptstore.open_run(
        "torchtitan",
        db=tmp_path / "checkpoint" / "manifest.db",
        writable=False,
        store=tmp_path / "checkpoint" / "store",
    ) as run:
        two, four = run.checkpoint(2), run.checkpoint(4)

        def data_blobs(info: ckptstore.CheckpointInfo) -> set[str]:
            digest = next(c.index_digest for c in info.components if c.name == "dcp/rank0")
            return ComponentReader(run.store, digest).digests

        hexdigest = sorted(data_blobs(four) - data_blobs(two))[0].split(":", 1)[1]
    blob = tmp_path / "checkpoint" / "store" / "cas" / hexdigest[:2] / hexdigest
    damaged = bytearray(blob.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    blob.chmod(0o644)
    blob.write_bytes(bytes(damaged))

    again = Job(tmp_path)
    assert again.checkpointer.load() is True
    assert again.train_state.step == 2
    assert again.statuses() == [(2, "committed"), (4, "corrupt")]
    again.checkpointer.close()


def test_a_load_only_job_loads_without_fencing_the_writer(tmp_path: Path) -> None:
    writer = Job(tmp_path)
    writer.train(2, final=10)
    reader = Job(tmp_path, load_only=True)
    assert reader.checkpointer.load() is True
    assert reader.train_state.step == 2
    assert reader.checkpointer.save(4) is False
    reader.checkpointer.close()
    writer.train(4, final=10)  # still the run's writer: its commit is not fenced
    assert writer.statuses() == [(2, "committed"), (4, "committed")]
    writer.checkpointer.close()


def test_initial_load_path_starts_a_new_run_from_another_runs_checkpoint(
    tmp_path: Path,
) -> None:
    where = {"db": str(tmp_path / "m.db"), "store": str(tmp_path / "store")}
    base = Job(tmp_path / "base", run="base", **where)
    base.train(4)
    base_weights = base.weights()
    base.checkpointer.close()

    tuned = Job(tmp_path / "tuned", run="tuned", initial_load_path="base@step-4", **where)
    assert tuned.checkpointer.load() is True
    assert_same(tuned.weights(), base_weights)
    assert tuned.train_state.step == 0  # initial_load_model_only: the model alone
    assert tuned.optimizers.optimizers[0].state == {}
    parent = ckptstore.run_info("tuned", db=where["db"])
    assert parent is not None
    with ckptstore.open_run("base", writable=False, **where) as opened:
        assert parent.parent_checkpoint_id == opened.checkpoint(4).id
    tuned.train(2, final=10)
    tuned.checkpointer.close()

    # Once the new run has checkpoints of its own, it resumes from them.
    again = Job(tmp_path / "tuned", run="tuned", initial_load_path="base@4", **where)
    assert again.checkpointer.load() is True
    assert again.train_state.step == 2
    again.checkpointer.close()


def test_initial_load_path_names_a_run_and_step(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"initial_load_path.*RUN@STEP"):
        CkptStoreCheckpointManager.Config(initial_load_path="/abs/checkpoint/step-10")


class TwoLayerAdapter(StateDictAdapter):  # type: ignore[misc]
    """A user's adapter: torchtitan names -> Hugging Face names (the bias of the head left out
    to show a dropped tensor)."""

    NAMES: ClassVar[dict[str, str]] = {
        "0.weight": "model.fc1.weight",
        "0.bias": "model.fc1.bias",
        "2.weight": "lm_head.weight",
    }

    def __init__(self) -> None:
        super().__init__(None, None)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {self.NAMES[k]: v for k, v in state_dict.items() if k in self.NAMES}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        back = {v: k for k, v in self.NAMES.items()}
        return {back[k]: v for k, v in hf_state_dict.items()}


def test_the_last_step_saves_the_model_in_export_dtype_and_as_hf_files(tmp_path: Path) -> None:
    job = Job(tmp_path, sd_adapter=TwoLayerAdapter(), last_save_in_hf=True, export_dtype="bfloat16")
    job.train(3)
    last = job.checkpointer.run.checkpoint(3)
    assert last.trigger == "last"
    assert last.training_info == {"model_only": True}
    exported = tmp_path / "checkpoint" / "hf" / "step-3"
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(TwoLayerAdapter.NAMES.values())
    tensors: dict[str, torch.Tensor] = {}
    for name in set(index["weight_map"].values()):
        tensors.update(load_file(exported / name))
    weights = job.weights()
    for ours, theirs in TwoLayerAdapter.NAMES.items():
        assert tensors[theirs].dtype == torch.bfloat16
        assert torch.equal(tensors[theirs], weights[ours].to(torch.bfloat16))
    job.checkpointer.close()
    # A job restarted after its last step loads the model only (that is all it holds).
    again = Job(tmp_path, sd_adapter=TwoLayerAdapter(), last_save_in_hf=True)
    assert again.checkpointer.load() is True
    assert again.train_state.step == 0
    assert torch.equal(again.weights()["0.weight"], weights["0.weight"].to(torch.bfloat16).float())
    again.checkpointer.close()


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"keep_latest_k": -1}, "keep_latest_k"),
        ({"interval": 0}, "interval"),
        ({"folder": " "}, "folder"),
        ({"exclude_from_loading": ["model"]}, "exclude_from_loading"),
        ({"initial_load_in_hf": True}, "initial_load_in_hf"),
        ({"last_save_in_hf": True, "last_save_model_only": False}, "last_save_model_only"),
        ({"initial_load_path": "base@latest"}, "initial_load_path"),
    ],
)
def test_config_errors_name_the_option(options: dict[str, Any], option: str) -> None:
    with pytest.raises(ConfigError, match=option):
        CkptStoreCheckpointManager.Config(**options)


def test_last_save_in_hf_needs_the_models_adapter(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sd_adapter"):
        Job(tmp_path, last_save_in_hf=True)


def test_a_disabled_manager_does_nothing(tmp_path: Path) -> None:
    job = Job(tmp_path, enable=False)
    assert job.checkpointer.load() is False
    assert job.checkpointer.save(2) is False
    job.checkpointer.maybe_wait_for_staging()
    job.checkpointer.close()
    assert not (tmp_path / "checkpoint").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_takes_a_torchtitan_checkpoint_id_as_the_step(tmp_path: Path) -> None:
    with ckptstore.open_run(
        "ids", db=tmp_path / "m.db", store=tmp_path / "store", async_save=False
    ) as run:
        writer = CkptStoreWriter(run)
        dcp_save(
            {"w": torch.ones(3)},
            storage_writer=writer,
            planner=NoPickleSavePlanner(),
            checkpoint_id="checkpoint/step-30",
        )
        assert writer.committed is not None
        assert writer.committed.step == 30


def test_without_torchtitan_the_module_names_the_install_and_ckptstore_still_imports() -> None:
    code = (
        "import sys\n"
        "sys.modules['torchtitan'] = None\n"
        "import ckptstore, ckptstore.integrations, ckptstore.integrations.dcp\n"
        "try:\n"
        "    import ckptstore.integrations.torchtitan\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "pip install torchtitan==0.3.0" in done.stdout


# -- docs/torchtitan.md's example: two gloo ranks, FSDP2, torchrun ---------------------------------


def readme_script(name: str) -> str:
    match = re.search(rf"```python\n(# {re.escape(name)}.*?)```", PAGE.read_text(), re.S)
    assert match is not None, f"docs/torchtitan.md has no python block starting with '# {name}'"
    return match.group(1)


def torchrun(cwd: Path, script: str, steps: int) -> str:
    cwd.mkdir(exist_ok=True)
    (cwd / "train_torchtitan.py").write_text(script)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = ["train_torchtitan.py", str(steps)]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def test_the_readme_example_saves_stops_and_resumes_on_two_fsdp_ranks(tmp_path: Path) -> None:
    script = readme_script("train_torchtitan.py")
    first = torchrun(tmp_path, script, 3)
    assert "committed steps: [3]" in first
    second = torchrun(tmp_path, script, 6)
    assert "rank 1 starts after step 3" in second
    assert "committed steps: [6]" in second  # keep_latest_k=1: only the newest is kept


@pytest.mark.slow
def test_the_readme_example_resumes_two_fsdp_ranks_to_the_same_weights(tmp_path: Path) -> None:
    script = readme_script("train_torchtitan.py")
    torchrun(tmp_path / "resumed", script, 3)
    second = torchrun(tmp_path / "resumed", script, 6)
    straight = torchrun(tmp_path / "straight", script, 6)
    weights = re.compile(r"weights sum (\S+)")
    assert weights.findall(second) == weights.findall(straight) != []


def test_with_local_dir_saves_go_to_the_tiers_are_drained_and_a_resume_reads_the_tier(
    tmp_path: Path,
) -> None:
    tiers = str(tmp_path / "tier-{node}")
    straight = Job(tmp_path / "straight")
    straight.train(6)
    first = Job(tmp_path / "resumed", local_dir=tiers)
    first.train(4, final=6)  # saves steps 2 and 4 to the tier, then is preempted
    first.checkpointer.close()  # drains the newest checkpoint before it exits
    second = Job(tmp_path / "resumed", local_dir=tiers)
    assert second.statuses() == [(2, "committed"), (4, "committed")]
    # The tier survived the preemption: the resume reads it, and nothing from the store.
    store = tmp_path / "resumed" / "checkpoint" / "store"
    store.rename(store.with_name("store-away"))
    store.mkdir()
    try:
        assert second.checkpointer.load() is True
    finally:
        store.rmdir()
        store.with_name("store-away").rename(store)
    assert second.train_state.step == 4
    second.train(6)
    assert_same(second.weights(), straight.weights())
    for job in (straight, second):
        job.checkpointer.close()
    third = Job(tmp_path / "resumed", local_dir=tiers)
    assert third.statuses()[-1] == (6, "committed")
    third.checkpointer.close()
