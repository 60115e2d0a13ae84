"""Replay-buffer groups, payloads and checks shared by the replay-buffer tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from trainer.replay import Group, ReplayBuffer, Rollout

G = 4  # samples per group (grpo.num_generations_per_prompt)

#: Save a buffer state at a step and load it back (the ``save_load`` fixture).
SaveLoad = Callable[[int, dict[str, Any]], dict[str, Any]]


def make_payload(seed: int, rows: int = G, width: int = 6) -> TensorDict:
    """Mixed dtypes, special float values and a non-contiguous view field."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.randn(rows, width, generator=gen)
    logp[0, :3] = torch.tensor([float("nan"), -0.0, float("-inf")])
    wide = torch.randn(rows, 2 * width, generator=gen)
    td = TensorDict(
        {
            "tokens": torch.randint(-(2**62), 2**62, (rows, width), generator=gen),
            "logp": logp,
            "x": wide[:, ::2],
            "mask": torch.rand(rows, width, generator=gen) > 0.5,
        },
        batch_size=[rows],
    )
    assert not td["x"].is_contiguous()
    assert td["tokens"].dtype == torch.int64
    assert td["logp"].dtype == torch.float32
    return td


def sample_ids_of(group_id: int) -> list[int]:
    return [group_id * 100 + j for j in range(G)]


def add_group(
    buf: ReplayBuffer,
    group_id: int,
    *,
    start_weight: int = 0,
    end_weight: int | None = None,
    target_step: int | None = None,
    dispatch_index: int | None = None,
    commit: bool = True,
    payload: TensorDict | None = None,
) -> Group:
    """reserve() and (unless ``commit=False``) commit() one group through the real path."""
    group = buf.reserve(
        group_id,
        prompt_id=1000 + group_id,
        dispatch_index=group_id if dispatch_index is None else dispatch_index,
        start_weight=start_weight,
        target_step=target_step,
    )
    if commit:
        done = Rollout(
            group_id=group_id,
            sample_ids=sample_ids_of(group_id),
            seq_lens=[group_id + j + 1 for j in range(G)],
            weight_versions=[start_weight + (j % 2) for j in range(G)],
            payload=make_payload(group_id) if payload is None else payload,
        )
        buf.commit(done, end_weight=start_weight + 1 if end_weight is None else end_weight)
    return group


def rollout(group_id: int = 2, rows: int = G, **over: Any) -> Rollout:
    """A consistent rollout of ``rows`` samples (group 2's ids by default), fields overridable."""
    fields: dict[str, Any] = {
        "sample_ids": [group_id * 100 + j for j in range(rows)],
        "seq_lens": [5] * rows,
        "weight_versions": [1] * rows,
        "payload": make_payload(group_id, rows=rows),
    }
    return Rollout(group_id=group_id, **{**fields, **over})


def assert_bitexact(actual: TensorDict, expected: TensorDict) -> None:
    assert isinstance(actual, TensorDict)
    assert actual.batch_size == expected.batch_size
    assert sorted(actual.keys()) == sorted(expected.keys())
    for key in sorted(expected.keys()):
        a, e = actual[key], expected[key]
        assert a.dtype == e.dtype, key
        assert a.shape == e.shape, key
        # Compare the bytes: NaN and -0.0 must survive too.
        assert torch.equal(a.contiguous().view(torch.uint8), e.contiguous().view(torch.uint8)), key


def snapshot(buf: ReplayBuffer) -> tuple[list[tuple[dict[str, Any], bool]], int, dict[int, Any]]:
    """Everything observable about a buffer, to check that a refused call changed nothing."""
    metas = [(g.meta(), g.ready) for g in buf.groups]
    rows = {}
    for g in buf.groups:
        for i in g.sample_ids:
            rows[i] = buf.data.get([i]).clone()
    return metas, len(buf.data), rows


def assert_unchanged(buf: ReplayBuffer, before: tuple[Any, int, dict[int, Any]]) -> None:
    metas, size, rows = snapshot(buf)
    assert metas == before[0]
    assert size == before[1]
    assert rows.keys() == before[2].keys()
    for i, row in before[2].items():
        assert_bitexact(rows[i], row)
