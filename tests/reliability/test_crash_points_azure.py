"""Crash consistency on Azure: the kill points of test_crash_points.py, with the saving
process's store on a real Azurite (crash_azure_child.py) and the resume check of that module
(every committed checkpoint loads exactly, nothing uncommitted is visible, GC with grace 0
leaves no orphan and no uncommitted block, the next save succeeds).

Default run: three points on SQLite + Azurite (half a block body sent, killed staging block 2
of a big blob, killed right after COMMIT) and the sweep of a killed upload's blocks. Stress
tier: every point that applies to a remote store, and random kills during a stream of saves.
"""

from __future__ import annotations

import datetime as dt
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_crash_points as crash
from azureserver import AzureStoreFactory

from ckptstore import open_run
from ckptstore.maintenance import collect_garbage

CHILD = Path(__file__).with_name("crash_azure_child.py")
DEFAULT_POINTS = ("put.partial.chunk", "put.part2", "commit.after-commit")


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[crash.Zygote]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(crash, "CHILD", CHILD)  # the zygote serves crash_azure_child.py
        z = crash.Zygote(tmp_path_factory.mktemp("crash-zygote-azure"))
    try:
        yield z
    finally:
        z.close()


@pytest.fixture
def azure_target(tmp_path: Path, azure_store_factory: AzureStoreFactory) -> crash.Target:
    factory = azure_store_factory
    root = f"{factory.prefix}/"

    def uncommitted() -> list[str]:
        container = factory.raw_container()
        pending = {
            b.name
            for b in container.list_blobs(name_starts_with=root, include=["uncommittedblobs"])
        }
        return sorted(pending - set(factory.container_names(prefix=root)))

    return crash.Target(
        db=f"sqlite:///{tmp_path / 'manifest.db'}",
        store=factory(),
        store_spec={
            "kind": "azure",
            "container": factory.container,
            "prefix": factory.prefix,
            "connection_string": factory.endpoint.connection_string,
        },
        workdir=tmp_path,
        leftovers=uncommitted,
    )


def _points(default: bool) -> list[Any]:
    chosen = [p for p in crash.POINTS if "s3" in p.backends]
    return [
        pytest.param(p, id=p.id)
        for p in chosen
        if (p.point in DEFAULT_POINTS and p.action == "sync") is default
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", _points(default=True))
def test_kill_point_sqlite_azurite(
    point: crash.Point, zygote: crash.Zygote, azure_target: crash.Target, reliability_report: Any
) -> None:
    crash.kill_and_check(zygote, azure_target, point, reliability_report)


@pytest.mark.stress
@pytest.mark.timeout(180)
@pytest.mark.parametrize("point", _points(default=False))
def test_kill_point_sqlite_azurite_stress(
    point: crash.Point, zygote: crash.Zygote, azure_target: crash.Target, reliability_report: Any
) -> None:
    crash.kill_and_check(zygote, azure_target, point, reliability_report)


@pytest.mark.timeout(120)
def test_gc_sweeps_the_blocks_of_a_killed_upload_after_the_grace(
    zygote: crash.Zygote, azure_target: crash.Target
) -> None:
    """Killed while staging block 2 of a big blob: its blocks (and those of any upload the
    other writer thread had going) stay uncommitted, costing storage; GC leaves them while
    younger than the grace and deletes them after."""
    point = crash.Point("put.part2", crash.PENDING, big=True)
    status = zygote.wait(zygote.start(azure_target.job(point)))
    assert status == -signal.SIGKILL, zygote.stderr_tail()
    left = azure_target.leftovers()
    assert 1 <= len(left) <= 2, left  # OPTIONS.max_workers=2 uploads at a time
    with open_run(crash.RUN, db=azure_target.db, store=azure_target.store, writable=False) as run:
        young = collect_garbage(run.db, run.store, grace=dt.timedelta(hours=1))
        assert young.incomplete == 0
        assert azure_target.leftovers() == left, "swept within the grace"
        swept = collect_garbage(run.db, run.store, grace=dt.timedelta(0))
    assert swept.incomplete == len(left)
    assert swept.incomplete_bytes > 0
    assert azure_target.leftovers() == []


@pytest.mark.stress
@pytest.mark.timeout(300)
def test_random_kills_during_a_stream_of_saves_sqlite_azurite(
    zygote: crash.Zygote, azure_target: crash.Target, reliability_report: Any
) -> None:
    crash.random_kills(zygote, azure_target, 10, seed=8, report=reliability_report)
