"""The stale-weights guard of the integration wrappers (``expect_changed``): a save whose rank
components hold the same bytes as the previous committed checkpoint's is logged as a WARNING
and recorded in ``training_info["stale_components"]`` -- ``Run.save``'s own guard, reached
through ``ckpt_dcp.save`` (sync and async, one process and two gloo ranks) and
``ckpt_megatron.save``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lazy_imports import deferred

import ckptstore
from ckptstore.checkpointer import Run
from ckptstore.errors import SaveError
from ckptstore.integrations import dcp as ckpt_dcp

mcore = deferred("ckptstore.integrations.megatron")
ShardedTensor = deferred("megatron.core.dist_checkpointing", "ShardedTensor")

STALE = "STALE CHECKPOINT"


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    with ckptstore.open_run("stale", db=tmp_path / "m.db", store=tmp_path / "store") as opened:
        yield opened


def weights(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(32, 16, generator=gen), "b": torch.randn(16, generator=gen)},
        "step_count": seed,
    }


def committed(result: Any) -> ckptstore.CheckpointInfo:
    """The checkpoint a (sync or async) ``ckpt_dcp.save`` committed in this process."""
    info = result.result() if isinstance(result, Future) else result
    assert info is not None
    return info


def stale_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if STALE in r.getMessage()]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_dcp_save_of_unchanged_state_is_flagged(
    run: Run, caplog: pytest.LogCaptureFixture, async_save: bool
) -> None:
    caplog.set_level(logging.WARNING, logger="ckptstore.checkpointer")
    first = ckpt_dcp.save(weights(1), run, 1, expect_changed=True, async_save=async_save)
    assert "stale_components" not in (committed(first).training_info or {})
    again = ckpt_dcp.save(
        weights(1),
        run,
        2,
        expect_changed=True,
        async_save=async_save,
        training_info={"current_step": 2},
    )
    info = committed(again)
    assert info.training_info == {"current_step": 2, "stale_components": ["dcp/rank0"]}
    (message,) = stale_warnings(caplog)
    assert "'dcp/rank0'" in message
    assert "step 2" in message
    assert "step 1" in message
    # The flag is in the manifest, for resume and for `ckptstore show` alike.
    latest = run.latest()
    assert latest is not None
    assert latest.training_info == info.training_info


def test_a_dcp_save_of_changed_state_is_not_flagged(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ckptstore.checkpointer")
    ckpt_dcp.save(weights(1), run, 1, expect_changed=True)
    info = committed(ckpt_dcp.save(weights(2), run, 2, expect_changed=True))
    assert info.training_info is None
    assert stale_warnings(caplog) == []


def test_without_expect_changed_an_unchanged_dcp_save_is_not_flagged(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ckptstore.checkpointer")
    ckpt_dcp.save(weights(1), run, 1)
    info = committed(ckpt_dcp.save(weights(1), run, 2))
    assert info.training_info is None
    assert stale_warnings(caplog) == []


def test_stale_compares_with_the_newest_earlier_committed_dcp_step(run: Run) -> None:
    ckpt_dcp.save(weights(1), run, 1)
    ckpt_dcp.save(weights(2), run, 3)
    # Step 2 is saved after step 3, with step 1's weights: compared with step 1, it is stale.
    info = committed(ckpt_dcp.save(weights(1), run, 2, expect_changed=True))
    assert info.training_info == {"stale_components": ["dcp/rank0"]}


def test_a_failed_dcp_save_flags_nothing_and_commits_nothing(run: Run) -> None:
    ckpt_dcp.save(weights(1), run, 1)
    with pytest.raises(SaveError):
        ckpt_dcp.save({"bad": object()}, run, 2, expect_changed=True)
    assert [c.step for c in run.checkpoints()] == [1]


# -- two gloo ranks -------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import ckptstore
    from ckptstore.integrations import dcp as ckpt_dcp

    rank, rendezvous, db, store, out = int(sys.argv[1]), *sys.argv[2:]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    writer = ckptstore.open_run("stale2", db=db, store=store) if rank == 0 else None
    dist.barrier()
    run = writer or ckptstore.open_run("stale2", db=db, store=store, writable=False)

    def state(full):
        return {"w": distribute_tensor(full, mesh, [Shard(0)])}

    full = torch.arange(64.0).reshape(8, 8)
    infos = [ckpt_dcp.save(state(full), run, 1, expect_changed=True)]
    infos.append(ckpt_dcp.save(state(full), run, 2, expect_changed=True))
    changed = full.clone()
    changed[-1] += 1  # a row of rank 1's shard only
    infos.append(ckpt_dcp.save(state(changed), run, 3, expect_changed=True))
    if rank == 0:
        with open(out, "w") as f:
            json.dump([i.training_info for i in infos], f)
    run.close()
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_two_ranks_flag_each_rank_whose_shard_did_not_change(tmp_path: Path) -> None:
    out = tmp_path / "infos.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    args = [str(tmp_path / "rdv"), str(tmp_path / "m.db"), str(tmp_path / "store"), str(out)]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(rank), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in ranks:
            outputs.append(proc.communicate(timeout=240)[0].decode(errors="replace"))
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, text) in enumerate(zip(ranks, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{text[-4000:]}"
    infos = json.loads(out.read_text())
    assert infos == [
        None,
        {"stale_components": ["dcp/rank0", "dcp/rank1"]},
        {"stale_components": ["dcp/rank0"]},
    ]
    assert "STALE CHECKPOINT" in outputs[0]


# -- Megatron -------------------------------------------------------------------------------


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_megatron_save_of_unchanged_shards_is_flagged(
    run: Run, world_of_one: None, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("megatron.core")
    caplog.set_level(logging.WARNING, logger="ckptstore.checkpointer")

    def sharded(seed: int) -> dict[str, Any]:
        tensor = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
        return {"w": ShardedTensor.from_rank_offsets("w", tensor)}

    mcore.save(sharded(1), run, 1, expect_changed=True)
    mcore.save(sharded(1), run, 2, expect_changed=True)
    mcore.save(sharded(2), run, 3, expect_changed=True)
    infos = {c.step: c.training_info for c in run.checkpoints()}
    assert infos == {1: None, 2: {"stale_components": ["megatron/rank0"]}, 3: None}
    (message,) = stale_warnings(caplog)
    assert "'megatron/rank0'" in message
