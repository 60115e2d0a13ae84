"""Loading a checkpoint: verified reads, fallback past corrupt checkpoints, the store check.

A checkpoint that fails verification is marked corrupt (its damaged blob quarantined) and the
previous committed one is tried, loudly. A missing blob only condemns a checkpoint when the
store is the right one: if none of the checkpoint's other blobs are there either, the store URL
is wrong and nothing is marked (``StoreNotFoundError``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptstore.cas.blobs import MissingBlobError, quarantine_blob
from ckptstore.cas.digest import blob_key
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ComponentNotFoundError,
    IntegrityError,
    StoreNotFoundError,
)
from ckptstore.manifest import reads
from ckptstore.manifest import transactions as tx
from ckptstore.manifest.db import Database
from ckptstore.manifest.records import CheckpointInfo, ComponentInfo
from ckptstore.names import check_step
from ckptstore.objectstore import ObjectStore
from ckptstore.serialize.reader import ComponentReader

log = logging.getLogger("ckptstore.checkpointer")


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    """A loaded checkpoint: its record and its state."""

    info: CheckpointInfo
    #: Component name -> its state (or, for a partial load, path -> value).
    state: dict[str, Any]
    #: Newer checkpoints that failed verification and were marked corrupt on the way.
    skipped: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Reader:
    """What loading needs: the manifest, the store and the run."""

    db: Database
    store: ObjectStore
    run_id: int
    name: str

    @property
    def key(self) -> tuple[int, str]:
        """(run id, run name), as the manifest reads take it."""
        return self.run_id, self.name


def load(
    reader: Reader,
    step: int | None,
    *,
    components: Iterable[str] | None = None,
    paths: Mapping[str, Iterable[str]] | None = None,
    fallback: bool = True,
) -> LoadedCheckpoint:
    """``step`` (exactly), or the newest committed checkpoint that verifies (see module)."""
    wanted = set(components) if components is not None else None
    if step is not None:
        info = reads.committed_at(reader.db, reader.key, check_step(step))
        return LoadedCheckpoint(info, load_state(reader, info, wanted, paths))
    skipped: list[tuple[int, str]] = []
    before: int | None = None
    while True:
        found = reads.newest_committed(reader.db, reader.key, before_step=before)
        if found is None:
            detail = f"; skipped corrupt steps {[s for s, _ in skipped]}" if skipped else ""
            raise CheckpointNotFoundError(
                f"run {reader.name!r} has no committed checkpoint to load{detail}"
            )
        try:
            state = load_state(reader, found, wanted, paths)
        except IntegrityError as exc:
            if not fallback:
                raise
            if isinstance(exc, MissingBlobError):
                check_store_holds(reader, found, exc)
            mark_corrupt(reader, found, exc)
            skipped.append((found.step, str(exc)))
            before = found.step
            continue
        return LoadedCheckpoint(found, state, tuple(skipped))


def load_state(
    reader: Reader,
    info: CheckpointInfo,
    wanted: set[str] | None,
    paths: Mapping[str, Iterable[str]] | None,
) -> dict[str, Any]:
    """The components of ``info`` (all, ``wanted``, or ``paths`` of some), verified."""
    comps: Sequence[ComponentInfo] = info.components
    names = {c.name for c in comps}
    for name in [*(wanted or ()), *(paths or {})]:
        if name not in names:
            raise ComponentNotFoundError(
                f"run {reader.name!r} step {info.step} has no component {name!r}; "
                f"it has {sorted(names)}"
            )
    # The manifest's record of each index's length bounds what a read may allocate.
    sizes = reads.index_lengths(reader.db, [c.index_digest for c in comps])
    state: dict[str, Any] = {}
    for comp in comps:
        if wanted is not None and comp.name not in wanted:
            continue
        context = f"run {reader.name!r}, step {info.step}, component {comp.name!r}"
        size = sizes.get(comp.index_digest)
        component = ComponentReader(
            reader.store, comp.index_digest, context=context, index_len=size
        )
        if paths is not None and comp.name in paths:
            state[comp.name] = component.load_paths(paths[comp.name])
        elif paths is None or wanted is not None:
            state[comp.name] = component.load()
    return state


def check_store_holds(reader: Reader, info: CheckpointInfo, exc: MissingBlobError) -> None:
    """A missing blob makes a checkpoint corrupt only if the store is the right one: when none
    of the checkpoint's other blobs are there either, the store URL is wrong (an empty
    directory, another prefix), and marking anything corrupt would condemn good data."""
    others = [c.index_digest for c in info.components] + reads.some_digests(
        reader.db, info.id, limit=16
    )
    others = list(dict.fromkeys(d for d in others if d != exc.digest))
    if not others or any(reader.store.exists(blob_key(d)) for d in others):
        return
    raise wrong_store(
        reader.store,
        f"{exc}; none of the other {len(others)} blobs of run {reader.name!r} step {info.step} "
        "that were looked for exist there either",
    ) from exc


def wrong_store(store: ObjectStore, finding: str) -> StoreNotFoundError:
    """The one verdict for "the store URL is probably wrong" (load and verify): ``finding``
    says what was missing; nothing is marked corrupt because of it."""
    return StoreNotFoundError(
        f"{finding} ({store.url}). Is the store URL right (--store, CKPTSTORE_STORE, the bucket "
        "and prefix)? Nothing was marked corrupt."
    )


def mark_corrupt(reader: Reader, info: CheckpointInfo, exc: IntegrityError) -> None:
    """Mark the checkpoint corrupt and quarantine its damaged blob; say so loudly."""
    log.error(
        "CHECKPOINT CORRUPT: run %r step %d failed verification (%s); it is marked corrupt "
        "and the previous committed checkpoint is used instead",
        reader.name,
        info.step,
        exc,
    )
    digests = [exc.digest] if exc.digest is not None else []
    try:
        tx.mark_corrupt(
            reader.db, info.id, str(exc), digests, lambda d: quarantine(reader.store, d)
        )
    except Exception:
        log.exception("could not mark checkpoint %d corrupt", info.id)


def quarantine(store: ObjectStore, digest: str) -> None:
    """Move a damaged object aside (best effort: a failure is logged, not raised)."""
    try:
        quarantine_blob(store, digest)
    except CkptStoreError:
        log.exception("could not quarantine damaged blob %s", blob_key(digest))
