"""Checkpoints of the trainer's replay buffer (DESIGN.md §9.3): only ready groups are saved, they
go through the real store and come back bit-exactly, a saved buffer is validated before anything
is written, more groups than the capacity keep the freshest, and unchanged groups are not
uploaded again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("tensordict")

from replay_helpers import (
    G,
    SaveLoad,
    add_group,
    assert_bitexact,
    assert_unchanged,
    make_payload,
    rollout,
    sample_ids_of,
    snapshot,
)
from tensordict import TensorDict

from ckptstore import Run, ShardWriter
from trainer.replay import GROUP_KEYS, ReplayBuffer, ReplayBufferError

# -- round trips through the store ------------------------------------------------------------


def test_round_trip_through_the_store_keeps_groups_and_payloads(save_load: SaveLoad) -> None:
    buf = ReplayBuffer(capacity=4, group_size=G)
    add_group(buf, 1, start_weight=1, end_weight=2)
    add_group(buf, 2, start_weight=5, end_weight=6, target_step=7)
    originals = {1: make_payload(1), 2: make_payload(2)}

    loaded = save_load(1, buf.state_dict())

    fresh = ReplayBuffer(capacity=4, group_size=G)
    restored = fresh.load_state_dict(loaded)
    assert [g.group_id for g in restored] == [1, 2]
    assert restored == fresh.groups
    one, two = fresh.groups
    assert one.meta() == {
        "group_id": 1,
        "prompt_id": 1001,
        "dispatch_index": 1,
        "sample_ids": [100, 101, 102, 103],
        "seq_lens": [2, 3, 4, 5],
        "weight_versions": [1, 2, 1, 2],
        "start_weight": 1,
        "end_weight": 2,
        "target_step": None,
    }
    assert two.meta() == {
        "group_id": 2,
        "prompt_id": 1002,
        "dispatch_index": 2,
        "sample_ids": [200, 201, 202, 203],
        "seq_lens": [3, 4, 5, 6],
        "weight_versions": [5, 6, 5, 6],
        "start_weight": 5,
        "end_weight": 6,
        "target_step": 7,
    }
    assert one.ready
    assert two.ready
    assert len(fresh.data) == 2 * G
    for gid, payload in originals.items():
        assert_bitexact(fresh.data.get(sample_ids_of(gid)), payload)
    # Rows keyed by sample id: any subset, in any order, comes back row for row.
    assert_bitexact(fresh.data.get([203, 100]), torch.stack([originals[2][3], originals[1][0]]))

    taken = fresh.take([two])
    assert len(taken) == 1
    assert taken[0][0] is two
    assert_bitexact(taken[0][1], originals[2])
    assert [g.group_id for g in fresh.groups] == [1]
    assert len(fresh.data) == G
    assert not any(i in fresh.data for i in sample_ids_of(2))


def test_restored_sample_ids_are_buffered(save_load: SaveLoad) -> None:
    buf = ReplayBuffer(capacity=4, group_size=G)
    add_group(buf, 1)
    fresh = ReplayBuffer(capacity=4, group_size=G)
    fresh.load_state_dict(save_load(1, buf.state_dict()))
    add_group(fresh, 2, commit=False)
    clashing = [300, 301, 302, 100]  # 100 belongs to restored group 1
    with pytest.raises(ReplayBufferError, match=r"\[100\] are already buffered"):
        fresh.commit(rollout(2, sample_ids=clashing), end_weight=1)
    assert not fresh.find(2).ready


def test_empty_buffer_round_trips(save_load: SaveLoad) -> None:
    empty = ReplayBuffer(capacity=3, group_size=G)
    state = empty.state_dict()
    assert state == {"group_size": G, "groups": [], "payloads": {}}
    loaded = save_load(1, state)
    assert loaded["group_size"] == G
    assert list(loaded["groups"]) == []
    assert dict(loaded["payloads"]) == {}

    fresh = ReplayBuffer(capacity=3, group_size=G)
    assert fresh.load_state_dict(loaded) == []
    assert fresh.groups == []
    assert len(fresh.data) == 0

    # Loading replaces: an empty checkpoint empties a buffer that held groups.
    full = ReplayBuffer(capacity=3, group_size=G)
    add_group(full, 1)
    add_group(full, 2, commit=False)
    full.load_state_dict(loaded)
    assert full.groups == []
    assert len(full.data) == 0
    assert full.state_dict() == {"group_size": G, "groups": [], "payloads": {}}


def test_state_dict_saves_only_ready_groups_unshifted(save_load: SaveLoad) -> None:
    buf = ReplayBuffer(capacity=3, group_size=G)
    add_group(buf, 11, start_weight=3, end_weight=4, dispatch_index=0)
    add_group(buf, 12, start_weight=4, target_step=9, dispatch_index=1, commit=False)
    add_group(buf, 13, start_weight=5, end_weight=8, target_step=6, dispatch_index=2)

    state = buf.state_dict()
    assert state["group_size"] == G
    assert state["groups"] == [
        {
            "group_id": 11,
            "prompt_id": 1011,
            "dispatch_index": 0,
            "sample_ids": [1100, 1101, 1102, 1103],
            "seq_lens": [12, 13, 14, 15],
            "weight_versions": [3, 4, 3, 4],
            "start_weight": 3,
            "end_weight": 4,
            "target_step": None,
        },
        {
            "group_id": 13,
            "prompt_id": 1013,
            "dispatch_index": 2,
            "sample_ids": [1300, 1301, 1302, 1303],
            "seq_lens": [14, 15, 16, 17],
            "weight_versions": [5, 6, 5, 6],
            "start_weight": 5,
            "end_weight": 8,
            "target_step": 6,
        },
    ]
    assert sorted(state["payloads"]) == ["11", "13"]
    assert_bitexact(state["payloads"]["11"], make_payload(11))
    assert_bitexact(state["payloads"]["13"], make_payload(13))
    # Saving does not disturb the live buffer: the unready slot is still there.
    assert [(g.group_id, g.ready) for g in buf.groups] == [(11, True), (12, False), (13, True)]

    fresh = ReplayBuffer(capacity=3, group_size=G)
    fresh.load_state_dict(save_load(1, state))
    assert [g.meta() for g in fresh.groups] == state["groups"]
    assert all(g.ready for g in fresh.groups)
    assert len(fresh.data) == 2 * G
    assert_bitexact(fresh.data.get(sample_ids_of(11)), make_payload(11))
    assert_bitexact(fresh.data.get(sample_ids_of(13)), make_payload(13))


@pytest.mark.parametrize(
    "ready",
    [(True, False, True), (False, True, False), (False, False, True), (True, True, False)],
    ids=lambda r: "".join("R" if x else "u" for x in r),
)
def test_unready_slots_anywhere_are_skipped(ready: tuple[bool, ...]) -> None:
    buf = ReplayBuffer(capacity=3, group_size=G)
    for gid, is_ready in enumerate(ready, start=1):
        add_group(buf, gid, start_weight=gid * 10, target_step=gid, commit=is_ready)
    state = buf.state_dict()
    wanted = [gid for gid, is_ready in enumerate(ready, start=1) if is_ready]
    assert [m["group_id"] for m in state["groups"]] == wanted
    for meta in state["groups"]:
        gid = meta["group_id"]
        assert meta["sample_ids"] == sample_ids_of(gid)
        assert meta["start_weight"] == gid * 10
        assert meta["end_weight"] == gid * 10 + 1
        assert meta["target_step"] == gid
        assert meta["weight_versions"] == [gid * 10, gid * 10 + 1] * (G // 2)
    assert sorted(state["payloads"]) == sorted(str(gid) for gid in wanted)
    for gid in wanted:
        assert_bitexact(state["payloads"][str(gid)], make_payload(gid))


def test_round_trip_through_a_receipt_like_the_controller(
    run: Run, shard_writer: ShardWriter
) -> None:
    buf = ReplayBuffer(capacity=2, group_size=G)
    add_group(buf, 1, start_weight=1, end_weight=2)
    add_group(buf, 2, start_weight=2, target_step=7)
    receipt = shard_writer.write("replay_buffer", buf.state_dict(), kind="replay_buffer")
    assert receipt.component == "replay_buffer"
    assert receipt.kind == "replay_buffer"
    run.save(3, receipts=[receipt])
    fresh = ReplayBuffer(capacity=2, group_size=G)
    fresh.load_state_dict(run.load(3).state["replay_buffer"])
    assert [g.meta() for g in fresh.groups] == [g.meta() for g in buf.groups]
    assert (fresh.groups[0].start_weight, fresh.groups[0].end_weight) == (1, 2)
    assert fresh.groups[1].target_step == 7
    for gid in (1, 2):
        assert_bitexact(fresh.data.get(sample_ids_of(gid)), buf.data.get(sample_ids_of(gid)))


# -- more groups than capacity ----------------------------------------------------------------


def big_state(
    start_weights: list[int], target_steps: list[int | None] | None = None
) -> dict[str, Any]:
    source = ReplayBuffer(capacity=len(start_weights), group_size=G)
    for gid, sw in enumerate(start_weights, start=1):
        ts = None if target_steps is None else target_steps[gid - 1]
        add_group(source, gid, start_weight=sw, target_step=ts)
    return source.state_dict()


def test_over_capacity_keeps_the_freshest_by_start_weight(save_load: SaveLoad) -> None:
    loaded = save_load(1, big_state([3, 1, 4, 2]))
    buf = ReplayBuffer(capacity=2, group_size=G)
    kept = buf.load_state_dict(loaded)
    # Groups 1 (start_weight 3) and 3 (start_weight 4) survive, in their saved order.
    assert [g.group_id for g in kept] == [1, 3]
    assert [g.start_weight for g in buf.groups] == [3, 4]
    assert len(buf.data) == 2 * G
    for gid in (2, 4):
        assert not any(i in buf.data for i in sample_ids_of(gid))
    for gid in (1, 3):
        assert_bitexact(buf.data.get(sample_ids_of(gid)), make_payload(gid))


def test_at_capacity_groups_with_target_steps_load() -> None:
    buf = ReplayBuffer(capacity=3, group_size=G)
    buf.load_state_dict(big_state([3, 1, 4], [None, 7, None]))
    assert [(g.group_id, g.target_step) for g in buf.groups] == [(1, None), (2, 7), (3, None)]


def test_over_capacity_with_a_target_step_raises_and_changes_nothing() -> None:
    buf = ReplayBuffer(capacity=2, group_size=G)
    add_group(buf, 50, start_weight=9)
    add_group(buf, 51, commit=False)
    before = snapshot(buf)
    state = big_state([3, 1, 4], [None, 7, None])
    with pytest.raises(ReplayBufferError, match=r"target_step") as err:
        buf.load_state_dict(state)
    assert "capacity" in str(err.value)
    assert "[2]" in str(err.value)  # names the stamped group
    assert_unchanged(buf, before)


# -- load_state_dict validation ---------------------------------------------------------------


def valid_state() -> dict[str, Any]:
    source = ReplayBuffer(capacity=3, group_size=G)
    for gid in (1, 2, 3):
        add_group(source, gid, start_weight=gid)
    return source.state_dict()


def last_meta(state: dict[str, Any]) -> dict[str, Any]:
    return state["groups"][-1]


def drop_top(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda s: s.pop(key)


def drop_group_key(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda s: last_meta(s).pop(key)


def set_last(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda s: last_meta(s).__setitem__(key, value)


def set_payload(gid: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda s: s["payloads"].__setitem__(gid, value)


# The broken group is always the last one, so a loader that wrote groups one by one as it
# validated them would be caught by the unchanged-buffer check.
BAD_STATES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    **{
        f"no {key}": (drop_top(key), rf"lacks \['{key}'\]")
        for key in ("group_size", "groups", "payloads")
    },
    **{
        f"group without {key}": (drop_group_key(key), rf"saved group .* lacks \['{key}'\]")
        for key in GROUP_KEYS
    },
    "other group size": (lambda s: s.__setitem__("group_size", G + 1), r"groups of 5 samples"),
    "duplicate id within a group": (
        set_last("sample_ids", [300, 301, 300, 303]),
        r"repeats sample ids",
    ),
    "duplicate id across groups": (
        set_last("sample_ids", [300, 301, 302, 101]),
        r"repeats sample ids \[101\]",
    ),
    "too few ids": (set_last("sample_ids", [300, 301, 302]), r"exactly 4 sample ids"),
    "too many ids": (set_last("sample_ids", [300, 301, 302, 303, 304]), r"exactly 4 sample ids"),
    "too few lengths": (set_last("seq_lens", [1] * (G - 1)), r"exactly 4 sample ids"),
    "too many weight versions": (
        set_last("weight_versions", [1] * (G + 1)),
        r"exactly 4 sample ids",
    ),
    "repeated group": (set_last("group_id", 1), r"repeats group 1"),
    "missing payload": (lambda s: s["payloads"].pop("3"), r"missing \['3'\], extra \[\]"),
    "extra payload": (set_payload("9", make_payload(9)), r"missing \[\], extra \['9'\]"),
    "short payload": (
        set_payload("3", make_payload(3, rows=G - 1)),
        r"group 3 is not a TensorDict of 4 rows",
    ),
    "long payload": (
        set_payload("3", make_payload(3, rows=G + 1)),
        r"group 3 is not a TensorDict of 4 rows",
    ),
    "payload not a TensorDict": (
        set_payload("3", {"x": torch.zeros(G, 2)}),
        r"group 3 is not a TensorDict of 4 rows",
    ),
}


@pytest.mark.parametrize(("breaks", "match"), BAD_STATES.values(), ids=BAD_STATES.keys())
def test_bad_saved_buffers_are_refused_before_anything_is_written(
    breaks: Callable[[dict[str, Any]], Any], match: str
) -> None:
    state = valid_state()
    ReplayBuffer(capacity=3, group_size=G).load_state_dict(valid_state())  # the base is valid
    breaks(state)
    buf = ReplayBuffer(capacity=3, group_size=G)
    add_group(buf, 50, start_weight=9)
    add_group(buf, 51, commit=False)
    before = snapshot(buf)
    with pytest.raises(ReplayBufferError, match=match):
        buf.load_state_dict(state)
    assert_unchanged(buf, before)


# -- deduplication across checkpoints ---------------------------------------------------------


def big_payload(seed: int) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "tokens": torch.randint(0, 2**62, (G, 4096), generator=gen),
            "logp": torch.randn(G, 8192, generator=gen),
        },
        batch_size=[G],
    )


def test_unchanged_groups_are_not_uploaded_again(run: Run, shard_writer: ShardWriter) -> None:
    buf = ReplayBuffer(capacity=4, group_size=G)
    for gid in (1, 2, 3, 4):
        add_group(buf, gid, start_weight=gid, payload=big_payload(gid))
    payload_bytes = sum(t.nbytes for t in big_payload(0).values())  # 256 KiB per group

    first = shard_writer.write("replay_buffer", buf.state_dict(), kind="replay_buffer")
    run.save(1, receipts=[first])
    assert first.result.uploaded_bytes == first.result.stored_bytes
    assert first.result.uploaded_bytes > 3 * payload_bytes  # random data barely compresses

    # One step later: group 1 was trained on, group 5 arrived; groups 2-4 are unchanged.
    buf.take([buf.find(1)])
    add_group(buf, 5, start_weight=5, payload=big_payload(5))
    second = shard_writer.write("replay_buffer", buf.state_dict(), kind="replay_buffer")
    run.save(2, receipts=[second])

    assert second.uploaded_bytes == second.result.uploaded_bytes
    assert 0.5 * payload_bytes < second.result.uploaded_bytes < 1.5 * payload_bytes
    assert second.result.uploaded_bytes < first.result.uploaded_bytes / 3
    # Both checkpoints reference a full buffer of four groups.
    assert second.result.stored_bytes == pytest.approx(first.result.stored_bytes, rel=0.1)
    first_digests = {b.digest for b in first.result.blobs}
    reused = [b for b in second.result.blobs if not b.uploaded]
    fresh = [b for b in second.result.blobs if b.uploaded]
    assert reused
    assert {b.digest for b in reused} <= first_digests
    assert not {b.digest for b in fresh} & first_digests

    # An unchanged buffer uploads nothing at all.
    third = shard_writer.write("replay_buffer", buf.state_dict(), kind="replay_buffer")
    run.save(3, receipts=[third])
    assert third.result.uploaded_bytes == 0
    assert third.result.index_digest == second.result.index_digest

    for step, gids in ((1, [1, 2, 3, 4]), (2, [2, 3, 4, 5]), (3, [2, 3, 4, 5])):
        restored = ReplayBuffer(capacity=4, group_size=G)
        restored.load_state_dict(run.load(step).state["replay_buffer"])
        assert [g.group_id for g in restored.groups] == gids
        for gid in gids:
            assert_bitexact(restored.data.get(sample_ids_of(gid)), big_payload(gid))
