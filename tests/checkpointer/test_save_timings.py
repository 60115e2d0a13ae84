"""What a committed row says about its save: the true blocked and save seconds of every
participant (DESIGN.md §9.6), and the stale-weights guard (``expect_changed``).

Receipts come from real ShardWriters; a receipt's timing fields are moved with
``dataclasses.replace`` where a test needs a participant that started earlier or was blocked
longer than this process can arrange quickly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import pytest
import torch

from ckptstore.checkpointer import Run, ShardReceipt, ShardWriter, open_run
from ckptstore.errors import ConfigError
from ckptstore.objectstore import LocalStore


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(50_000, generator=gen), "b": torch.randn(16, generator=gen)}


def receipt(store: LocalStore, component: str, seed: int, **timing: Any) -> ShardReceipt:
    """A real receipt for ``component``, its timing fields replaced by ``timing``."""
    with ShardWriter(store) as writer:
        (made,) = writer.save({component: weights(seed)}).receipts(timeout=60)
    return dataclasses.replace(made, **timing)


@pytest.fixture
def run(db_url: str, store: LocalStore) -> Any:
    with open_run("timings", db=db_url, store=store) as opened:
        yield opened


# -- blocked seconds -------------------------------------------------------------------------------


def test_blocked_is_the_longest_receipt_when_workers_blocked_longest(
    run: Run, store: LocalStore
) -> None:
    receipts = [
        receipt(store, "policy/rank0", 0, blocked_seconds=2.0),
        receipt(store, "policy/rank1", 1, blocked_seconds=3.0),
    ]
    handle = run.save(1, {"meta": {"step": 1}}, receipts=receipts, blocked_seconds=0.5)
    info = handle.wait()
    assert handle.blocked_seconds == 3.0
    assert info.blocked_seconds == 3.0


def test_blocked_adds_the_callers_time_when_the_caller_blocked_longest(
    run: Run, store: LocalStore
) -> None:
    receipts = [receipt(store, "policy", 0, blocked_seconds=3.0)]
    handle = run.save(1, {"meta": {"step": 1}}, receipts=receipts, blocked_seconds=7.0)
    info = handle.wait()
    assert 7.0 < handle.blocked_seconds < 7.0 + 5.0  # 7 s elsewhere + this call's snapshot
    assert info.blocked_seconds == handle.blocked_seconds


def test_blocked_without_receipts_is_this_calls_snapshot(run: Run) -> None:
    handle = run.save(1, {"policy": weights(0)})
    info = handle.wait()
    assert 0 < handle.blocked_seconds < 5.0
    assert info.blocked_seconds == handle.blocked_seconds


# -- save seconds ----------------------------------------------------------------------------------


def test_save_seconds_run_from_the_earliest_receipt(run: Run, store: LocalStore) -> None:
    now = time.time()
    receipts = [
        receipt(store, "policy/rank0", 0, started_at=now - 100.0),
        receipt(store, "policy/rank1", 1, started_at=now - 40.0),
    ]
    info = run.save(1, receipts=receipts, started_at=now - 60.0).wait()
    assert info.save_seconds is not None
    assert 100.0 <= info.save_seconds < 100.0 + 30.0


def test_save_seconds_run_from_the_callers_started_at(run: Run, store: LocalStore) -> None:
    now = time.time()
    receipts = [receipt(store, "policy", 0, started_at=now - 40.0)]
    info = run.save(1, {"meta": {}}, receipts=receipts, started_at=now - 60.0).wait()
    assert info.save_seconds is not None
    assert 60.0 <= info.save_seconds < 60.0 + 30.0


def test_save_seconds_include_a_workers_upload_before_the_call(run: Run, store: LocalStore) -> None:
    with ShardWriter(store) as writer:
        pending = writer.save({"policy": weights(0)})
        time.sleep(0.3)  # the worker's save started well before the controller commits it
        receipts = pending.receipts(timeout=60)
    info = run.save(1, receipts=receipts).wait()
    assert info.save_seconds is not None
    assert info.save_seconds >= 0.3


def test_save_seconds_without_earlier_starts_are_this_save(run: Run) -> None:
    info = run.save(1, {"policy": weights(0)}).wait()
    assert info.save_seconds is not None
    assert 0 < info.save_seconds < 30.0


@pytest.mark.parametrize(
    ("timing", "match"),
    [
        ({"blocked_seconds": -1.0}, "blocked_seconds=-1.0 must be"),
        ({"blocked_seconds": math.inf}, "blocked_seconds=inf must be"),
        ({"started_at": math.nan}, "started_at=nan must be"),
    ],
)
def test_bad_timings_are_refused_before_anything_starts(
    run: Run, timing: dict[str, float], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        run.save(1, {"policy": weights(0)}, **timing)
    assert run.checkpoints() == []


# -- stale components ------------------------------------------------------------------------------


def test_a_changed_component_is_not_flagged(run: Run, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ckptstore.checkpointer"):
        run.save(1, {"policy": weights(1)}, expect_changed=["policy"]).wait()  # nothing before
        info = run.save(
            2, {"policy": weights(2)}, training_info={"step": 2}, expect_changed=["policy"]
        ).wait()
    assert info.training_info == {"step": 2}
    assert "STALE" not in caplog.text


def test_an_unchanged_component_is_flagged_and_logged(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    same = weights(1)
    run.save(4, {"policy": same, "optimizer": {"lr": 1.0}}).wait()
    with caplog.at_level(logging.WARNING, logger="ckptstore.checkpointer"):
        info = run.save(
            6, {"policy": same, "optimizer": {"lr": 0.5}}, expect_changed=["policy", "optimizer"]
        ).wait()
    assert info.training_info == {"stale_components": ["policy"]}
    (record,) = [r for r in caplog.records if "STALE" in r.getMessage()]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "step 6" in message
    assert "'policy'" in message
    assert "step 4" in message
    # The flag is in the committed row: resume and the CLI read it from there.
    latest = run.latest()
    assert latest is not None
    assert latest.training_info == {"stale_components": ["policy"]}


def test_stale_is_added_to_the_callers_training_info(run: Run, store: LocalStore) -> None:
    run.save(1, receipts=[receipt(store, "policy", 7)]).wait()
    info = run.save(
        2,
        receipts=[receipt(store, "policy", 7)],  # a worker that uploaded the old weights again
        training_info={"current_step": 2},
        expect_changed=["policy"],
    ).wait()
    assert info.training_info == {"current_step": 2, "stale_components": ["policy"]}


def test_only_named_components_are_checked(run: Run) -> None:
    run.save(1, {"policy": weights(1), "dataloader": {"pos": 0}}).wait()
    info = run.save(2, {"policy": weights(2), "dataloader": {"pos": 0}}, expect_changed=["policy"])
    assert info.wait().training_info is None


def test_stale_compares_with_the_newest_earlier_committed_step(run: Run) -> None:
    run.save(1, {"policy": weights(1)}).wait()
    run.save(3, {"policy": weights(3)}).wait()
    # A re-save of step 2 compares with step 1 (the newest *earlier* step), not with step 3.
    info = run.save(2, {"policy": weights(1)}, expect_changed=["policy"]).wait()
    assert info.training_info == {"stale_components": ["policy"]}
    info = run.save(4, {"policy": weights(1)}, expect_changed=["policy"]).wait()
    assert info.training_info is None  # step 3 held other weights


def test_a_component_new_in_this_save_is_not_stale(run: Run) -> None:
    run.save(1, {"policy": weights(1)}).wait()
    info = run.save(2, {"policy": weights(2), "critic": weights(1)}, expect_changed=["critic"])
    assert info.wait().training_info is None


@pytest.mark.parametrize(
    ("expect_changed", "match"),
    [
        (["critic"], r"expect_changed names \['critic'\]"),
        ("policy", "not one string"),
    ],
)
def test_expect_changed_must_name_components_of_the_save(
    run: Run, expect_changed: Any, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        run.save(1, {"policy": weights(1)}, expect_changed=expect_changed)
    assert run.checkpoints() == []


def test_a_synchronous_save_counts_the_uploads_and_commit_its_caller_waits_for(
    db_url: str, store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With async_save=False the caller is blocked until the commit: the flush before the
    commit (slowed here to 0.4 s) is blocked time, in the row and on the handle."""
    real_flush = store.flush

    def slow_flush() -> None:
        time.sleep(0.4)
        real_flush()

    monkeypatch.setattr(store, "flush", slow_flush)
    with open_run("sync", db=db_url, store=store, async_save=False) as run:
        handle = run.save(1, {"policy": weights(1)}, blocked_seconds=0.25)
        info = handle.wait()
    assert info.blocked_seconds >= 0.4 + 0.25
    assert handle.blocked_seconds >= info.blocked_seconds
