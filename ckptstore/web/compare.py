"""Which tensors changed between two checkpoints, by content address alone.

No tensor is loaded. Equal pieces (blob digest, offset, length) are equal bytes, so a name
whose pieces all match is **same**. A name is **changed** when its dtype or shape differ, or
when its pieces lie out alike (same shard boxes and lengths) and a pair of them that each fill
a whole blob (a chunk) differ in digest: a digest over the same bytes of a tensor cannot differ
unless the bytes do. Otherwise the verdict is **unknown**: a piece inside a pack shares its
blob with other values (the pack's digest changes when any of them does), and a name stored in
different pieces (chunking or sharding changed) may still hold equal bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ckptstore.web.entries import Piece, TensorRow

SAME = "same"
CHANGED = "changed"
UNKNOWN = "unknown"
ONLY_A = "only in A"
ONLY_B = "only in B"
#: The order a comparison lists its verdicts in: what needs a look first.
ORDER = (CHANGED, UNKNOWN, ONLY_A, ONLY_B, SAME)

#: Whether a piece fills its whole blob (so its digest is the digest of its bytes alone).
Whole = Callable[[Piece], bool]


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """One name of either checkpoint, its verdict and why."""

    component: str
    name: str
    verdict: str
    why: str
    a: TensorRow | None
    b: TensorRow | None


def compare(
    a_rows: Sequence[TensorRow], b_rows: Sequence[TensorRow], whole: Whole
) -> list[TensorDiff]:
    """Every name of ``a_rows`` and ``b_rows`` with its verdict, changed ones first."""
    a_by = {(r.component, r.name): r for r in a_rows}
    b_by = {(r.component, r.name): r for r in b_rows}
    diffs = []
    for key in [*a_by, *(k for k in b_by if k not in a_by)]:
        a, b = a_by.get(key), b_by.get(key)
        if a is None or b is None:
            verdict, why = (ONLY_B, "not in A") if a is None else (ONLY_A, "not in B")
        else:
            verdict, why = _verdict(a, b, whole)
        diffs.append(TensorDiff(key[0], key[1], verdict, why, a, b))
    diffs.sort(key=lambda d: (ORDER.index(d.verdict), d.component, d.name))
    return diffs


def _verdict(a: TensorRow, b: TensorRow, whole: Whole) -> tuple[str, str]:
    if a.kind != b.kind or a.dtype != b.dtype or a.shape != b.shape:
        return CHANGED, (f"{a.kind} {a.dtype}{list(a.shape)} -> {b.kind} {b.dtype}{list(b.shape)}")
    if not a.is_array:
        return (SAME, "equal value") if a.value == b.value else (CHANGED, "the value differs")
    if a.pieces == b.pieces:
        return SAME, "same blob pieces"
    if [(p.at, p.length) for p in a.pieces] != [(p.at, p.length) for p in b.pieces]:
        return UNKNOWN, "stored in different pieces (chunking or sharding changed)"
    differing = [(p, q) for p, q in zip(a.pieces, b.pieces, strict=True) if p != q]
    proof = next(((p, q) for p, q in differing if whole(p) and whole(q)), None)
    if proof is not None:
        return CHANGED, f"chunk {_short(proof[0].digest)} -> {_short(proof[1].digest)}"
    return UNKNOWN, "packed with other values whose pack changed"


def _short(digest: str) -> str:
    return digest.removeprefix("b3:")[:12]


def counts(diffs: Sequence[TensorDiff]) -> dict[str, int]:
    """How many names got each verdict (every verdict listed, in :data:`ORDER`)."""
    return {verdict: sum(d.verdict == verdict for d in diffs) for verdict in ORDER}
