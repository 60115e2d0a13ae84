"""The trainer's replay buffer (DESIGN.md §9.3): the reserve -> commit path of a worker's
:class:`~trainer.replay.Rollout`, its rollback, and one copy of each payload. Checkpoints of the
buffer are in test_replay_checkpoint.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("tensordict")

from replay_helpers import (
    G,
    add_group,
    assert_bitexact,
    assert_unchanged,
    make_payload,
    rollout,
    sample_ids_of,
    snapshot,
)
from tensordict import TensorDict

from trainer.replay import DataPlane, ReplayBuffer, ReplayBufferError, Rollout

# -- commit validation and rollback -----------------------------------------------------------


BAD_ROLLOUTS = {
    "duplicate id within the group": ({"sample_ids": [200, 201, 201, 203]}, r"repeats a sample"),
    "too few lengths": ({"seq_lens": [5] * (G - 1)}, r"4 sample ids but 3 lengths"),
    "too many weight versions": ({"weight_versions": [1] * (G + 1)}, r"5 weight versions"),
    "payload too short": ({"payload": make_payload(2, rows=G - 1)}, r"payload batch size"),
    "payload too long": ({"payload": make_payload(2, rows=G + 1)}, r"payload batch size"),
    "payload without batch dim": (
        {"payload": TensorDict({"a": torch.zeros(G)}, batch_size=[])},
        r"payload batch size",
    ),
    "payload not a TensorDict": ({"payload": {"a": torch.zeros(G)}}, r"must be a TensorDict"),
}


@pytest.mark.parametrize(("over", "match"), BAD_ROLLOUTS.values(), ids=BAD_ROLLOUTS.keys())
def test_an_inconsistent_rollout_cannot_be_made(over: dict[str, Any], match: str) -> None:
    with pytest.raises(ReplayBufferError, match=match):
        rollout(2, **over)


BAD_COMMITS = {
    "id of another group": (rollout(2, sample_ids=[200, 201, 202, 101]), r"\[101\] are already"),
    "too few samples": (rollout(2, rows=G - 1), r"needs exactly 4 samples.*has 3"),
    "too many samples": (rollout(2, rows=G + 1), r"needs exactly 4 samples.*has 5"),
}


@pytest.mark.parametrize(("bad", "match"), BAD_COMMITS.values(), ids=BAD_COMMITS.keys())
def test_bad_commits_are_refused_before_anything_is_written(bad: Rollout, match: str) -> None:
    buf = ReplayBuffer(capacity=3, group_size=G)
    add_group(buf, 1)
    add_group(buf, 2, commit=False)
    before = snapshot(buf)
    with pytest.raises(ReplayBufferError, match=match):
        buf.commit(bad, end_weight=2)
    assert_unchanged(buf, before)
    group = buf.find(2)
    assert (group.ready, group.end_weight, group.sample_ids) == (False, -1, [])
    assert len(buf.data) == G
    # The slot is still usable.
    buf.commit(rollout(2), end_weight=2)
    assert buf.find(2).ready
    assert len(buf.data) == 2 * G


def test_commit_failure_midway_rolls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = ReplayBuffer(capacity=3, group_size=G)
    add_group(buf, 1)
    add_group(buf, 2, commit=False)
    before = snapshot(buf)
    real_put = DataPlane.put

    def failing_put(self: DataPlane, sample_ids: list[int], payload: TensorDict) -> None:
        real_put(self, sample_ids[:2], payload[:2])  # half the rows land, then it breaks
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(DataPlane, "put", failing_put)
    with pytest.raises(RuntimeError, match="disk on fire"):
        buf.commit(rollout(2), end_weight=2)
    monkeypatch.undo()
    assert_unchanged(buf, before)
    assert not any(i in buf.data for i in sample_ids_of(2))
    group = buf.find(2)
    assert (group.ready, group.end_weight) == (False, -1)
    assert (group.sample_ids, group.seq_lens, group.weight_versions) == ([], [], [])
    assert buf.state_dict()["groups"] == [buf.find(1).meta()]
    buf.commit(rollout(2), end_weight=2)
    assert_bitexact(buf.data.get(sample_ids_of(2)), make_payload(2))


def test_commit_twice_or_unknown_group_is_refused() -> None:
    buf = ReplayBuffer(capacity=3, group_size=G)
    add_group(buf, 1)
    before = snapshot(buf)
    with pytest.raises(ReplayBufferError, match="already committed"):
        buf.commit(rollout(1, sample_ids=[900, 901, 902, 903]), end_weight=2)
    assert_unchanged(buf, before)
    with pytest.raises(KeyError, match="no group 7"):
        buf.commit(rollout(7), end_weight=2)
    assert_unchanged(buf, before)


def test_reserve_refuses_a_full_buffer_and_a_repeated_group() -> None:
    buf = ReplayBuffer(capacity=2, group_size=G)
    add_group(buf, 1)
    with pytest.raises(ReplayBufferError, match="already in the replay buffer"):
        add_group(buf, 1, commit=False)
    add_group(buf, 2, commit=False)
    before = snapshot(buf)
    with pytest.raises(ReplayBufferError, match=r"full \(2 groups\)"):
        add_group(buf, 3, commit=False)
    assert_unchanged(buf, before)
    # A slot freed by rollback can be reserved again.
    buf.rollback(2)
    add_group(buf, 3, commit=False)
    assert [g.group_id for g in buf.groups] == [1, 3]


def test_rollback_removes_a_ready_group_and_its_rows() -> None:
    buf = ReplayBuffer(capacity=2, group_size=G)
    add_group(buf, 1)
    add_group(buf, 2)
    removed = buf.rollback(1)
    assert removed.group_id == 1
    assert [g.group_id for g in buf.groups] == [2]
    assert len(buf.data) == G
    assert not any(i in buf.data for i in sample_ids_of(1))


# -- one copy of each payload -----------------------------------------------------------------


def test_a_group_s_payload_is_kept_and_saved_without_a_copy() -> None:
    buf = ReplayBuffer(capacity=3, group_size=G)
    add_group(buf, 1)
    buf.reserve(2, prompt_id=1002, dispatch_index=2, start_weight=0)
    done = rollout(2)
    buf.commit(done, end_weight=1)
    # The checkpoint gets the rollout's own TensorDict (the save's snapshot is the one copy).
    assert buf.state_dict()["payloads"]["2"] is done.payload
    assert buf.data.get(sample_ids_of(2)) is done.payload
    # Other selections are new TensorDicts, row for row.
    mixed = buf.data.get([203, 100])
    assert mixed is not done.payload
    assert_bitexact(mixed, torch.stack([done.payload[3], make_payload(1)[0]]))
    reordered = buf.data.get(list(reversed(sample_ids_of(2))))
    assert_bitexact(reordered, done.payload.flip(0))
    ((taken, payload),) = buf.take([buf.find(2)])
    assert taken.group_id == 2
    assert payload is done.payload
    assert not any(i in buf.data for i in sample_ids_of(2))
