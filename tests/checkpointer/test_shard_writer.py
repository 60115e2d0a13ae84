"""ShardWriter: a worker's synchronous ``write`` and asynchronous ``save`` (DESIGN.md §7).

Every store here is a real LocalStore; delays and failures come from small subclasses whose
``put`` waits for a gate, sleeps or raises. Receipts are committed by a real run on SQLite and
PostgreSQL (``db_url``) and loaded back bit for bit.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from component_helpers import FlakyStore

from ckptstore.checkpointer import ShardSave, ShardWriter, open_run
from ckptstore.errors import (
    ConfigError,
    ObjectStoreError,
    RunStateError,
    SaveError,
    SerializationError,
)
from ckptstore.objectstore import LocalStore, PutData
from ckptstore.serialize.compare import first_difference

#: float32 elements of one weight: 1.2 MB, above the pack threshold (stored in its own chunks).
NUMEL = 300_000


def shard_state(seed: int) -> dict[str, Any]:
    """A worker's policy and optimizer: large tensors, small tensors and plain values."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "policy": {f"layer{i}.weight": torch.randn(NUMEL, generator=gen) for i in range(2)},
        "optimizer": {
            "exp_avg": torch.randn(64, generator=gen),
            "step": torch.tensor(seed),
            "param_groups": [{"lr": 1e-4 * (seed + 1)}],
        },
    }


def clone(state: Any) -> Any:
    """A deep copy with every tensor cloned."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone(v) for v in state]
    return state


def mutate(state: dict[str, Any]) -> None:
    """What a train step does to the state: every tensor and the optimizer's lr change."""
    for tensor in [*state["policy"].values(), state["optimizer"]["exp_avg"]]:
        tensor.add_(1.0)
    state["optimizer"]["step"].add_(1)
    state["optimizer"]["param_groups"][0]["lr"] = 0.5


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        diff = first_difference(actual[name], value, name)
        assert diff is None, diff


def stored_keys(store: LocalStore) -> list[str]:
    return [info.key for info in store.list("cas/")]


class GatedStore(LocalStore):
    """A real LocalStore whose writes wait until ``gate`` is set."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, fsync=False)
        self.gate = threading.Event()
        self.waiting = threading.Event()  # set once a write is held at the gate

    def put(self, key: str, data: PutData) -> bool:
        self.waiting.set()
        if not self.gate.wait(timeout=60):
            raise ObjectStoreError(f"test gate never opened for {self.url}/{key}")
        return super().put(key, data)


class SlowStore(LocalStore):
    """A real LocalStore whose every write takes at least ``delay`` seconds."""

    def __init__(self, root: Path, delay: float) -> None:
        super().__init__(root, fsync=False)
        self.delay = delay

    def put(self, key: str, data: PutData) -> bool:
        time.sleep(self.delay)
        return super().put(key, data)


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[GatedStore]:
    store = GatedStore(tmp_path / "gated")
    yield store
    store.gate.set()  # never leave a writer thread waiting
    store.close()


@pytest.fixture
def flaky(tmp_path: Path) -> Iterator[FlakyStore]:
    store = FlakyStore(tmp_path / "flaky")
    yield store
    store.close()


# -- asynchronous save ---------------------------------------------------------------------------


def test_save_returns_before_the_upload_and_stores_the_snapshot(
    db_url: str, gated: GatedStore
) -> None:
    state = shard_state(1)
    expected = clone(state)
    with ShardWriter(gated) as writer:
        handle = writer.save(state, kinds={"policy": "policy", "optimizer": "optimizer"})
        assert gated.waiting.wait(timeout=30)  # the upload has started and is held
        assert not handle.done()
        assert stored_keys(gated) == []
        mutate(state)  # training goes on while the upload is held
        gated.gate.set()
        receipts = handle.receipts(timeout=60)
    assert [(r.component, r.kind) for r in receipts] == [
        ("policy", "policy"),
        ("optimizer", "optimizer"),
    ]
    with open_run("async-shards", db=db_url, store=gated) as run:
        info = run.save(1, receipts=receipts).wait()
        assert {(c.name, c.kind) for c in info.components} == {
            ("policy", "policy"),
            ("optimizer", "optimizer"),
        }
        assert_same(run.load(step=1).state, expected)  # the pre-mutation values


def test_receipts_of_several_writers_and_saves_commit_and_load_bit_exact(
    db_url: str, store: LocalStore
) -> None:
    ranks = {rank: shard_state(rank) for rank in (0, 1)}
    writers = {rank: ShardWriter(store) for rank in ranks}
    expected: dict[int, dict[str, Any]] = {}
    try:
        with open_run("shards", db=db_url, store=store) as run:
            for step in (1, 2):
                handles = {
                    rank: writers[rank].save({f"policy/rank{rank}": ranks[rank]["policy"]})
                    for rank in ranks
                }
                expected[step] = {f"policy/rank{r}": clone(s["policy"]) for r, s in ranks.items()}
                expected[step]["meta"] = {"step": step}
                for state in ranks.values():
                    mutate(state)
                receipts = [r for h in handles.values() for r in h.receipts(timeout=60)]
                run.save(step, {"meta": {"step": step}}, receipts=receipts).wait()
            for step, state in expected.items():
                assert_same(run.load(step=step).state, state)
    finally:
        for writer in writers.values():
            writer.close()


def test_receipts_survive_pickling(store: LocalStore) -> None:
    with ShardWriter(store) as writer:
        (receipt,) = writer.save({"policy": shard_state(3)["policy"]}).receipts(timeout=60)
    assert pickle.loads(pickle.dumps(receipt)) == receipt
    assert len(pickle.dumps(receipt)) < 4096  # a receipt names blobs, it carries no tensor data


def test_one_save_in_flight(gated: GatedStore) -> None:
    with ShardWriter(gated) as writer:
        first = writer.save({"policy": shard_state(1)["policy"]})
        assert gated.waiting.wait(timeout=30)
        second: list[ShardSave] = []
        waiter = threading.Thread(
            target=lambda: second.append(writer.save({"policy": shard_state(2)["policy"]}))
        )
        waiter.start()
        waiter.join(timeout=0.3)
        assert waiter.is_alive()  # the next save waits for the one in flight
        assert not first.done()
        gated.gate.set()
        waiter.join(timeout=60)
        assert not waiter.is_alive()
        assert first.done()
        assert len(first.receipts()) == 1
        assert len(second[0].receipts(timeout=60)) == 1
        # A synchronous write also waits for a save in flight before it starts.
        gated.gate.clear()
        gated.waiting.clear()
        third = writer.save({"policy": shard_state(3)["policy"]})
        assert gated.waiting.wait(timeout=30)
        writing = threading.Thread(
            target=lambda: writer.write("optimizer", shard_state(3)["optimizer"])
        )
        writing.start()
        writing.join(timeout=0.3)
        assert writing.is_alive()
        assert not third.done()
        gated.gate.set()
        writing.join(timeout=60)
        assert not writing.is_alive()
        assert third.done()


def test_finalize_returns_the_receipts_of_the_save_in_flight(gated: GatedStore) -> None:
    with ShardWriter(gated) as writer:
        assert writer.finalize() is None
        handle = writer.save({"policy": shard_state(1)["policy"]})
        assert gated.waiting.wait(timeout=30)
        got: list[Any] = []
        finalizing = threading.Thread(target=lambda: got.append(writer.finalize()))
        finalizing.start()
        finalizing.join(timeout=0.3)
        assert finalizing.is_alive()  # finalize waits for the upload
        gated.gate.set()
        finalizing.join(timeout=60)
        (receipts,) = got
        assert receipts is not None
        assert handle.done()
        assert receipts == handle.receipts()
        assert writer.finalize() is None  # nothing in flight any more


# -- failures surface once -----------------------------------------------------------------------


def failed_save(writer: ShardWriter, flaky: FlakyStore) -> ShardSave:
    """A save whose upload fails; returns once it has failed, without reporting it."""
    flaky.failing = True
    handle = writer.save({"policy": shard_state(1)["policy"]})
    deadline = time.monotonic() + 60
    while not handle.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    flaky.failing = False
    return handle


@pytest.mark.parametrize("where", ["save", "write", "finalize"])
def test_a_failed_save_surfaces_once_at_the_next_call(flaky: FlakyStore, where: str) -> None:
    with ShardWriter(flaky) as writer:
        failed_save(writer, flaky)
        calls = {
            "save": lambda: writer.save({"policy": shard_state(2)["policy"]}),
            "write": lambda: writer.write("policy", shard_state(2)["policy"]),
            "finalize": writer.finalize,
        }
        with pytest.raises(SaveError, match=r"\['policy'\].*injected failure") as excinfo:
            calls[where]()
        assert isinstance(excinfo.value.__cause__, ObjectStoreError)
        assert writer.finalize() is None  # reported once, not again
        # The store works again and nothing was left in flight: saving works again.
        (receipt,) = writer.save({"policy": shard_state(2)["policy"]}).receipts(timeout=60)
        assert receipt.result.uploaded_bytes > 0
    # close() (by the with block) had nothing left to report.


def test_a_failed_save_surfaces_at_close(flaky: FlakyStore) -> None:
    writer = ShardWriter(flaky)
    failed_save(writer, flaky)
    with pytest.raises(SaveError, match="injected failure"):
        writer.close()
    writer.close()  # closed; nothing left to report
    with pytest.raises(RunStateError, match="closed"):
        writer.save({"policy": shard_state(2)["policy"]})
    with pytest.raises(RunStateError, match="closed"):
        writer.write("policy", shard_state(2)["policy"])


def test_a_failure_seen_through_receipts_is_not_raised_again(flaky: FlakyStore) -> None:
    with ShardWriter(flaky) as writer:
        handle = failed_save(writer, flaky)
        with pytest.raises(SaveError, match="injected failure"):
            handle.receipts()
        assert writer.finalize() is None
        writer.save({"policy": shard_state(2)["policy"]}).receipts(timeout=60)


def test_a_failed_flush_does_not_mask_the_exception_in_flight(
    flaky: FlakyStore, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(RuntimeError, match="boom") as excinfo, ShardWriter(flaky) as writer:  # noqa: PT012
        failed_save(writer, flaky)
        raise RuntimeError("boom")
    notes = "\n".join(getattr(excinfo.value, "__notes__", []))
    assert "shard save also failed" in notes
    assert "injected failure" in notes
    assert any(r.levelno >= logging.ERROR for r in caplog.records)


def test_receipts_raises_timeout_while_the_upload_runs(gated: GatedStore) -> None:
    with ShardWriter(gated) as writer:
        handle = writer.save({"policy": shard_state(1)["policy"]})
        with pytest.raises(TimeoutError):
            handle.receipts(timeout=0.05)
        gated.gate.set()
        assert len(handle.receipts(timeout=60)) == 1


# -- timings -------------------------------------------------------------------------------------


def test_async_save_timings(tmp_path: Path) -> None:
    delay = 0.5
    store = SlowStore(tmp_path / "slow", delay)
    try:
        with ShardWriter(store) as writer:
            before = time.time()
            handle = writer.save({"policy": shard_state(1)["policy"], "meta": {"x": 1}})
            returned = time.time()
            receipts = handle.receipts(timeout=60)
    finally:
        store.close()
    assert before <= handle.started_at <= returned
    assert 0 < handle.blocked_seconds < delay  # the snapshot only, not the slow upload
    for receipt in receipts:
        assert receipt.started_at == handle.started_at
        assert receipt.blocked_seconds == handle.blocked_seconds
        assert receipt.upload_seconds >= delay  # every component writes at least its index


def test_sync_write_timings(tmp_path: Path) -> None:
    delay = 0.2
    store = SlowStore(tmp_path / "slow", delay)
    try:
        with ShardWriter(store) as writer:
            before = time.time()
            receipt = writer.write("policy", shard_state(1)["policy"], kind="policy")
            after = time.time()
    finally:
        store.close()
    assert before <= (receipt.started_at or 0) <= after
    assert receipt.upload_seconds >= delay
    assert receipt.upload_seconds <= receipt.blocked_seconds <= after - before  # blocked for all
    assert receipt.kind == "policy"


# -- validation, before anything starts ----------------------------------------------------------


@pytest.mark.parametrize(
    ("components", "kinds", "match"),
    [
        ({}, None, "at least one component"),
        ([("policy", {})], None, "must be a mapping"),
        ({"bad name": {}}, None, "invalid component name"),
        ({"policy": {}}, {"policy": "Policy!"}, "invalid component kind"),
        ({"policy": {}}, {"optimizer": "optimizer"}, r"kinds names \['optimizer'\]"),
    ],
)
def test_save_refuses_bad_components(
    store: LocalStore, components: Any, kinds: dict[str, str] | None, match: str
) -> None:
    with ShardWriter(store) as writer:
        with pytest.raises(ConfigError, match=match):
            writer.save(components, kinds=kinds)
        assert writer.finalize() is None  # nothing was started
    assert stored_keys(store) == []


def test_an_unsupported_value_raises_in_save_naming_its_path(store: LocalStore) -> None:
    with ShardWriter(store) as writer:
        with pytest.raises(SerializationError, match="fn: cannot checkpoint"):
            writer.save({"policy": {"w": torch.ones(4), "fn": object()}})
        assert writer.finalize() is None
