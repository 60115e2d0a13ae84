"""The reference trainer is not installed (the wheel ships the library alone, DESIGN.md §12): it
runs from the checkout, so its tests import ``trainer`` from the repository root."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore import Run, ShardWriter, WriterOptions, open_run

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[Any]:
    """A local Ray session for a test module (the sharded-policy tests' actors)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    # A short directory: Ray's socket paths must fit in 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="ray-")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=temp_dir,
        logging_level="ERROR",
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


# -- a run and the controller's replay-buffer writer, for the replay-buffer tests -------------


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    opened = open_run(
        "rb", db=f"sqlite:///{tmp_path}/m.db", store=str(tmp_path / "store"), async_save=False
    )
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def shard_writer(run: Run) -> Iterator[ShardWriter]:
    # As the controller does: no packs, so an unchanged group stores the same blobs again.
    with ShardWriter(run.store, options=WriterOptions(pack_threshold=0)) as writer:
        yield writer


@pytest.fixture(params=["components", "receipt"])
def save_load(
    request: pytest.FixtureRequest, run: Run
) -> Iterator[Callable[[int, dict[str, Any]], dict[str, Any]]]:
    """Save a buffer state at a step and load it back, via run.save or a worker's receipt."""
    writer = ShardWriter(run.store, options=WriterOptions(pack_threshold=0))

    def go(step: int, state: dict[str, Any]) -> dict[str, Any]:
        if request.param == "components":
            run.save(step, {"replay_buffer": state})
        else:
            receipt = writer.write("replay_buffer", state, kind="replay_buffer")
            run.save(step, receipts=[receipt])
        loaded = run.load(step).state["replay_buffer"]
        assert isinstance(loaded, dict)
        return loaded

    try:
        yield go
    finally:
        writer.close()
