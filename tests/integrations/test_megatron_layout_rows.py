"""A Megatron layout's shard rows are checked the short way when well formed (a few C-level
steps, once the row's global shape and dtype were proven possible by an earlier row) and field
by field otherwise: the two must agree on every row -- the same shard, or the same error."""

from __future__ import annotations

import json

import pytest

from ckptstore.errors import IntegrityError
from ckptstore.integrations._common import megatron_layout as layout
from ckptstore.integrations._common.megatron_layout import Layout, TensorShard

GOOD = ["w", "megatron/rank1", "t0", "bfloat16", [8, 4], [4, 0], [4, 4]]


def _spoiled() -> list[object]:
    rows: list[object] = [list(GOOD)]
    for field, values in {
        0: [7, None, b"w"],
        1: [1, None],
        2: [["t0"]],
        3: [None, 16, "bfloat16x"],
        4: [[8], [8, 4, 1], [8, -4], [8, True], [8.0, 4], "84", None, [2**70, 4]],
        5: [[4], [5, 0], [4, -1], [4, False], [4.0, 0], [2**70, 0], None],
        6: [[4], [5, 4], [4, 5], [-4, 4], [4, None], (4, 4)],
    }.items():
        for value in values:
            row = list(GOOD)
            row[field] = value
            rows.append(row)
    rows += [GOOD[:6], [*GOOD, "extra"], tuple(GOOD), "row", None, {"key": "w"}]
    return rows


@pytest.mark.parametrize("proven", [False, True])
def test_the_short_way_agrees_with_the_field_checks_on_every_row(proven: bool) -> None:
    for row in _spoiled():
        try:
            slow: object = layout._checked_shard(row, "here")
        except (ValueError, TypeError, KeyError, IndexError, IntegrityError) as exc:
            slow = type(exc)
        # ``proven``: an earlier row proved this global shape and dtype possible.
        shapes = {((8, 4), "bfloat16")} if proven else set()
        try:
            fast: object = layout._tensor_shard(row, "here", shapes)
        except (ValueError, TypeError, KeyError, IndexError, IntegrityError) as exc:
            fast = type(exc)
        assert fast == slow, row
        if isinstance(slow, TensorShard):
            assert ((8, 4), "bfloat16") in shapes


def test_a_layout_with_a_bad_row_after_good_ones_is_refused_with_its_key() -> None:
    # The good rows prove the shape and dtype; the bad row after them still meets the checks.
    top = ["w", "megatron/rank0", "t0", "bfloat16", [8, 4], [0, 0], [4, 4]]
    good = json.dumps({"tensors": [top, GOOD], "objects": []})
    assert len(Layout.from_json(good, "here").tensors) == 2
    outside = ["w", "megatron/rank1", "t1", "bfloat16", [8, 4], [6, 0], [4, 4]]
    spoiled = json.dumps({"tensors": [top, GOOD, outside], "objects": []})
    with pytest.raises(IntegrityError, match="tensor 'w': a shard lies outside its global shape"):
        Layout.from_json(spoiled, "here")
