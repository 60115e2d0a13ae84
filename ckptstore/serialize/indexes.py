"""A component's index, fetched and decoded without torch: what a listing needs (``ckptstore
show --entries``, a format's state-dict listing) and what :class:`~ckptstore.serialize.reader.
ComponentReader` builds on before it reads any tensor."""

from __future__ import annotations

from ckptstore.cas.blobs import get_blob
from ckptstore.cas.header import MAX_RAW_LEN, Kind
from ckptstore.errors import IntegrityError
from ckptstore.objectstore.base import ObjectStore
from ckptstore.serialize.index import ComponentIndex, decode_index

#: The largest index blob a load accepts (an index of a million entries is ~200 MiB).
MAX_INDEX_BYTES = 1 << 30


def fetch_index(
    store: ObjectStore, index_digest: str, *, context: str = "", index_len: int | None = None
) -> ComponentIndex:
    """The index blob ``index_digest``: fetched, verified and decoded. ``context`` (run, step,
    component) goes into every error message; ``index_len`` is the index's raw length as the
    manifest recorded it, when known (a blob declaring more is damaged)."""
    where = f"index {index_digest}" + (f" ({context})" if context else "")
    # The manifest's length is evidence about the blob (a header declaring more is
    # damaged); MAX_INDEX_BYTES is only this reader's cap (more is unreadable here).
    header, raw = get_blob(
        store,
        index_digest,
        context=f"{context}, index" if context else "index",
        max_raw_len=MAX_RAW_LEN if index_len is None else index_len,
        limit=MAX_INDEX_BYTES,
    )
    if header.kind is not Kind.INDEX:
        raise IntegrityError(f"{where}: blob is a {header.kind.name.lower()}, not an index")
    return decode_index(raw, where)
