"""Sharding integrity: a tensor's chunks lie inside it, do not overlap, and tile it exactly.

Megatron-Core checks this before a save; ckptstore checks it again before a load or an export
reads anything, for torch DCP's metadata and for Megatron's layout alike, because metadata
written by a buggy or older writer -- or by anyone who can commit -- would otherwise fill the
uncovered part of a tensor with whatever memory held, or allocate what a lie claims.

The check works on the declared numbers alone, as Python ints: nothing is allocated in
proportion to a declared size. It costs ``2**s`` dictionary updates per chunk, where ``s`` is
the number of axes along which the tensor is split (1 or 2 for FSDP and tensor parallelism;
never more than :data:`MAX_SPLIT_AXES`).

Why it is exact: the indicator function of a box ``[a, b)`` is the signed sum of the orthants
at its ``2**d`` corners (``+`` at ``a``, alternating signs along each axis), and orthants at
distinct points are linearly independent. So the chunks cover every element of the tensor
exactly once -- no gap, no overlap, nothing outside -- if and only if their signed corner counts
add up to the tensor's own. Empty chunks contribute nothing; axes that every chunk spans whole
factor out of both sides. A tensor split along one axis alone (FSDP's row blocks, one
tensor-parallel split) is first tried the short way -- its chunks sorted as intervals of that
axis must meet end to start -- and only a layout that fails it is counted corner by corner,
which also names what is wrong.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence

from ckptstore.errors import CkptStoreError, IntegrityError
from ckptstore.serialize.index import MAX_DIMS

#: The most axes along which one tensor may be split (the check's cost doubles with each).
MAX_SPLIT_AXES = 8
#: torch counts elements and bytes in int64: no tensor, and no chunk of one, is larger.
MAX_INT64 = 2**63 - 1

Box = tuple[Sequence[int], Sequence[int]]
#: The end of every message about metadata that contradicts itself or the stored entries.
WRONG_METADATA = (
    "-- the checkpoint's metadata is wrong (its blobs may be intact); use an earlier checkpoint"
)


def check_shape(shape: Sequence[int], itemsize: int, what: str) -> None:
    """A tensor ``shape`` any tensor can have: at most ``MAX_DIMS`` axes, its bytes countable
    in int64. ``what`` names the tensor (and where it was found)."""
    if len(shape) > MAX_DIMS:
        raise IntegrityError(
            f"{what} has {len(shape)} dimensions; a tensor has at most {MAX_DIMS} {WRONG_METADATA}"
        )
    if any(d > MAX_INT64 for d in shape) or math.prod(shape) * itemsize > MAX_INT64:
        raise IntegrityError(
            f"{what} claims shape {list(shape)}, more bytes than any tensor can hold "
            + WRONG_METADATA
        )


def check_tiling(shape: Sequence[int], boxes: Sequence[Box], what: str) -> None:
    """Check that ``boxes`` (offsets, sizes) tile ``shape`` exactly; ``IntegrityError`` naming
    ``what`` and the first offset where they do not, otherwise."""
    for offsets, sizes in boxes:
        _check_inside(shape, offsets, sizes, what)
    solid = [(offsets, sizes) for offsets, sizes in boxes if all(sizes)]
    axes = _split_axes(shape, solid, what)
    if len(axes) == 1 and _intervals_tile(shape[axes[0]], solid, axes[0]):
        return  # the usual layout (FSDP, one tensor-parallel split), proven the short way
    counts: dict[tuple[int, ...], int] = {}
    for offsets, sizes in solid:
        _add_corners(counts, axes, offsets, sizes, 1)
    if math.prod(shape):
        _add_corners(counts, axes, (0,) * len(shape), shape, -1)
    wrong = [corner for corner, count in counts.items() if count]
    if wrong:
        raise IntegrityError(
            f"{what}: {_mismatch(shape, solid, axes, min(wrong))} {WRONG_METADATA}"
        )


def _check_inside(
    shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], what: str
) -> None:
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise IntegrityError(
            f"{what}: a chunk at offset {list(offsets)} of size {list(sizes)} does not have "
            f"the tensor's {len(shape)} dimensions {WRONG_METADATA}"
        )
    if any(map(operator.gt, map(operator.add, offsets, sizes), shape)):
        raise IntegrityError(
            f"{what}: the chunk at offset {list(offsets)} of size {list(sizes)} lies outside "
            f"the tensor's shape {list(shape)} {WRONG_METADATA}"
        )


def _split_axes(shape: Sequence[int], solid: Sequence[Box], what: str) -> list[int]:
    """The axes along which some non-empty chunk does not span the whole tensor."""
    axes = [k for k in range(len(shape)) if any(o[k] or n[k] != shape[k] for o, n in solid)]
    if len(axes) > MAX_SPLIT_AXES:
        # Not proof that anything is wrong: refused without blame (no IntegrityError).
        raise CkptStoreError(
            f"{what} is split along {len(axes)} axes; ckptstore checks layouts split along at "
            f"most {MAX_SPLIT_AXES} before reading them, so it cannot read this one. Nothing "
            "was marked corrupt"
        )
    return axes


def _intervals_tile(length: int, solid: Sequence[Box], axis: int) -> bool:
    """Whether chunks split along ``axis`` alone tile it: each spans every other axis whole,
    so it is an interval of ``axis``, and the intervals, in order, must meet end to start from
    0 to ``length``. False says only that this proof failed: the corner count then decides, and
    names what is wrong (this is a faster path to the same answer, never a different one)."""
    end = 0
    for start, stop in sorted((o[axis], o[axis] + n[axis]) for o, n in solid):
        if start != end:
            return False
        end = stop
    return end == length


def _add_corners(
    counts: dict[tuple[int, ...], int],
    axes: Sequence[int],
    offsets: Sequence[int],
    sizes: Sequence[int],
    sign: int,
) -> None:
    """Add the signed corners of one box (projected on ``axes``) to ``counts``."""
    for bits in itertools.product((0, 1), repeat=len(axes)):
        corner = tuple(offsets[k] + sizes[k] * bit for k, bit in zip(axes, bits, strict=True))
        counts[corner] = counts.get(corner, 0) + (-sign if sum(bits) % 2 else sign)


def _mismatch(
    shape: Sequence[int], solid: Sequence[Box], axes: Sequence[int], first: tuple[int, ...]
) -> str:
    """What is wrong with chunks that do not tile ``shape``, for a message."""
    total = math.prod(shape)
    covered = sum(math.prod(sizes) for _, sizes in solid)
    where = [0] * len(shape)
    for k, value in zip(axes, first, strict=True):
        where[k] = value
    at = f"(first near offset {where})"
    if covered < total:
        return f"its chunks hold {covered} of its {total} elements; the rest is in no chunk {at}"
    if covered > total:
        return f"its chunks hold {covered} elements, the tensor {total}: chunks overlap {at}"
    return f"its chunks overlap and leave a gap of the same size {at}"
