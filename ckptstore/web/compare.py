"""Which parameters changed between two checkpoints, matched by parameter name whatever the
layout.

Each checkpoint's state-dict names become parameters (:func:`params`): a plain entry is
``component.path`` (a rank component's ``/rank<r>`` dropped, its shards of one name summed
over the ranks), a DCP or Megatron name is its FQN or key with its shards gathered. So a whole
checkpoint compares with a sharded one (a DCP save with chunks) name by name.

Verdicts, proven from the manifest and the blobs without loading a tensor:

- **same bytes**: the same blob pieces; or pieces laid out alike whose bytes were read and are
  equal (small values in packs: a pack's digest changes when any of its values does);
- **differs**: dtype, shape, size or value differ; or a pair of chunks filling whole blobs at
  the same place differ in digest (a digest over the same bytes cannot differ); or the bytes
  read differ;
- **not compared**: same dtype and shape, but the bytes lie in pieces that do not line up
  (different sharding) or exceed what one comparison reads (:data:`READ_BUDGET`);
- **only in A** / **only in B**.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ckptstore.web.entries import Piece, TensorRow

SAME = "same bytes"
DIFFERS = "differs"
NOT_COMPARED = "not compared"
ONLY_A = "only in A"
ONLY_B = "only in B"
#: The order a comparison lists its verdicts in: what needs a look first.
ORDER = (DIFFERS, NOT_COMPARED, ONLY_A, ONLY_B, SAME)
#: Raw blob bytes one comparison may read to compare values byte for byte.
READ_BUDGET = 64 << 20

_RANK_SUFFIX = re.compile(r"/rank[0-9]{1,9}$")

#: Whether a piece fills its whole blob (so its digest is the digest of its bytes alone).
Whole = Callable[[Piece], bool]
#: The bytes of some pieces, concatenated; None when reading them would pass the budget.
ReadPieces = Callable[[Sequence[Piece]], bytes | None]


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of a checkpoint: its rows (one, or its shards in several rank
    components), what they hold together, and whether its pieces, concatenated, are its bytes
    in order (``contiguous``). ``shape`` is None for shards of a plain sharded save (the whole
    shape is not recorded)."""

    name: str
    components: tuple[str, ...]
    ranks: tuple[int, ...]
    is_array: bool
    dtype: str
    shape: tuple[int, ...] | None
    nbytes: int
    pieces: tuple[Piece, ...]
    contiguous: bool
    value: Any = None


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """One parameter of either checkpoint, its verdict and why."""

    name: str
    verdict: str
    why: str
    a: Param | None
    b: Param | None


def param_name(row: TensorRow) -> str:
    """The parameter name of a row: a DCP FQN or Megatron key as it is; a plain entry's
    component (without ``/rank<r>``) and path, joined by dots."""
    if row.component in ("dcp", "megatron"):
        return row.name
    component = _RANK_SUFFIX.sub("", row.component)
    path = row.name.replace("/", ".")
    return f"{component}.{path}" if path else component


def params(rows: Sequence[TensorRow]) -> dict[str, Param]:
    """A checkpoint's rows as parameters by name (shards of one name in several plain rank
    components summed, in rank order)."""
    grouped: dict[str, list[TensorRow]] = {}
    for row in rows:
        grouped.setdefault(param_name(row), []).append(row)
    return {name: _param(name, group) for name, group in grouped.items()}


def _param(name: str, group: list[TensorRow]) -> Param:
    group.sort(key=lambda r: (r.ranks, r.component))
    first = group[0]
    pieces = tuple(p for r in group for p in r.pieces)
    if len(group) == 1:
        # A DCP or Megatron shard at the origin is the whole value only if it is the one shard.
        shape: tuple[int, ...] | None = first.shape
        contiguous = all(not any(p.at) for p in pieces)
    else:
        shape, contiguous = None, False
    dtypes = {r.dtype for r in group}
    return Param(
        name,
        tuple(dict.fromkeys(r.component for r in group)),
        tuple(sorted({rank for r in group for rank in r.ranks})),
        first.is_array,
        first.dtype if len(dtypes) == 1 else "mixed",
        shape,
        sum(r.nbytes for r in group),
        pieces,
        contiguous,
        first.value if not first.is_array else None,
    )


def compare(
    a_rows: Sequence[TensorRow], b_rows: Sequence[TensorRow], whole: Whole, read: ReadPieces
) -> list[TensorDiff]:
    """Every parameter of ``a_rows`` and ``b_rows`` with its verdict, differing ones first."""
    a_by, b_by = params(a_rows), params(b_rows)
    diffs = []
    for name in [*a_by, *(n for n in b_by if n not in a_by)]:
        a, b = a_by.get(name), b_by.get(name)
        if a is None or b is None:
            verdict, why = (ONLY_B, "not in A") if a is None else (ONLY_A, "not in B")
        else:
            verdict, why = _verdict(a, b, whole, read)
        diffs.append(TensorDiff(name, verdict, why, a, b))
    diffs.sort(key=lambda d: (ORDER.index(d.verdict), d.name))
    return diffs


def _verdict(a: Param, b: Param, whole: Whole, read: ReadPieces) -> tuple[str, str]:
    if not a.is_array or not b.is_array:
        if a.is_array != b.is_array:
            return DIFFERS, "an array in one, a value in the other"
        return (SAME, "equal value") if a.value == b.value else (DIFFERS, "the value differs")
    if a.dtype != b.dtype:
        return DIFFERS, f"dtype {a.dtype} -> {b.dtype}"
    if a.shape is not None and b.shape is not None and a.shape != b.shape:
        return DIFFERS, f"shape {list(a.shape)} -> {list(b.shape)}"
    if (a.shape is None or b.shape is None) and a.nbytes != b.nbytes:
        return DIFFERS, f"{a.nbytes} -> {b.nbytes} bytes"
    if a.pieces == b.pieces:
        return SAME, "the same blob pieces"
    aligned = [(p.at, p.length) for p in a.pieces] == [(p.at, p.length) for p in b.pieces]
    if aligned:
        pairs = zip(a.pieces, b.pieces, strict=True)
        proof = next(((p, q) for p, q in pairs if p != q and whole(p) and whole(q)), None)
        if proof is not None:
            return DIFFERS, f"chunk {_short(proof[0].digest)} -> {_short(proof[1].digest)}"
    elif not (a.contiguous and b.contiguous):
        return NOT_COMPARED, "stored in shards that do not line up: bytes not compared"
    return _by_bytes(a, b, read)


def _by_bytes(a: Param, b: Param, read: ReadPieces) -> tuple[str, str]:
    """Compare the bytes themselves (pieces that line up, or both whole values in order)."""
    a_bytes = read(a.pieces)
    b_bytes = read(b.pieces) if a_bytes is not None else None
    if a_bytes is None or b_bytes is None:
        budget = READ_BUDGET >> 20
        return NOT_COMPARED, f"bytes not compared: more than the {budget} MiB a comparison reads"
    if a_bytes == b_bytes:
        return SAME, f"equal bytes ({len(a_bytes)} read from each)"
    return DIFFERS, "the bytes differ"


def _short(digest: str) -> str:
    return digest.removeprefix("b3:")[:12]


def counts(diffs: Sequence[TensorDiff]) -> dict[str, int]:
    """How many parameters got each verdict (every verdict listed, in :data:`ORDER`)."""
    return {verdict: sum(d.verdict == verdict for d in diffs) for verdict in ORDER}
