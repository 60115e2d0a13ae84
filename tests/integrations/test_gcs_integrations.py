"""The integrations on a Google Cloud Storage store, unchanged: a store URL ``gs://bucket/prefix``
and ``STORAGE_EMULATOR_HOST`` (the emulator of tests/gcsserver.py, with GCS's preconditions) are
all that differs from a local run.

Default run: a DCP save and load in this process, and DCP from two gloo ranks (the job of
test_dcp_multirank.py); a Megatron-Core save at TP=1 loaded back; the reference trainer
(``backend=local``, in this process) trained, stopped and resumed from its checkpoint.
Slow (make test-slow): Megatron-Core from two ranks (sync and async saves, each rank and
Megatron's async worker opening the store by its URL), and the trainer's real command on Ray,
two runs (stop early, then resume).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore
from ckptstore.integrations import dcp as ckpt_dcp

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def _load(path: Path, name: str) -> Any:
    """A helper module of another test directory, by path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _blob_keys_only(run: Any) -> None:
    """Everything the run stored in the bucket is a content-addressed blob."""
    keys = [info.key for info in run.store.list()]
    assert keys
    assert all(k.startswith("cas/") for k in keys), keys


# -- DCP ---------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled.*:UserWarning")
def test_dcp_save_and_load_on_gs(gcs_store_url: str, tmp_path: Path) -> None:
    db = tmp_path / "manifest.db"
    model = torch.nn.Linear(8, 4)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with ckptstore.open_run("dcp", db=db, store=gcs_store_url) as run:
        info = ckpt_dcp.save({"model": model.state_dict(), "step": 7}, run, 1)
        assert info.status == "committed"
        assert run.store.url == gcs_store_url
    target: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in want.items()},
        "step": 0,
    }
    with ckptstore.open_run("dcp", db=db, store=gcs_store_url, writable=False) as run:
        assert ckpt_dcp.load(target, run).step == 1
        _blob_keys_only(run)
    assert target["step"] == 7
    for name, tensor in want.items():
        assert torch.equal(target["model"][name], tensor), name


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_two_ranks_on_gs(gcs_store_url: str, tmp_path: Path) -> None:
    """test_dcp_multirank.py's job (resharding, an unchanged re-save, a failing rank, async
    save, FSDP2 + AdamW) with both ranks writing to ``gs://``, then loaded in one process."""
    multirank = _load(TESTS / "integrations" / "test_dcp_multirank.py", "dcp_multirank_helpers")
    db = str(tmp_path / "manifest.db")
    observed = multirank.launch(tmp_path, db, gcs_store_url, multirank.child_env())
    multirank.check_run(observed, db, gcs_store_url)


# -- Megatron-Core -----------------------------------------------------------------------------


def test_a_store_reopened_with_its_endpoint_reaches_the_emulator_unsigned(
    gcs_store_url: str,
) -> None:
    """Megatron's async saves reopen the store in a worker from its URL and its explicit
    endpoint (``StoreSpec``): towards STORAGE_EMULATOR_HOST that store, too, sends no
    credentials (it once went looking for Application Default Credentials and failed)."""
    with ckptstore.open_store(gcs_store_url) as store:
        assert store.put("probe", b"from the first store")
        endpoint = store.endpoint
    with ckptstore.open_store(gcs_store_url, create=False, endpoint_url=endpoint) as reopened:
        assert bytes(reopened.get("probe")) == b"from the first store"
        reopened.delete(["probe"])


@pytest.fixture
def world_of_one() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _megatron() -> Any:
    # Imported on first use with Megatron's import-time warnings silenced (lazy_imports.py).
    return _load(TESTS / "integrations" / "test_megatron.py", "megatron_helpers")


def test_megatron_save_and_load_on_gs(
    gcs_store_url: str, tmp_path: Path, world_of_one: None
) -> None:
    """A TP=1 save of a sharded state dict with objects, loaded back bit-exact."""
    megatron = _megatron()
    mcore, model = megatron.mcore, megatron.model
    db = str(tmp_path / "manifest.db")
    with ckptstore.open_run("mcore", db=db, store=gcs_store_url) as writer:
        mcore.save(model.sharded_state_dict(1, 0, 1), writer, 5)
    with ckptstore.open_run("mcore", db=db, store=gcs_store_url, writable=False) as run:
        loaded = mcore.load(model.sharded_state_dict(None, 0, 1), run, 5)
        _blob_keys_only(run)
    assert model.same(loaded["model"], model.expected_local(1, 0, 1))
    assert loaded["rng_state"] == {"seed": 1, "tp_rank": 0, "ids": [1, 2, 3]}


@pytest.mark.slow
def test_megatron_two_ranks_on_gs(gcs_store_url: str, tmp_path: Path, world_of_one: None) -> None:
    """A TP=1 save here, then the two-rank job of test_megatron.py (sync and async saves, a
    resharded load, a failing rank) with every rank opening ``gs://`` by its URL."""
    megatron = _megatron()
    mcore, model = megatron.mcore, megatron.model
    config = {"run": "mcore", "db": str(tmp_path / "manifest.db"), "out": str(tmp_path)}
    config["store"] = gcs_store_url
    with ckptstore.open_run("mcore", db=config["db"], store=gcs_store_url) as writer:
        mcore.save(model.sharded_state_dict(1, 0, 1, objects=False), writer, 10)
    reports = megatron.spawn(config)
    assert [r["load_tp1_step10"] for r in reports] == [True, True]
    for report in reports:
        for check in ("load_step1", "load_step3", "objects_step1", "objects_step3"):
            assert report[check], (check, report)
    with ckptstore.open_run("mcore", db=config["db"], store=gcs_store_url, writable=False) as run:
        loaded = mcore.load(model.sharded_state_dict(None, 0, 1, objects=False), run, 3)
    assert model.same(loaded["model"], model.expected_local(2, 0, 1))


# -- the reference trainer ---------------------------------------------------------------------


@pytest.fixture
def trainer_on_path() -> Iterator[None]:
    """The reference trainer runs from the checkout (it is not installed)."""
    added = str(ROOT) not in sys.path
    if added:
        sys.path.insert(0, str(ROOT))
    yield
    if added:
        sys.path.remove(str(ROOT))


@pytest.mark.timeout(300)
def test_trainer_stops_and_resumes_on_gs(
    gcs_store_url: str, tmp_path: Path, trainer_on_path: None
) -> None:
    """The trainer in this process (``backend=local``) with ``checkpointing.store=gs://...``:
    two steps, saved; a second start resumes from step 2 and reaches step 4; both checkpoints
    load from the bucket."""
    from trainer_helpers import small_config, train

    config = {"checkpointing__store": gcs_store_url}
    first, _ = train(small_config(tmp_path, grpo__max_num_steps=2, **config))
    assert (first["train_steps"], first["saved_steps"]) == (2, [2])
    second, lines = train(small_config(tmp_path, grpo__max_num_steps=4, **config))
    assert second["resumed_from"] == 2
    assert (second["train_steps"], second["saved_steps"]) == (4, [4])
    assert any(line.startswith("resumed run 't' from step 2") for line in lines), lines
    db = f"sqlite:///{tmp_path / 'manifest.db'}"
    with ckptstore.open_run("t", db=db, store=gcs_store_url, writable=False) as run:
        assert [c.step for c in run.checkpoints(["committed"])] == [2, 4]
        loaded = run.load()
        assert loaded.info.step == 4
        assert {"policy", "optimizer", "dataloader"} <= set(loaded.state)
        _blob_keys_only(run)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_two_runs_on_gs(gcs_store_url: str, tmp_path: Path) -> None:
    """The real command (``python -m trainer.grpo``) on Ray: stop after a step, then resume to
    the end, with ``checkpointing.store=gs://...`` and ``STORAGE_EMULATOR_HOST``."""
    two_runs = _load(TESTS / "trainer" / "test_trainer_two_runs.py", "trainer_two_runs_helpers")
    db = f"sqlite:///{tmp_path / 'manifest.db'}"
    two_runs._two_runs(tmp_path, db, gcs_store_url, two_runs._env(tmp_path))
