"""Megatron-Core dist_checkpointing through ckptstore (ckptstore.integrations.megatron).

One spawned job of two gloo ranks (TP=2, ``megatron_child.py``) runs every multi-process
scenario in turn -- load a TP=1 checkpoint, save sync, re-save unchanged, save async through
Megatron's AsyncCallsQueue, a save where one rank fails, loads at TP=2 -- because each spawn
costs ~17 s here. The TP=1 saves and loads run in this process, in a world of one. Stores are a
real directory (and SeaweedFS for the integration case), the manifest a real SQLite file.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lazy_imports import deferred

import ckptstore
from ckptstore.errors import IntegrityError, SaveError

CHILD = Path(__file__).with_name("megatron_child.py")
WORLD = 2
JOB_TIMEOUT = 240

# Megatron-Core takes seconds to import: on first use, not when pytest collects this module.
model = deferred("megatron_child")
dist_checkpointing = deferred("megatron.core.dist_checkpointing")
ShardedObject = deferred("megatron.core.dist_checkpointing", "ShardedObject")
ShardedTensor = deferred("megatron.core.dist_checkpointing", "ShardedTensor")
mcore = deferred("ckptstore.integrations.megatron")


@dataclass
class Job:
    """The spawned job's reports, and a run handle on its checkpoints for this process."""

    reports: list[dict[str, Any]]
    run: Any
    config: dict[str, Any]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    """A one-process gloo world for the saves and loads at TP=1 in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def spawn(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the ranks of megatron_child.py to completion (or fail the test on a timeout)."""
    port, text = free_port(), json.dumps(config)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen([sys.executable, str(CHILD), str(r), str(WORLD), str(port), text], env=env)
        for r in range(WORLD)
    ]
    try:
        for proc in procs:
            proc.wait(timeout=JOB_TIMEOUT)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    reports = []
    for rank in range(WORLD):
        path = Path(config["out"]) / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} exited {procs[rank].returncode} without a report"
        reports.append(json.loads(path.read_text()))
        assert "traceback" not in reports[-1], reports[-1]["traceback"]
    return reports


@pytest.fixture(
    scope="module", params=["local", pytest.param("seaweed", marks=pytest.mark.integration)]
)
def job(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    world_of_one: None,
) -> Iterator[Job]:
    """Step 10 saved at TP=1 here, then the two-rank job (steps 1-4), then a reader run."""
    root = tmp_path_factory.mktemp(f"megatron-{request.param}")
    config: dict[str, Any] = {"run": "mcore", "db": str(root / "manifest.db"), "out": str(root)}
    if request.param == "local":
        config["store"] = str(root / "store")
    else:
        endpoint = request.getfixturevalue("seaweed_endpoint")
        bucket = request.getfixturevalue("seaweed_bucket")
        config["store"] = f"s3://{bucket}/megatron-{os.getpid()}"
        config["store_options"] = {"endpoint_url": endpoint.endpoint_url}
    store = ckptstore.open_store(config["store"], **config.get("store_options", {}))
    with ckptstore.open_run(config["run"], db=config["db"], store=store) as writer:
        mcore.save(model.sharded_state_dict(1, 0, 1, objects=False), writer, 10)
    reports = spawn(config)
    with ckptstore.open_run(config["run"], db=config["db"], store=store, writable=False) as run:
        yield Job(reports, run, config)
    store.close()


def test_two_ranks_load_a_tp1_checkpoint_resharded(job: Job) -> None:
    assert [r["load_tp1_step10"] for r in job.reports] == [True, True]


def test_sync_and_async_saves_load_back_bit_exact_at_tp2(job: Job) -> None:
    for report in job.reports:
        for check in ("load_step1", "load_step3", "objects_step1", "objects_step3"):
            assert report[check], (check, report)


@pytest.mark.parametrize(("step", "seed"), [(1, 1), (3, 2)])
def test_tp2_checkpoints_load_bit_exact_at_tp1(job: Job, step: int, seed: int) -> None:
    loaded = mcore.load(model.sharded_state_dict(None, 0, 1, objects=False), job.run, step)
    assert model.same(loaded["model"], model.expected_local(seed, 0, 1))


def test_consolidated_tensors_are_the_global_ones(job: Job) -> None:
    info = job.run.load(3, components=[]).info
    assert mcore.is_megatron_checkpoint(info)
    full = dict(mcore.iter_full_tensors(job.run.store, info))
    assert model.same(full, model.full_state(2))


def test_one_rank_failing_commits_nothing_and_raises_everywhere(job: Job) -> None:
    messages = [r["failed_save"] for r in job.reports]
    assert all(m and "nothing was committed" in m and f"rank {WORLD - 1}" in m for m in messages)
    assert "(in ShardedObject 'rng_state')" in messages[0]
    assert job.reports[0]["steps"] == [1, 2, 3, 10]


def test_an_unchanged_resave_uploads_almost_nothing(job: Job) -> None:
    uploaded, stored = job.reports[0]["uploaded"], job.reports[0]["stored"]
    assert stored["2"] == stored["1"] > 2000
    # Every blob of step 2 is one step 1 stored already (the row's own bookkeeping aside).
    assert uploaded["2"] == 0, uploaded


def test_the_layout_lists_every_rank_shard(job: Job) -> None:
    info = job.run.load(1, components=[]).info
    names = sorted(c.name for c in info.components)
    assert names == ["megatron/common", "megatron/meta", "megatron/rank0", "megatron/rank1"]
    assert info.training_info == {"iteration": 1}


# -- in this process only (a world of one) ------------------------------------------------------


@pytest.fixture
def run(tmp_path: Path, world_of_one: None) -> Iterator[Any]:
    with ckptstore.open_run("solo", db=tmp_path / "m.db", store=tmp_path / "store") as opened:
        yield opened


class Planted:
    """Unpickling this creates ``path``: proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_a_planted_pickle_is_never_executed(run: Any, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Planted(marker))
    state = model.sharded_state_dict(1, 0, 1)
    state["payload"] = payload  # common state: stored as bytes, returned as bytes
    mcore.save(state, run, 1)
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "common.pt").write_bytes(payload)  # a planted common.pt is never opened
    (staging / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    loaded = mcore.load(model.sharded_state_dict(None, 0, 1), run, 1, checkpoint_dir=str(staging))
    assert loaded["payload"] == payload
    assert model.same(loaded["model"], model.expected_local(1, 0, 1))
    # A meta component that is a pickle is refused as not ours, unread.
    run.save(2, {"megatron/meta": payload, "megatron/common": {"x": payload}}).wait()
    with pytest.raises(IntegrityError, match="not a ckptstore Megatron meta"):
        mcore.load(model.sharded_state_dict(None, 0, 1), run, 2)
    with pytest.raises(IntegrityError, match="not a ckptstore Megatron meta"):
        list(mcore.iter_full_tensors(run.store, run.latest()))
    assert not marker.exists()


def test_a_common_state_that_is_not_plain_is_refused(run: Any) -> None:
    state = model.sharded_state_dict(1, 0, 1)
    state["args"] = argparse.Namespace(lr=0.1)
    with pytest.raises(SaveError, match="args: cannot checkpoint a value of type Namespace"):
        mcore.save(state, run, 1)
    assert run.checkpoints() == []


def test_the_common_state_is_stored_without_reading_common_pt_back(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Megatron writes common.pt; ckptstore takes the common state in memory and never loads
    that file (no unpickling, not even weights-only)."""

    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.load was called during a save")

    monkeypatch.setattr(torch, "load", no_load)
    state = model.sharded_state_dict(1, 0, 1)
    state["iteration"] = 7
    state["lr_schedule"] = {"lr": 0.5, "warmup": (10, 20)}
    mcore.save(state, run, 1)
    monkeypatch.undo()
    common = run.load(1, components=["megatron/common"]).state["megatron/common"]
    assert common == {"iteration": 7, "lr_schedule": {"lr": 0.5, "warmup": (10, 20)}}


def test_registered_backend_loads_through_megatron_entry_points(run: Any, tmp_path: Path) -> None:
    mcore.register(run)
    directory = tmp_path / "iter_0000007"
    directory.mkdir()
    state = model.sharded_state_dict(1, 0, 1)
    dist_checkpointing.save(state, str(directory), sharded_strategy=("ckptstore", 1))
    assert [c.step for c in run.checkpoints()] == [7]
    metadata = json.loads((directory / "metadata.json").read_text())
    assert metadata["sharded_backend"] == "ckptstore"
    # Megatron's load picks the backend from metadata.json; the common state comes from the
    # store when the common backend is ckptstore too.
    metadata["common_backend"] = "ckptstore"
    (directory / "metadata.json").write_text(json.dumps(metadata))
    (directory / "common.pt").unlink()
    loaded = dist_checkpointing.load(model.sharded_state_dict(None, 0, 1), str(directory))
    assert model.same(loaded["model"], model.expected_local(1, 0, 1))
    tensors = dist_checkpointing.load_tensors_metadata(str(directory))
    assert tensors["mlp.fc2.weight"].global_shape == (8, 16)


def test_loading_a_missing_or_mismatched_tensor_names_the_key(run: Any) -> None:
    mcore.save(model.sharded_state_dict(1, 0, 1, objects=False), run, 1)
    wrong = {"w": ShardedTensor.from_rank_offsets("mlp.fc1.weight", torch.zeros(16, 8).double())}
    with pytest.raises(ckptstore.ConfigError, match=r"'mlp.fc1.weight' is float32 .* float64"):
        mcore.load(wrong, run, 1)
    missing = {"w": ShardedTensor.from_rank_offsets("nope", torch.zeros(2))}
    with pytest.raises(ckptstore.ConfigError, match="no tensor 'nope'"):
        mcore.load(missing, run, 1)
    obj = {"o": ShardedObject("rng_state", None, (1,), (0,))}
    with pytest.raises(ckptstore.ConfigError, match="no sharded object"):
        mcore.load(obj, run, 1)
