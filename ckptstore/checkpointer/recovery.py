"""Loading from the nearest verified copy (DESIGN.md §13): the newest checkpoint recoverable from
the nodes reachable now, each blob read from this node's tier, else a peer's, else the store.

One query picks the checkpoint (``tiering.newest_recoverable``: local or committed, every blob
in the store or on a reachable node's tier); one more lists where each of its blobs is. The
load then reads through :class:`~ckptstore.tiers.stores.NearestCopies`: every copy is verified
as the reader reads it, and one that is damaged or gone is skipped for the next (and, by a
writer, forgotten). Only when every copy of a blob fails does the checkpoint fail: a blob the
store held too fails as store damage does (``restore.py``: marked corrupt by a writer), one the
tiers alone held makes the checkpoint unrecoverable from here, and the next older recoverable
one is loaded instead -- the same step for every component, never a mix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from ckptstore.cas.blobs import MissingBlobError
from ckptstore.cas.digest import blob_key, digest_from_key
from ckptstore.checkpointer.restore import (
    LoadedCheckpoint,
    Overwritten,
    Reader,
    check_store_holds,
    readable_state,
    report_corrupt,
)
from ckptstore.checkpointer.tiered import Tiers
from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, IntegrityError
from ckptstore.manifest import tiering
from ckptstore.manifest.records import CheckpointInfo
from ckptstore.names import check_step
from ckptstore.tiers.placement import STORE
from ckptstore.tiers.stores import NearestCopies

log = logging.getLogger("ckptstore.tiers")


def newest(
    reader: Reader, tiers: Tiers, *, before_step: int | None = None
) -> CheckpointInfo | None:
    """The newest checkpoint recoverable from the nodes reachable now (or None)."""
    return tiering.newest_recoverable(
        reader.db, reader.key, tiers.reachable(reader.db), before_step=before_step
    )


def load_nearest(
    reader: Reader,
    tiers: Tiers,
    step: int | None,
    *,
    components: Iterable[str] | None = None,
    paths: Mapping[str, Iterable[str]] | None = None,
    fallback: bool = True,
    into: Mapping[str, Any] | None = None,
    atomic: bool = True,
) -> LoadedCheckpoint:
    """``step`` (local or committed), or the newest recoverable checkpoint that verifies;
    ``into`` and ``atomic`` as for :func:`ckptstore.checkpointer.restore.load`."""
    wanted = set(components) if components is not None else None
    reachable = tiers.reachable(reader.db)
    skipped: list[tuple[int, str]] = []
    before: int | None = None
    overwritten = Overwritten(into, wanted, paths, atomic=atomic)
    while True:
        info = _choose(reader, reachable, step, before, skipped)
        nearest = tiers.nearest(tiering.copies_of(reader.db, info.id), reachable, reader.store)
        try:
            near = replace(reader, store=nearest)
            state = readable_state(near, info, wanted, paths, into, atomic=atomic)
        except IntegrityError as exc:
            if step is not None or not fallback:
                raise
            _fail(reader, info, nearest, exc)
            overwritten.failed(nearest, info)
            skipped.append((info.step, str(exc)))
            before = info.step
            continue
        finally:
            _forget_bad(reader, nearest)
        overwritten.check(nearest, reader.name, info)
        read = {("store" if node == STORE else node): n for node, n in nearest.read_from.items()}
        if skipped:
            log.warning("recovered run %r from step %d", reader.name, info.step)
        return LoadedCheckpoint(info, state, tuple(skipped), read)


def _choose(
    reader: Reader,
    reachable: set[str],
    step: int | None,
    before: int | None,
    skipped: list[tuple[int, str]],
) -> CheckpointInfo:
    if step is not None:
        return tiering.recoverable_at(reader.db, reader.key, check_step(step), reachable)
    found = tiering.newest_recoverable(reader.db, reader.key, reachable, before_step=before)
    if found is None:
        detail = f"; skipped steps {[s for s, _ in skipped]}" if skipped else ""
        raise CheckpointNotFoundError(
            f"run {reader.name!r} has no checkpoint recoverable from the object store or the "
            f"tiers of the reachable nodes ({', '.join(sorted(reachable))}){detail}"
        )
    return found


def _fail(
    reader: Reader, info: CheckpointInfo, nearest: NearestCopies, exc: IntegrityError
) -> None:
    """Every copy of a blob failed. If the store's copy was among them, that is the
    checkpoint's damage (as a load from the store would find it); otherwise the tiers alone
    held the blob and this checkpoint cannot be recovered from the nodes reachable now."""
    digest = exc.digest
    tried_store = digest is None or STORE in nearest.sources_of(blob_key(digest))
    if tried_store:
        if isinstance(exc, MissingBlobError):
            check_store_holds(reader, info, exc)
        report_corrupt(reader, info, exc)
        return
    log.error(
        "CHECKPOINT NOT RECOVERABLE: run %r step %d: no good copy of %s is left on the "
        "reachable nodes and the store does not hold it (%s); loading an older checkpoint",
        reader.name,
        info.step,
        digest,
        exc,
    )


def _forget_bad(reader: Reader, nearest: NearestCopies) -> None:
    """A writer forgets the copies the load found damaged or gone; a reader reports them."""
    bad = nearest.bad_copies()
    if not bad:
        return
    if not reader.writable:
        log.error(
            "%d tier copies of run %r are damaged or gone (%s); they were NOT forgotten, "
            "because the run is open read-only: a load by its writer forgets them",
            len(bad),
            reader.name,
            ", ".join(f"{b.key} on {b.node}" for b in bad[:3]),
        )
        return
    try:
        tiering.forget(reader.db, ((_digest(b.key), b.node) for b in bad))
    except CkptStoreError:
        log.exception("could not forget %d bad tier copies of run %r", len(bad), reader.name)


def _digest(key: str) -> str:
    digest = digest_from_key(key)
    assert digest is not None
    return digest
