"""A DCP checkpoint whose metadata lies about its tensors is refused before anything is read.

Each checkpoint is committed through the public API (``ShardWriter`` receipts +
``Run.save(receipts=...)``, see crafted_checkpoints.py) with healthy blobs and valid digests;
only the metadata is wrong. ``ckpt_dcp.load`` must raise one ``IntegrityError`` naming the
tensor (no ``digest``: no blob is damaged) and leave the destination untouched, and the load of
the newest checkpoint must fall back past it. The sharding-integrity check itself
(``tiling.check_tiling``) is tested on declared numbers alone at the end. The export command's
side is in tests/cli/test_export_validation.py.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from crafted_checkpoints import (
    DCP_LIES,
    Chunk,
    Tensor,
    commit_dcp,
    dcp_document,
    nested,
    rows,
    whole,
)

import ckptstore
from ckptstore.cas import blob_key
from ckptstore.checkpointer import Run
from ckptstore.errors import CkptStoreError, IntegrityError
from ckptstore.integrations import dcp as ckpt_dcp
from ckptstore.integrations._common.documents import json_str
from ckptstore.serialize.reader import ComponentReader
from ckptstore.serialize.tiling import MAX_SPLIT_AXES, check_shape, check_tiling

SENTINEL = -7.0


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    with ckptstore.open_run("lies", db=tmp_path / "m.db", store=tmp_path / "store") as opened:
        yield opened


@pytest.mark.parametrize("case", list(DCP_LIES))
def test_load_refuses_metadata_that_lies_and_writes_nothing(run: Run, case: str) -> None:
    tensor, shape, needle = DCP_LIES[case]
    commit_dcp(run, 1, {"w": tensor})
    target = {"w": torch.full(shape, SENTINEL, dtype=tensor.chunks[0].data.dtype)}
    with pytest.raises(IntegrityError) as caught:
        ckpt_dcp.load(target, run, step=1)
    message = str(caught.value)
    assert "run 'lies', step 1" in message, message
    assert "tensor 'w'" in message, message
    assert needle in message, message
    assert "the checkpoint's metadata is wrong" in message, message
    assert caught.value.digest is None  # no blob is damaged: nothing may be quarantined
    assert torch.all(target["w"] == SENTINEL), "the destination was written"


def test_load_refuses_metadata_nested_100000_deep(run: Run) -> None:
    commit_dcp(run, 1, {}, text=nested(100_000))
    with pytest.raises(IntegrityError, match="nested deeper than any writer") as caught:
        ckpt_dcp.load({"w": torch.zeros(2)}, run, step=1)
    assert caught.value.digest is None


def pinwheel(w: torch.Tensor) -> Tensor:
    """``w`` (3k x 3k) as five chunks in a pinwheel: a truthful tiling that is no grid (no cut
    along either axis separates the chunks), listed in no particular order."""
    k = w.shape[0] // 3
    boxes = [((k, k), (k, k)), ((0, 0), (2 * k, k)), ((0, k), (k, 2 * k))]
    boxes += [((k, 2 * k), (2 * k, k)), ((2 * k, 0), (k, 2 * k))]
    chunks = [Chunk(list(o), w[o[0] : o[0] + n[0], o[1] : o[1] + n[1]].clone()) for o, n in boxes]
    return Tensor(list(w.shape), chunks)


def test_newest_checkpoint_with_lying_metadata_is_skipped_like_a_corrupt_one(run: Run) -> None:
    w = rows(6, 6)
    others = {"step": whole(torch.tensor(7)), "empty": whole(torch.empty(0, 3))}
    commit_dcp(run, 1, {"w": pinwheel(w), **others})
    # Step 2 lies: the centre chunk of 'w' is in no chunk.
    lying = commit_dcp(run, 2, {"w": Tensor([6, 6], pinwheel(w).chunks[1:]), **others})

    target = {
        "w": torch.full((6, 6), SENTINEL),
        "step": torch.tensor(0),
        "empty": torch.empty(0, 3),
    }
    with pytest.raises(IntegrityError, match="tensor 'w'"):
        ckpt_dcp.load(target, run, fallback=False)
    assert torch.all(target["w"] == SENTINEL)
    loaded = ckpt_dcp.load(target, run)
    assert loaded.step == 1
    assert torch.equal(target["w"], w)
    assert int(target["step"]) == 7
    assert {c.step: c.status for c in run.checkpoints()} == {1: "committed", 2: "corrupt"}
    # The blobs are healthy: none was quarantined, all are where they were.
    assert list(run.store.list("quarantine/")) == []
    for component in lying.components:
        reader = ComponentReader(run.store, component.index_digest)
        for digest in reader.digests | {component.index_digest}:
            assert run.store.exists(blob_key(digest)), digest


def test_a_malformed_metadata_document_is_skipped_like_a_corrupt_checkpoint(run: Run) -> None:
    """Its blob verifies, but the document is not one a writer makes (a string where the
    tensors belong): the load falls back past it, and no blob is condemned."""
    w = rows(4, 4)
    commit_dcp(run, 1, {"w": whole(w)})
    document = json.dumps({**dcp_document({"w": whole(w)}, "b3:" + "0" * 64), "tensors": "w"})
    commit_dcp(run, 2, {"w": whole(w)}, text=document)
    target = {"w": torch.full((4, 4), SENTINEL)}
    with pytest.raises(IntegrityError, match="malformed DCP metadata") as caught:
        ckpt_dcp.load(target, run, fallback=False)
    assert caught.value.digest is None
    assert ckpt_dcp.load(target, run).step == 1
    assert torch.equal(target["w"], w)
    assert {c.step: c.status for c in run.checkpoints()} == {1: "committed", 2: "corrupt"}
    assert list(run.store.list("quarantine/")) == []


# -- the sharding-integrity check on declared numbers alone ----------------------------------


def test_tiling_accepts_every_exact_tiling_even_when_not_a_grid() -> None:
    # A pinwheel: four 2x1 / 1x2 bricks around a 1x1 centre tile a 3x3 square, and no cut
    # along either axis separates them -- a guillotine (interval-per-axis) check would refuse.
    pinwheel = [
        ((0, 0), (2, 1)),
        ((0, 1), (1, 2)),
        ((1, 2), (2, 1)),
        ((2, 0), (1, 2)),
        ((1, 1), (1, 1)),
    ]
    check_tiling((3, 3), pinwheel, "pinwheel")
    check_tiling((), [((), ())], "a 0-d tensor")
    check_tiling((0, 5), [], "an empty tensor with no chunk")
    check_tiling((4,), [((0,), (4,)), ((4,), (0,)), ((2,), (0,))], "with empty chunks")


@pytest.mark.parametrize(
    ("shape", "boxes", "needle"),
    [
        ((3, 3), [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2))], "8 of"),
        ((4,), [((0,), (2,)), ((1,), (2,)), ((3,), (1,))], "overlap"),
        ((4, 4), [((0, 0), (4, 4)), ((0, 0), (4, 4))], "chunks overlap"),
        ((4, 4), [((0, 0), (2, 4)), ((1, 0), (2, 4))], "overlap and leave a gap"),
        ((), [((), ()), ((), ())], "chunks overlap"),
        ((2,), [], "hold 0 of its 2"),
        ((4,), [((3,), (2,))], "lies outside"),
        ((4, 4), [((0,), (4,))], "dimensions"),
    ],
)
def test_tiling_refuses_gaps_overlaps_and_strays(
    shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], needle: str
) -> None:
    with pytest.raises(IntegrityError, match="tensor 'x'") as caught:
        check_tiling(shape, boxes, "tensor 'x'")
    assert needle in str(caught.value)


def test_tiling_works_on_declared_numbers_without_allocating() -> None:
    # An exabyte-sized claim tiled by 4096 chunks: checked as Python ints, nothing allocated.
    rows_each, cols = 2**40, 2**10
    boxes = [((i * rows_each, 0), (rows_each, cols)) for i in range(4096)]
    check_tiling((4096 * rows_each, cols), boxes, "huge")
    with pytest.raises(IntegrityError, match="huge"):
        check_tiling((4096 * rows_each + 1, cols), boxes, "huge")
    check_shape([2**40, 2**20], 4, "big but possible")
    with pytest.raises(IntegrityError, match="more bytes than any tensor"):
        check_shape([2**62, 2], 4, "too big")
    with pytest.raises(IntegrityError, match="65 dimensions"):
        check_shape([1] * 65, 4, "too many axes")


def test_tiling_of_a_tensor_split_along_too_many_axes_is_refused_without_blame() -> None:
    axes = MAX_SPLIT_AXES + 1
    boxes = [
        (tuple(1 if (i >> k) & 1 else 0 for k in range(axes)), (1,) * axes) for i in range(2**axes)
    ]
    with pytest.raises(CkptStoreError, match=f"split along {axes} axes") as caught:
        check_tiling((2,) * axes, boxes, "tensor 'x'")
    assert not isinstance(caught.value, IntegrityError)  # not proof of damage


def _covers_exactly(shape: tuple[int, ...], boxes: list[tuple[list[int], list[int]]]) -> bool:
    """The oracle: every element of ``shape`` lies in exactly one box, and no box leaves it
    (counted element by element -- only for small shapes)."""
    counts = torch.zeros(shape, dtype=torch.int64)
    for offsets, sizes in boxes:
        if any(o + n > d for o, n, d in zip(offsets, sizes, shape, strict=True)):
            return False
        counts[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))] += 1
    return bool((counts == 1).all())


def test_the_one_axis_short_way_agrees_with_counting_every_element() -> None:
    # Row blocks (the FSDP layout check_tiling proves by sorting intervals) and column blocks,
    # whole and then spoiled one way each: a gap, an overlap, a stray, a duplicate, a chunk
    # shrunk, grown or moved, empties, shuffled order. The verdict must be the oracle's.
    import random

    picks = random.Random(25)
    verdicts = {True: 0, False: 0}
    for _ in range(600):
        shape = (picks.randint(1, 9), picks.randint(1, 9))
        axis = picks.randint(0, 1)
        cuts = sorted({0, shape[axis], *(picks.randint(0, shape[axis]) for _ in range(3))})
        boxes: list[tuple[list[int], list[int]]] = []
        for start, stop in itertools.pairwise(cuts):
            offsets, sizes = [0, 0], list(shape)
            offsets[axis], sizes[axis] = start, stop - start
            boxes.append((offsets, sizes))
        spoil = picks.choice(["none", "drop", "dup", "grow", "shrink", "move", "empty", "stray"])
        victim = picks.randrange(len(boxes))
        offsets, sizes = boxes[victim]
        if spoil == "drop":
            del boxes[victim]
        elif spoil == "dup":
            boxes.append((list(offsets), list(sizes)))
        elif spoil in ("grow", "shrink"):
            sizes[axis] = max(0, sizes[axis] + (1 if spoil == "grow" else -1))
        elif spoil == "move":
            offsets[axis] = max(0, offsets[axis] + picks.choice([-1, 1]))
        elif spoil == "empty":
            boxes.append(([picks.randint(0, shape[0]), 0], [0, shape[1]]))
        elif spoil == "stray":
            boxes.append(([shape[0], 0], [1, shape[1]]))
        picks.shuffle(boxes)
        expected = _covers_exactly(shape, boxes)
        try:
            check_tiling(shape, boxes, "tensor 'x'")
            verdict = True
        except IntegrityError:
            verdict = False
        assert verdict == expected, (shape, boxes)
        verdicts[verdict] += 1
    assert min(verdicts.values()) > 100  # both answers were asked for often


def test_the_fast_row_checks_accept_exactly_what_the_field_checks_accept() -> None:
    # Each well-formed chunk or location row is checked in a few C-level steps; anything the
    # short way does not accept goes through the field-by-field validators. The two must never
    # disagree: the short way accepts only values those accept, and equal.
    from ckptstore.integrations.dcp import _metadata as md

    odd: list[object] = [0, 1, 7, -1, True, False, 1.0, "1", None, [], [1], {}, 2**70]
    rows_of_two = [[a, b] for a in ([0, 4], [1, -1], [True, 0], [], "ab", [2.0], None) for b in odd]
    for chunk in [*rows_of_two, [[0], [1], [2]], "xy", {"o": 1, "s": 2}, None, [[0, 1]]]:
        try:
            offsets, sizes = chunk  # type: ignore[misc]
            slow: object = (md._ints(offsets), md._ints(sizes))
        except (TypeError, ValueError) as exc:
            slow = type(exc)
        try:
            fast: object = md._box(chunk)
        except (TypeError, ValueError) as exc:
            fast = type(exc)
        assert fast == slow, chunk
    for row in [
        ["w", [0, 4], 1, 2],
        ["w", None, 0, 0],
        ["w", [0, 4], -1, 2],
        ["w", [0, 4], 1, True],
        ["w", [0, -4], 1, 2],
        ["w", [0, 4.0], 1, 2],
        [7, [0, 4], 1, 2],
        ["w", "04", 1, 2],
        ["w", [0, 4], 1],
        ["w", [0, 4], 1.5, 2],
    ]:
        try:
            fqn, offset, rank, position = row
            key = (json_str(fqn), None if offset is None else tuple(md._ints(offset)))
            slow = (key, md.Location(md._int(rank), md._int(position)))
        except (TypeError, ValueError) as exc:
            slow = type(exc)
        try:
            fast = md._location(row)
        except (TypeError, ValueError) as exc:
            fast = type(exc)
        assert fast == slow, row
