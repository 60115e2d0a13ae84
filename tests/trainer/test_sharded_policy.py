"""The policy sharded over N Ray workers (``policy.num_workers``, trainer/sharded.py): FSDP2
ranks that save their own shards through ckptstore's DCP integration, a controller that commits
them, and resumes on another N that reshard the policy bit for bit.

One Ray session serves the module; the controller runs in this process (as the other trainer
tests run it), its policy ranks and rollout workers as Ray actors.
"""

from __future__ import annotations

import asyncio
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
from trainer_helpers import LONG_BUDGET, small_config, train

from ckptstore import open_run
from ckptstore.cas import blob_key
from ckptstore.integrations import dcp as ckpt_dcp
from trainer.policy_state import SHARDED_INFO, is_sharded
from trainer.trace import trained_prompts
from trainer.workers import PolicyWorker

pytestmark = pytest.mark.timeout(600)

SAMPLER = {
    "async_rl__sampler__name": "windowed",
    "async_rl__max_buffered_rollouts": 4,
    "async_rl__max_inflight_prompts": 4,
    "data__train__num_prompts": 12,
    "grpo__max_num_steps": 6,
}


def test_sharded_steps_match_one_worker_and_reshard_bit_for_bit(
    ray_session: Any, tmp_path: Path
) -> None:
    cfg = sharded_config(tmp_path, 2)
    batch = rollout_batch(cfg, groups=3)  # uneven: 2 groups on rank 0, 1 on rank 1

    async def scenario() -> None:
        single = PolicyWorker(cfg, base_weights(cfg), cfg.checkpointing.store)
        group = await start_group(cfg, 2)
        # The same batch on one worker and on two ranks: the same loss and gradient norm
        # (the ranks' losses are weighted by their share of the batch; a wrong weight shows
        # in the norm), up to the order of float sums. Adam ignores a gradient's scale, so
        # the parameters agree within a step's size (lr) whatever the rounding.
        for _ in range(2):
            one = single.train_step(batch)
            two = await group.train_step.remote(batch)
            assert two.tokens == one.tokens
            assert two.loss == pytest.approx(one.loss, rel=1e-4, abs=1e-6)
            assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-3)
        saved = await group.whole_state.remote()
        lr = cfg.policy.lr
        for name, tensor in single.whole_state()["model"].items():
            torch.testing.assert_close(saved["model"][name], tensor, rtol=0, atol=2 * lr)

        # Saved by two ranks (nothing committed by them), committed here with a component of
        # the controller's own, in one transaction.
        await group.snapshot_shards.remote(True)
        receipts = await group.shard_receipts.remote(True)
        assert sorted(r.component for r in receipts) == [
            "dcp/metadata",
            "dcp/rank0",
            "dcp/rank1",
        ]
        with open_run("t", db=cfg.checkpointing.db, store=cfg.checkpointing.store) as run:
            run.save(
                2,
                {"rollout_state": {"step": 2}},
                receipts=receipts,
                training_info={SHARDED_INFO: {"workers": 2, "optimizer": True}},
            ).wait()
            info = run.latest()
            assert info is not None
            assert is_sharded(info)
            plan = ckpt_dcp.plan_load(run, 2)
        await group.close.remote()

        # 2 -> 3 ranks and 2 -> 1 worker: the same bits.
        three = await start_group(cfg, 3)
        await three.load_sharded.remote(plan, True)
        assert_same_state(saved, await three.whole_state.remote())
        await three.close.remote()
        lone = PolicyWorker(cfg, base_weights(cfg), cfg.checkpointing.store)
        lone.load_sharded(plan, True)
        assert_same_state(saved, lone.whole_state())

        # 1 -> 3: a policy saved whole (one worker's "policy"/"optimizer") reshards too.
        lone.train_step(batch)
        whole = lone.whole_state()
        three = await start_group(cfg, 3)
        state = lone.optimizer.state_dict()
        assert await three.load.remote(lone.model.state_dict(), state)
        assert_same_state(whole, await three.whole_state.remote())
        await three.close.remote()

    asyncio.run(scenario())


def _uninterrupted(root: Path) -> dict[int, list[int]]:
    summary, _ = train(
        sharded_config(root, 1, logger__prompt_trace=str(root / "trace.jsonl"), **SAMPLER)
    )
    assert summary["train_steps"] == 6
    return trained_prompts(root / "trace.jsonl")


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param(2, 2, id="2-to-2"),
        pytest.param(2, 1, id="2-to-1", marks=pytest.mark.slow),
        pytest.param(1, 3, id="1-to-3", marks=pytest.mark.slow),
    ],
)
def test_a_resume_on_another_number_of_workers_trains_the_same_prompts(
    ray_session: Any, tmp_path: Path, before: int, after: int
) -> None:
    (tmp_path / "whole").mkdir()
    expected = _uninterrupted(tmp_path / "whole")
    root = tmp_path / "run"
    root.mkdir()
    trace = {"logger__prompt_trace": str(root / "trace.jsonl")}
    budget = {"checkpointing__checkpoint_must_save_by": LONG_BUDGET}
    cut, lines = train(sharded_config(root, before, **trace, **budget, **SAMPLER), budget_stop_at=3)
    assert cut["stopped_early"], lines
    assert cut["train_steps"] == 3, lines
    if before > 1:
        assert any(f"policy sharded over {before} workers" in line for line in lines), lines
    ck = sharded_config(root, after).checkpointing
    with open_run("t", db=ck.db, store=ck.store, writable=False) as run:
        info = run.latest()
        assert info is not None
        assert info.step == 3
        assert is_sharded(info) == (before > 1)
        if before > 1:
            names = {c.name for c in info.components}
            assert {f"dcp/rank{r}" for r in range(before)} <= names
            assert {"replay_buffer", "dataloader", "rollout_state"} <= names
    done, lines = train(sharded_config(root, after, **trace, **SAMPLER))
    assert done["train_steps"] == 6, lines
    assert any(line.startswith("resumed run 't' from step 3:") for line in lines), lines
    got = trained_prompts(root / "trace.jsonl")
    assert list(got) == list(expected)
    for step in expected:
        assert got[step] == expected[step], f"step {step}: {got[step]} != {expected[step]}"
    with open_run("t", db=ck.db, store=ck.store, writable=False) as run:
        final = run.latest()
        assert final is not None
        assert final.step == 6
        assert is_sharded(final) == (after > 1)


def test_more_than_one_worker_needs_ray(tmp_path: Path) -> None:
    from trainer.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"policy\.num_workers=2 .*backend=ray"):
        small_config(tmp_path, backend="local", policy__num_workers=2)


def test_a_damaged_rank_shard_is_marked_corrupt_and_the_resume_falls_back(
    ray_session: Any, tmp_path: Path
) -> None:
    # The policy ranks find the damage as they read (the controller only planned the load):
    # the controller marks the checkpoint corrupt and resumes from the previous one.
    cut, lines = train(sharded_config(tmp_path, 2, grpo__max_num_steps=4))
    assert cut["saved_steps"] == [2, 4], lines
    ck = sharded_config(tmp_path, 2).checkpointing
    with open_run("t", db=ck.db, store=ck.store, writable=False) as run:
        (rank1,) = [c for c in run.checkpoint(4).components if c.name == "dcp/rank1"]
    path = Path(ck.store or "") / blob_key(rank1.index_digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    done, lines = train(sharded_config(tmp_path, 2, grpo__max_num_steps=6))
    assert done["train_steps"] == 6, lines
    warnings = [x for x in lines if x.startswith("warning: checkpoint step 4")]
    assert len(warnings) == 1, lines
    assert any(x.startswith("resumed run 't' from step 2") for x in lines), lines
    with open_run("t", db=ck.db, store=ck.store, writable=False) as run:
        statuses = [(c.step, c.status) for c in run.checkpoints()]
    assert (2, "committed") in statuses
    assert (6, "committed") in statuses
    assert (4, "committed") in statuses  # trained again and saved anew
    assert len([s for s in statuses if s[0] == 4]) == 2  # the damaged one stays in history
