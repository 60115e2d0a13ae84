"""Data-parallel replicas of the sharded policy (``policy.replicas``, issue 43): 4 policy
workers as 2 replicas of 2 FSDP2 shards (HSDP). They train as one policy, a save stores one
copy of the shards (DCP writes each replicated item from one rank), and a load -- a resume's
included -- reads each stored blob from the object store once: one rank reads it and sends it
to the ranks of the other replica (``ckpt_dcp.load``'s read-once), counted by every rank
(``load_sharded``'s ``"store"`` bytes).

One Ray session serves the module; the controller runs in this process (as the other trainer
tests run it), its policy ranks and rollout workers as Ray actors.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sharded_helpers import (
    assert_same_state,
    base_weights,
    rollout_batch,
    sharded_config,
    start_group,
)
from trainer_helpers import LONG_BUDGET, train

from ckptstore import CheckpointInfo, open_run
from ckptstore.cas import blob_key
from ckptstore.extending import open_store
from ckptstore.integrations import dcp as ckpt_dcp
from ckptstore.serialize import read_index
from trainer.config import TrainerConfig
from trainer.controller import Controller
from trainer.policy_state import SHARDED_INFO
from trainer.sharded import PolicyGroup
from trainer.trace import trained_prompts
from trainer.workers import PolicyWorker

pytestmark = pytest.mark.timeout(900)

WORKERS, REPLICAS = 4, 2


def _stored(store: Path, info: CheckpointInfo) -> tuple[int, int, int]:
    """The policy's bytes in ``store``, sized from its directory: (its data blobs, the index
    objects of its DCP components, the metadata component's index object)."""
    data: set[str] = set()
    indexes: dict[str, int] = {}
    with open_store(str(store), create=False) as opened:
        for component in info.components:
            if component.name.startswith("dcp/"):
                key = blob_key(component.index_digest)
                indexes[component.name] = (store / key).stat().st_size
                for entry in read_index(opened, component.index_digest).entries:
                    data.update(blob_key(seg.digest) for seg in entry.segments)
    data_bytes = sum((store / key).stat().st_size for key in data)
    return data_bytes, sum(indexes.values()), indexes[ckpt_dcp.METADATA_COMPONENT]


async def _save(group: PolicyGroup, cfg: TrainerConfig, step: int) -> CheckpointInfo:
    """The group's shards, saved by its ranks and committed here at ``step``."""
    await group.snapshot_shards.remote(True)
    receipts = await group.shard_receipts.remote(True)
    sharding = {"workers": len(group.ranks), "optimizer": True}
    ck = cfg.checkpointing
    with open_run("t", db=ck.db, store=ck.store) as run:
        run.save(step, {}, receipts=receipts, training_info={SHARDED_INFO: sharding}).wait()
        info = run.checkpoint(step)
    assert info is not None
    return info


def _plan(cfg: TrainerConfig, step: int) -> ckpt_dcp.LoadPlan:
    ck = cfg.checkpointing
    with open_run("t", db=ck.db, store=ck.store, writable=False) as run:
        return ckpt_dcp.plan_load(run, step)


@pytest.mark.slow  # 4 Ray actors, ~60 s on 2 cores: make test-slow (CI's headroom is ~8 min)
def test_replicas_train_as_one_policy_save_one_copy_and_load_each_blob_once(
    ray_session: Any, tmp_path: Path
) -> None:
    cfg = sharded_config(tmp_path, WORKERS, REPLICAS)
    store = Path(cfg.checkpointing.store or "")
    batch = rollout_batch(cfg, groups=3)  # uneven: one group on each of ranks 0-2, none on rank 3

    async def scenario() -> None:
        single = PolicyWorker(cfg, base_weights(cfg), cfg.checkpointing.store)
        group = await start_group(cfg, WORKERS, REPLICAS)
        # The same batch on one worker and on 2 x 2 ranks: HSDP averages the gradients over
        # all four ranks, as FSDP2 over four shards does, so the same loss and gradient norm
        # up to the order of float sums (reduce-scatter within a replica, then all-reduce
        # across replicas: not the one worker's order, so not bit for bit). Adam ignores a
        # gradient's scale: the parameters agree within a step's size (lr).
        for _ in range(2):
            one = single.train_step(batch)
            got = await group.train_step.remote(batch)
            assert got.tokens == one.tokens
            assert got.loss == pytest.approx(one.loss, rel=1e-4, abs=1e-6)
            assert got.grad_norm == pytest.approx(one.grad_norm, rel=1e-3)
        saved = await group.whole_state.remote()
        for name, tensor in single.whole_state()["model"].items():
            torch.testing.assert_close(saved["model"][name], tensor, rtol=0, atol=2 * cfg.policy.lr)
        two_replicas = await _save(group, cfg, 2)

        # The same state saved by one replica (2 shards): the replicas stored one copy.
        lone = await start_group(cfg, 2, 1)
        alone = await lone.load_sharded.remote(_plan(cfg, 2), True)
        assert_same_state(saved, await lone.whole_state.remote())
        one_replica = await _save(lone, cfg, 3)
        await lone.close.remote()
        data, indexes, metadata = _stored(store, two_replicas)
        assert data == pytest.approx(_stored(store, one_replica)[0], rel=0.05)

        # Loaded by the 2 x 2 ranks (after a step that changed their state): bit for bit,
        # and each data blob read from the store once. Every rank reads the metadata and the
        # indexes it needs itself (small): a second replica's copy of the data would break
        # the upper bound. One replica alone (its ranks read a blob both need -- a pack of
        # small tensors -- each, as a local store does by default) reads no less.
        await group.train_step.remote(batch)
        read = await group.load_sharded.remote(_plan(cfg, 2), True)
        assert_same_state(saved, await group.whole_state.remote())
        # The copy one replica saved (another layout) loads into the replicas as well.
        await group.train_step.remote(batch)
        await group.load_sharded.remote(_plan(cfg, 3), True)
        assert_same_state(saved, await group.whole_state.remote())
        await group.close.remote()
        assert WORKERS * indexes < data, "the bound below must fail on a second replica's read"
        assert data + WORKERS * metadata <= read["store"] <= data + WORKERS * indexes
        assert data + 2 * metadata <= alone["store"]
        assert read["store"] <= alone["store"] + (WORKERS - 2) * indexes

    asyncio.run(scenario())


SAMPLER = {
    "async_rl__sampler__name": "windowed",
    "async_rl__max_buffered_rollouts": 4,
    "async_rl__max_inflight_prompts": 4,
    "data__train__num_prompts": 12,
    "grpo__max_num_steps": 6,
}


@pytest.mark.slow
def test_a_resume_of_replicas_reads_one_copy_from_the_store_and_trains_the_same_prompts(
    ray_session: Any, tmp_path: Path
) -> None:
    whole = tmp_path / "whole"
    whole.mkdir()
    uninterrupted, _ = train(
        sharded_config(whole, 1, 1, logger__prompt_trace=str(whole / "trace.jsonl"), **SAMPLER)
    )
    assert uninterrupted["train_steps"] == 6
    expected = trained_prompts(whole / "trace.jsonl")

    root = tmp_path / "run"
    root.mkdir()
    trace = {"logger__prompt_trace": str(root / "trace.jsonl")}
    budget = {"checkpointing__checkpoint_must_save_by": LONG_BUDGET}
    cfg = sharded_config(root, WORKERS, REPLICAS, **trace, **budget, **SAMPLER)
    cut, lines = train(cfg, budget_stop_at=3)
    assert cut["stopped_early"], lines
    assert cut["train_steps"] == 3, lines
    ck = cfg.checkpointing
    with open_run("t", db=ck.db, store=ck.store, writable=False) as run:
        info = run.latest()
    assert info is not None
    assert info.step == 3
    data, indexes, metadata = _stored(Path(ck.store or ""), info)

    # The resume: 4 ranks load the step-3 policy and optimizer; the store serves its data
    # blobs once (plus each rank's own metadata and index reads, small).
    controller = Controller(
        sharded_config(root, WORKERS, REPLICAS, **trace, **SAMPLER), time.time()
    )
    done = asyncio.run(controller.run_training())
    lines = controller.drain()
    assert done["train_steps"] == 6, lines
    assert any(line.startswith("resumed run 't' from step 3:") for line in lines), lines
    read = controller.policy.last_read["store"]
    assert WORKERS * indexes < data, "the bound below must fail on a second replica's read"
    assert data + WORKERS * metadata <= read <= data + WORKERS * indexes

    # ...and it goes on as the run that was never stopped: the same prompts at every step.
    got = trained_prompts(root / "trace.jsonl")
    assert list(got) == list(expected)
    for step in expected:
        assert got[step] == expected[step], f"step {step}: {got[step]} != {expected[step]}"
