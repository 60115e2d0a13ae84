"""The compare page's record: two checkpoints' parameters side by side (:mod:`.compare` gives
the verdicts), a page of them filtered and sorted as the query asks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptstore.errors import CkptStoreError
from ckptstore.manifest import serving as webqueries
from ckptstore.manifest.records import CheckpointInfo
from ckptstore.web.compare import ORDER, READ_BUDGET, TensorDiff, compare, counts
from ckptstore.web.data import Site, find_checkpoint, tensor_table
from ckptstore.web.entries import Piece
from ckptstore.web.listing import PageInfo, Slice, take

#: How the compare page sorts its parameters (``?sort=KEY``).
COMPARE_SORTS = {
    "verdict": lambda d: ORDER.index(d.verdict),
    "name": lambda d: d.name,
    "bytes": lambda d: max(p.nbytes for p in (d.a, d.b) if p is not None),
    "dtype": lambda d: (d.a or d.b).dtype,
}
COMPARE_DEFAULT_SORT = "verdict"


@dataclass(frozen=True, slots=True)
class CompareView:
    """Two checkpoints' parameters side by side: the count of each verdict over all of them,
    and the page of them (``diffs``) the query asked for (``entries`` says which)."""

    a: CheckpointInfo
    b: CheckpointInfo
    counts: dict[str, int]
    diffs: list[TensorDiff]
    entries: PageInfo | None
    verdict: str | None
    error: str | None


class PieceReader:
    """Reads pieces' bytes from the store for a comparison, each blob once, at most
    ``budget`` raw bytes of blobs in all."""

    def __init__(self, site: Site, facts: dict[str, webqueries.BlobFact], budget: int) -> None:
        """A reader over ``site``'s store; ``facts`` are the blobs' rows (their sizes)."""
        self._site = site
        self._facts = facts
        self._left = budget
        self._blobs: dict[str, bytes] = {}

    def __call__(self, pieces: Sequence[Piece]) -> bytes | None:
        """The pieces' bytes, concatenated; None if they need more than the budget left."""
        needed = {p.digest for p in pieces if p.digest not in self._blobs}
        cost = 0
        for digest in needed:
            fact = self._facts.get(digest)
            if fact is None:
                return None
            cost += fact.logical_bytes
        if cost > self._left:
            return None
        self._left -= cost
        from ckptstore.cas.blobs import get_blob  # numpy and zstandard: only when reading

        for digest in needed:
            _, raw = get_blob(self._site.store(), digest, context="compare")
            self._blobs[digest] = bytes(raw)
        return b"".join(self._blobs[p.digest][p.offset : p.offset + p.length] for p in pieces)


def compare_view(
    site: Site,
    a_id: int,
    b_id: int,
    where: Slice | None = None,
    verdict: str | None = None,
) -> CompareView:
    """What changed from checkpoint ``a_id`` to ``b_id``, parameter by parameter; the page
    ``where`` asks for, of the parameters with ``verdict`` (all for None)."""
    a, b = find_checkpoint(site, a_id), find_checkpoint(site, b_id)
    a_rows, a_error = tensor_table(site, a)
    b_rows, b_error = tensor_table(site, b)
    error = a_error or b_error
    if error:
        return CompareView(a, b, {}, [], None, verdict, error)
    with site.db.connect() as conn:
        facts = webqueries.blob_facts(
            conn, [p.digest for r in (*a_rows, *b_rows) for p in r.pieces]
        )

    def whole(piece: Piece) -> bool:
        fact = facts.get(piece.digest)
        return fact is not None and piece.offset == 0 and piece.length == fact.logical_bytes

    try:
        diffs = compare(a_rows, b_rows, whole, PieceReader(site, facts, READ_BUDGET))
    except CkptStoreError as exc:  # a blob that cannot be read: the page says why
        return CompareView(a, b, {}, [], None, verdict, str(exc))
    chosen = [d for d in diffs if verdict is None or d.verdict == verdict]
    where = where or Slice("", COMPARE_DEFAULT_SORT, 1)
    shown, entries = take(chosen, where, lambda d: d.name, COMPARE_SORTS)
    return CompareView(a, b, counts(diffs), shown, entries, verdict, None)
