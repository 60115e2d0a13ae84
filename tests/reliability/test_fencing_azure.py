"""Fencing on an Azure store (test_concurrency_torture.py's fenced-writer cases on Azurite): a
stale writer -- in this process, or another process that is still alive -- with a save in
flight when a newer writer opens the run never commits; the newer writer's saves do; after GC
the container holds exactly the blobs of committed checkpoints."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import test_concurrency_torture as torture
from azureserver import AzureStoreFactory
from concurrency_child import FENCED, OPTIONS, differences, state
from fencing_azure_child import GatedAzureStore

from ckptstore import open_run
from ckptstore.errors import FencedError

CHILD = Path(__file__).with_name("fencing_azure_child.py")


@pytest.fixture
def az_url(azure_store_factory: AzureStoreFactory, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING", azure_store_factory.endpoint.connection_string
    )
    return f"az://{azure_store_factory.container}/{azure_store_factory.prefix}"


def test_stale_writer_with_a_save_in_flight_is_fenced_on_azure(
    sqlite_url: str, az_url: str, azure_store_factory: AzureStoreFactory, reliability_report: Any
) -> None:
    entered, release = threading.Event(), threading.Event()

    def hold(_key: str) -> None:
        entered.set()
        release.wait(60)

    store = azure_store_factory()
    a_store = GatedAzureStore(az_url, hold)
    a = open_run("fenced", db=sqlite_url, store=a_store, writer_options=OPTIONS)
    try:
        first = a.save(1, state(0, 1)).wait()
        a_store.armed = True
        in_flight = a.save(2, state(0, 2))
        assert entered.wait(60), "A's save never started uploading"
        with open_run("fenced", db=sqlite_url, store=store, writer_options=OPTIONS) as b:
            assert a.epoch is not None
            ea, eb = a.epoch, b.epoch
            assert eb == ea + 1
            assert torture.statuses(b) == [(1, "committed", ea), (2, "failed", ea)]
            release.set()
            with pytest.raises(FencedError, match=FENCED):
                in_flight.wait(60)
            with pytest.raises(FencedError, match=FENCED):
                a.save(3, state(0, 3)).wait(60)
            for step in (2, 3):
                b.save(step, state(1, step)).wait(60)
            latest = b.latest()
            assert latest is not None
            assert (latest.step, latest.writer_epoch) == (3, eb)
            lost = len(differences(b.load().state, state(1, 3)))
            lost += len(differences(b.load(step=1).state, state(0, 1)))
            assert first.step == 1
    finally:
        release.set()
        a.close()
        a_store.close()
    torture.record(reliability_report, saves=3, fenced=2, lost=lost)
    assert lost == 0
    assert torture.assert_store_exact(sqlite_url, store) == 3


def test_stale_writer_process_still_alive_is_fenced_on_azure(
    sqlite_url: str,
    az_url: str,
    azure_store_factory: AzureStoreFactory,
    tmp_path: Path,
    reliability_report: Any,
) -> None:
    name = "fenced-process"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torture, "CHILD", CHILD)
        a = torture.Child(
            "fenced-writer",
            {"name": name, "db": sqlite_url, "store": {"url": az_url}},
            tmp_path,
            "a",
        )
    store = azure_store_factory()
    try:
        first = a.expect("committed", timeout=180)
        a.expect("in-flight")
        with open_run(name, db=sqlite_url, store=store, writer_options=OPTIONS) as b:
            ea, eb = first["epoch"], b.epoch
            assert eb == ea + 1
            assert torture.statuses(b) == [(1, "committed", ea), (2, "failed", ea)]
            a.send("go")
            refused = [a.expect("fenced") for _ in (2, 3, 4)]
            assert [r["step"] for r in refused] == [2, 3, 4]
            assert all(FENCED in r["error"] for r in refused), refused
            a.expect("done")
            a.finish()
            for step in (2, 3, 4):
                b.save(step, state(1, step)).wait(60)
            loaded = b.load()
            assert loaded.info.step == 4
            lost = len(differences(loaded.state, state(1, 4)))
            lost += len(differences(b.load(step=1).state, state(0, 1)))
    finally:
        a.stop()
    torture.record(reliability_report, saves=4, fenced=len(refused), processes=1, lost=lost)
    assert lost == 0
    assert torture.assert_store_exact(sqlite_url, store) == 4
