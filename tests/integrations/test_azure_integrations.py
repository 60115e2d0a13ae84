"""The integrations on an Azure store, unchanged: a store URL ``az://container/prefix`` and
``AZURE_STORAGE_CONNECTION_STRING`` (Azurite's) are all that differs from a local run.

Default run: a DCP save and load in this process. Slow (make test-slow): DCP from two gloo
ranks, Megatron-Core from two ranks (each rank opening the store by its URL), and the
reference trainer's two runs (stop early, then resume) on SQLite + Azurite.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from azureserver import AzureStoreFactory

import ckptstore
from ckptstore.integrations import dcp as ckpt_dcp

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def az_url(azure_store_factory: AzureStoreFactory, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh ``az://`` store URL, its credentials in the environment as a user's would be."""
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING", azure_store_factory.endpoint.connection_string
    )
    return f"az://{azure_store_factory.container}/{azure_store_factory.prefix}"


def _load(path: Path, name: str) -> Any:
    """A helper module of another test directory, by path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled.*:UserWarning")
def test_dcp_save_and_load_on_az(az_url: str, tmp_path: Path) -> None:
    db = tmp_path / "manifest.db"
    model = torch.nn.Linear(8, 4)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with ckptstore.open_run("dcp", db=db, store=az_url) as run:
        info = ckpt_dcp.save({"model": model.state_dict(), "step": 7}, run, 1)
        assert info.status == "committed"
    target: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in want.items()},
        "step": 0,
    }
    with ckptstore.open_run("dcp", db=db, store=az_url, writable=False) as run:
        assert ckpt_dcp.load(target, run).step == 1
        assert all(k.startswith("cas/") for k in (i.key for i in run.store.list()))
    assert target["step"] == 7
    for name, tensor in want.items():
        assert torch.equal(target["model"][name], tensor), name


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_two_ranks_on_az(az_url: str, tmp_path: Path) -> None:
    multirank = _load(TESTS / "integrations" / "test_dcp_multirank.py", "dcp_multirank_helpers")
    db = str(tmp_path / "manifest.db")
    env = multirank.child_env()
    observed = multirank.launch(tmp_path, db, az_url, env)
    multirank.check_run(observed, db, az_url)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_megatron_two_ranks_on_az(az_url: str, tmp_path: Path, world_of_one: None) -> None:
    """A TP=1 save here, then the two-rank job of test_megatron.py (sync and async saves, a
    resharded load, a failing rank) with every rank opening ``az://`` by its URL."""
    megatron = _load(TESTS / "integrations" / "test_megatron.py", "megatron_helpers")
    # Imported on first use with Megatron's import-time warnings silenced (lazy_imports.py).
    mcore, model = megatron.mcore, megatron.model
    config = {"run": "mcore", "db": str(tmp_path / "manifest.db"), "out": str(tmp_path)}
    config["store"] = az_url
    with ckptstore.open_run("mcore", db=config["db"], store=az_url) as writer:
        mcore.save(model.sharded_state_dict(1, 0, 1, objects=False), writer, 10)
    reports = megatron.spawn(config)
    assert [r["load_tp1_step10"] for r in reports] == [True, True]
    for report in reports:
        for check in ("load_step1", "load_step3", "objects_step1", "objects_step3"):
            assert report[check], (check, report)
    with ckptstore.open_run("mcore", db=config["db"], store=az_url, writable=False) as run:
        loaded = mcore.load(model.sharded_state_dict(None, 0, 1, objects=False), run, 3)
    assert model.same(loaded["model"], model.expected_local(2, 0, 1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_two_runs_on_az(az_url: str, tmp_path: Path) -> None:
    two_runs = _load(TESTS / "trainer" / "test_trainer_two_runs.py", "trainer_two_runs_helpers")
    env = two_runs._env(
        tmp_path, AZURE_STORAGE_CONNECTION_STRING=os.environ["AZURE_STORAGE_CONNECTION_STRING"]
    )
    two_runs._two_runs(tmp_path, f"sqlite:///{tmp_path / 'manifest.db'}", az_url, env)
