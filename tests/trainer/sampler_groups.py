"""Replay-buffer groups and sampler options for the sampler tests."""

from __future__ import annotations

from typing import Any

from trainer.config import SamplerConfig
from trainer.replay import Group


def opts(**options: Any) -> SamplerConfig:
    """``async_rl.sampler`` with a window of 1 and a staleness of 1 unless given."""
    return SamplerConfig(**{"max_staleness_versions": 1, "gate_window": 1, **options})


def grp(
    group_id: int,
    start_weight: int,
    *,
    dispatch_index: int = 0,
    target_step: int | None = None,
    ready: bool = True,
) -> Group:
    return Group(
        group_id=group_id,
        prompt_id=group_id,
        dispatch_index=dispatch_index,
        start_weight=start_weight,
        target_step=target_step,
        end_weight=start_weight if ready else -1,
        ready=ready,
    )


def ids(groups: list[Group]) -> list[int]:
    return [g.group_id for g in groups]
