"""PyTorch Lightning's ``CheckpointIO`` on ckptstore, driven by a real Trainer on the CPU:
every checkpoint is a committed manifest row, ``ckpt_path="last"`` resumes by query and ends
bit-identical to an uninterrupted run, ``ModelCheckpoint``'s top-k removals mark checkpoints
deleted (GC alone reclaims their blobs), and nothing stored or planted is ever unpickled."""

from __future__ import annotations

import datetime as dt
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_helpers import (
    STEPS_PER_EPOCH,
    assert_same_training_state,
    fit,
    plugin,
)

import ckptstore
from ckptstore.cas.digest import blob_key
from ckptstore.errors import (
    CheckpointNotFoundError,
    ConfigError,
    ObjectNotFoundError,
    SerializationError,
)
from ckptstore.maintenance.gc import collect_garbage
from ckptstore.manifest import Database
from ckptstore.objectstore import LocalStore

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"
    ),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
]


@pytest.fixture(autouse=True)
def _deterministic_algorithms_restored() -> Any:
    """``Trainer(deterministic=True)`` turns on ``torch.use_deterministic_algorithms`` for the
    whole process and leaves it on: later tests (the dtype round trips) would then fail on
    torch ops with no deterministic version. Each test here puts it back as it found it."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def status_by_name(root: Path) -> dict[str, tuple[int, str]]:
    """Each Lightning name -> (step, status) of the newest row listing it."""
    with ckptstore.open_run(
        "tiny", db=f"sqlite:///{root}/manifest.db", writable=False, store=str(root / "store")
    ) as run:
        found: dict[str, tuple[int, str]] = {}
        for info in sorted(run.checkpoints(), key=lambda c: c.id):
            for name in (info.training_info or {}).get("lightning", {}).get("names", []):
                found[name] = (info.step, info.status)
        return found


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_stop_and_resume_from_last_equals_an_uninterrupted_run(
    tmp_path: Path, async_save: bool
) -> None:
    _, straight = fit(4, plugin(tmp_path / "a", async_save=async_save), tmp_path / "a" / "ckpt")

    root, ckpt_dir = tmp_path / "b", tmp_path / "b" / "ckpt"
    _, first = fit(2, plugin(root, async_save=async_save), ckpt_dir)
    assert first.global_step == 2 * STEPS_PER_EPOCH
    _, resumed = fit(4, plugin(root, async_save=async_save), ckpt_dir, ckpt_path="last")

    assert resumed.ckpt_path == str(ckpt_dir / "last.ckpt")
    assert_same_training_state(straight, resumed)
    # Top-2 by train_loss (which falls every epoch) plus last: epochs 0 and 1 were removed
    # by ModelCheckpoint, as committed rows marked deleted; their pointers are gone too.
    names = status_by_name(root)
    assert names == {
        "epoch=0-step=4.ckpt": (4, "deleted"),
        "epoch=1-step=8.ckpt": (8, "deleted"),
        "epoch=2-step=12.ckpt": (12, "committed"),
        "epoch=3-step=16.ckpt": (16, "committed"),
        "last.ckpt": (16, "committed"),
    }
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [
        "epoch=2-step=12.ckpt",
        "epoch=3-step=16.ckpt",
        "last.ckpt",
    ]


def test_top_k_removal_goes_through_retention_and_gc(tmp_path: Path) -> None:
    root, ckpt_dir = tmp_path, tmp_path / "ckpt"
    io = plugin(root)
    fit(3, io, ckpt_dir)
    db = Database(f"sqlite:///{root}/manifest.db")
    store = LocalStore(root / "store", fsync=False)
    try:
        with ckptstore.open_run("tiny", db=db, store=store, writable=False) as run:
            rows = run.checkpoints()
            removed = [c for c in rows if c.step == 4]
            assert [c.status for c in removed] == ["deleted", "deleted"]  # superseded, then removed
            index = next(c for c in removed[-1].components if c.name == "trainer").index_digest
            # Removed: no longer listed as committed nor loadable by name...
            assert 4 not in [c.step for c in run.checkpoints(["committed"])]
            with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint saved as"):
                io.load_checkpoint(ckpt_dir / "epoch=0-step=4.ckpt")
        # ... but its blobs stay until GC reclaims them.
        store.head(blob_key(index))  # raises ObjectNotFoundError if it were gone
        collect_garbage(db, store, grace=dt.timedelta(0))
        collect_garbage(db, store, grace=dt.timedelta(0))
        with pytest.raises(ObjectNotFoundError):
            store.head(blob_key(index))
    finally:
        db.close()
        store.close()
    kept = io.load_checkpoint(ckpt_dir / "epoch=2-step=12.ckpt")
    assert kept["global_step"] == 12
    assert kept["epoch"] == 2
    io.teardown()


class CreatesMarker:
    """Unpickling this creates the marker file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_checkpoint_file_is_never_read(tmp_path: Path) -> None:
    root, ckpt_dir = tmp_path, tmp_path / "ckpt"
    _, straight = fit(2, plugin(root), ckpt_dir)
    marker = tmp_path / "pwned"
    # Someone replaces last.ckpt (and adds another .ckpt) with a pickle that runs code.
    for name in ("last.ckpt", "evil.ckpt"):
        (ckpt_dir / name).unlink(missing_ok=True)
        torch.save({"state_dict": CreatesMarker(marker)}, ckpt_dir / name)
    _, resumed = fit(2, plugin(root), ckpt_dir, ckpt_path="last")  # loads step 8 by query
    assert resumed.global_step == straight.global_step == 8
    assert_same_training_state(straight, resumed)
    with pytest.raises(CheckpointNotFoundError, match="never read"):
        fit(3, plugin(root), ckpt_dir, ckpt_path=str(ckpt_dir / "evil.ckpt"))
    assert not marker.exists()


def test_pickled_bytes_committed_into_a_checkpoint_are_refused_on_load(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    io = plugin(tmp_path)
    checkpoint = {
        "epoch": 0,
        "global_step": 3,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": {"w": torch.ones(2)},
        "hyper_parameters": {"lr": 0.1},
    }
    io.save_checkpoint(checkpoint, tmp_path / "ckpt" / "last.ckpt")
    io.teardown()
    # Other code with commit rights stores pickled bytes where Lightning keeps plain values.
    with ckptstore.open_run(
        "tiny", db=f"sqlite:///{tmp_path}/manifest.db", store=str(tmp_path / "store")
    ) as run:
        trainer_state = {
            **checkpoint,
            "hyper_parameters": {"lr": pickle.dumps(CreatesMarker(marker))},
        }
        del trainer_state["state_dict"]
        run.save(
            3,
            {"model": {"w": torch.ones(2)}, "trainer": trainer_state},
            training_info={"lightning": {"names": ["last.ckpt"]}},
        )
    with pytest.raises(
        SerializationError, match=r"hyper_parameters/lr: .* bytes \(pickled data\?\)"
    ):
        plugin(tmp_path).load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert not marker.exists()


def test_an_unstorable_hyperparameter_fails_the_save_naming_it(tmp_path: Path) -> None:
    with pytest.raises(
        SerializationError, match=r"hyper_parameters/data_dir: a PosixPath .*ignore="
    ):
        fit(1, plugin(tmp_path), tmp_path / "ckpt", data_dir=tmp_path)
    # Refused before anything was opened or uploaded: no manifest, no store, no pointer file.
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_lightnings_async_checkpoint_io_around_the_plugin(tmp_path: Path) -> None:
    _, straight = fit(3, plugin(tmp_path / "a"), tmp_path / "a" / "ckpt")
    root, ckpt_dir = tmp_path / "b", tmp_path / "b" / "ckpt"
    fit(2, AsyncCheckpointIO(plugin(root, async_save=False)), ckpt_dir)
    _, resumed = fit(
        3, AsyncCheckpointIO(plugin(root, async_save=False)), ckpt_dir, ckpt_path="last"
    )
    assert_same_training_state(straight, resumed)
    assert status_by_name(root)["last.ckpt"] == (12, "committed")


def test_bad_arguments_are_refused_with_the_fix(tmp_path: Path) -> None:
    io = plugin(tmp_path)
    state = {"global_step": 1, "state_dict": {"w": torch.zeros(1)}}
    with pytest.raises(ConfigError, match="takes none; configure the store"):
        io.save_checkpoint(state, tmp_path / "x.ckpt", storage_options={"a": 1})
    with pytest.raises(ConfigError, match="local dirpath"):
        io.save_checkpoint(state, "s3://bucket/x.ckpt")
    with pytest.raises(ConfigError, match="step must be an integer"):
        io.save_checkpoint({"state_dict": {}}, tmp_path / "x.ckpt")
    io.save_checkpoint(state, tmp_path / "x.ckpt")
    with pytest.raises(ConfigError, match=r"map_location=.*pass None, 'cpu' or a torch.device"):
        io.load_checkpoint(tmp_path / "x.ckpt", map_location=lambda s, _: s)
    loaded = io.load_checkpoint(tmp_path / "x.ckpt", map_location="cpu")
    assert torch.equal(loaded["state_dict"]["w"], torch.zeros(1))
    io.teardown()
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint to resume from"):
        plugin(tmp_path / "empty").run.close() or plugin(tmp_path / "empty").load_checkpoint(
            tmp_path / "last.ckpt"
        )
