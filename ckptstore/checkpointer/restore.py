"""Loading a checkpoint: verified reads, fallback past corrupt checkpoints, the store check.

Only proven damage condemns (DESIGN.md §12). A checkpoint whose stored bytes fail their
checksum or digest (``IntegrityError``) is skipped and the previous committed one is tried,
loudly; a writer also marks it corrupt and quarantines the damaged blob, while a read-only
reader changes nothing and says which command would (``ckptstore verify``). Bytes this process
cannot read (``UnreadableError``: an unknown codec or format version, a missing codec
implementation, too little memory) condemn nothing and are no reason to fall back: the error
goes to the caller. A missing blob only condemns a checkpoint when the store is the right one:
if none of the checkpoint's other blobs are there either, the store URL is wrong and nothing
is marked (``StoreNotFoundError``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckptstore.cas.blobs import MissingBlobError, quarantine_blob
from ckptstore.cas.digest import blob_key
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ComponentNotFoundError,
    IntegrityError,
    StoreNotFoundError,
    UnreadableError,
)
from ckptstore.manifest import reading as reads
from ckptstore.manifest import repairing as tx
from ckptstore.manifest.db import Database
from ckptstore.manifest.records import CheckpointInfo, ComponentInfo
from ckptstore.names import check_step
from ckptstore.objectstore import ObjectStore
from ckptstore.serialize.reader import ComponentReader, PlannedLoad, load_components
from ckptstore.serialize.tree import tensor_paths

log = logging.getLogger("ckptstore.checkpointer")


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    """A loaded checkpoint: its record and its state."""

    info: CheckpointInfo
    #: Component name -> its state (or, for a partial load, path -> value).
    state: dict[str, Any]
    #: Newer checkpoints that failed verification on the way: (step, why). A writer marked
    #: them corrupt; a read-only reader left them as they were.
    skipped: tuple[tuple[int, str], ...] = ()
    #: A load through node-local tiers: the bytes read from each node's tier, and from the
    #: object store (``"store"``). Empty for a load from the store alone.
    read_bytes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reader:
    """What loading needs: the manifest, the store and the run."""

    db: Database
    store: ObjectStore
    run_id: int
    name: str
    #: Whether a damaged checkpoint may be marked corrupt and its blob quarantined: only for
    #: a run opened as its writer. A read-only reader reports and changes nothing.
    writable: bool = False

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
    into: Mapping[str, Any] | None = None,
    atomic: bool = True,
) -> LoadedCheckpoint:
    """``step`` (exactly), or the newest committed checkpoint that verifies (see module);
    ``into``: component name -> a state whose tensors are loaded into (``atomic``: once
    every blob of a checkpoint has verified; else in place as the blobs arrive)."""
    wanted = set(components) if components is not None else None
    if step is not None:
        info = reads.committed_at(reader.db, reader.key, check_step(step))
        state = readable_state(reader, info, wanted, paths, into, atomic=atomic)
        return LoadedCheckpoint(info, state)
    skipped: list[tuple[int, str]] = []
    before: int | None = None
    overwritten = Overwritten(into, wanted, paths, atomic=atomic)
    while True:
        found = reads.newest_committed(reader.db, reader.key, before_step=before)
        if found is None:
            detail = f"; skipped corrupt steps {[s for s, _ in skipped]}" if skipped else ""
            raise CheckpointNotFoundError(
                f"run {reader.name!r} has no committed checkpoint to load{detail}"
            )
        try:
            state = readable_state(reader, found, wanted, paths, into, atomic=atomic)
        except IntegrityError as exc:
            if not fallback:
                raise
            if isinstance(exc, MissingBlobError):
                check_store_holds(reader, found, exc)
            report_corrupt(reader, found, exc)
            overwritten.failed(reader.store, found)
            skipped.append((found.step, str(exc)))
            before = found.step
            continue
        overwritten.check(reader.store, reader.name, found)
        return LoadedCheckpoint(found, state, tuple(skipped))


class Overwritten:
    """The tensors of a load's ``into`` that an attempt which failed verification may have
    written, when the load is not atomic (a blob's bytes land in its target as they arrive;
    its digest is checked at its end): the checkpoint a fallback loads must write each of
    them again, or the load fails rather than hand back a target holding bytes that did not
    verify. An atomic load writes no target of an attempt that fails: nothing to track."""

    def __init__(
        self,
        into: Mapping[str, Any] | None,
        wanted: set[str] | None,
        paths: Mapping[str, Iterable[str]] | None,
        *,
        atomic: bool = True,
    ) -> None:
        self._into = {} if atomic else dict(into or {})
        self._wanted, self._paths = wanted, paths
        #: (component, entry path) -> the step whose failed load may have written it.
        self.written: dict[tuple[str, str], int] = {}

    def _planned(self, store: ObjectStore, info: CheckpointInfo) -> set[tuple[str, str]]:
        """The (component, path) targets a load of ``info`` writes."""
        found: set[tuple[str, str]] = set()
        for comp in info.components:
            target = self._into.get(comp.name)
            if target is None or (self._wanted is not None and comp.name not in self._wanted):
                continue
            try:
                entries = {e.path for e in ComponentReader(store, comp.index_digest).entries}
            except CkptStoreError:  # an index that cannot be read: none of its entries loaded
                continue
            if self._paths is not None and comp.name in self._paths:
                entries &= set(self._paths[comp.name])
            found.update((comp.name, path) for path in tensor_paths(target) if path in entries)
        return found

    def failed(self, store: ObjectStore, info: CheckpointInfo) -> None:
        """A load of ``info`` failed verification: what it may have written."""
        if self._into:
            for key in self._planned(store, info):
                self.written.setdefault(key, info.step)

    def check(self, store: ObjectStore, run: str, info: CheckpointInfo) -> None:
        """``info`` loaded: refuse if a target the failed attempts wrote is not written again."""
        if not self.written:
            return
        missing = sorted(set(self.written) - self._planned(store, info))
        if missing:
            (component, path), more = missing[0], len(missing) - 1
            step = self.written[(component, path)]
            also = f" (and {more} more)" if more else ""
            raise IntegrityError(
                f"run {run!r}: step {step} did not verify and step {info.step}, the newest "
                f"checkpoint that does, has no entry {path!r} in component {component!r}{also}: "
                f"the tensor passed for it in into= may hold bytes of step {step} that did not "
                "verify; load it from elsewhere (a step that has it), or leave it out of into="
            )


def readable_state(
    reader: Reader,
    info: CheckpointInfo,
    wanted: set[str] | None,
    paths: Mapping[str, Iterable[str]] | None,
    into: Mapping[str, Any] | None = None,
    *,
    atomic: bool = True,
) -> dict[str, Any]:
    """:func:`load_state`, with what cannot be read here said to change nothing (what every
    load calls, from the store or through the tiers)."""
    try:
        return load_state(reader, info, wanted, paths, into, atomic=atomic)
    except UnreadableError as exc:
        unreadable = UnreadableError(
            f"run {reader.name!r} step {info.step} cannot be read by this process: {exc}. It "
            "is not proven damaged, so it was not marked corrupt, nothing was moved, and no "
            "older checkpoint was loaded in its place"
        )
        unreadable.digest = exc.digest
        raise unreadable from exc


def load_state(
    reader: Reader,
    info: CheckpointInfo,
    wanted: set[str] | None,
    paths: Mapping[str, Iterable[str]] | None,
    into: Mapping[str, Any] | None = None,
    *,
    atomic: bool = True,
) -> dict[str, Any]:
    """The components of ``info`` (all, ``wanted``, or ``paths`` of some), verified; the
    tensors of ``into[component]`` are loaded into (see ``ComponentReader.load``): all
    components' plans are one load, so an atomic one writes no target until every blob of
    every component has verified."""
    comps: Sequence[ComponentInfo] = info.components
    names = {c.name for c in comps}
    for name in [*(wanted or ()), *(paths or {}), *(into or {})]:
        if name not in names:
            raise ComponentNotFoundError(
                f"run {reader.name!r} step {info.step} has no component {name!r}; "
                f"it has {sorted(names)}"
            )
    # The manifest's record of each index's length bounds what a read may allocate.
    sizes = reads.index_lengths(reader.db, [c.index_digest for c in comps])
    plans: dict[str, PlannedLoad] = {}
    for comp in comps:
        if wanted is not None and comp.name not in wanted:
            continue
        context = f"run {reader.name!r}, step {info.step}, component {comp.name!r}"
        size = sizes.get(comp.index_digest)
        component = ComponentReader(
            reader.store, comp.index_digest, context=context, index_len=size
        )
        target = (into or {}).get(comp.name)
        if paths is not None and comp.name in paths:
            plans[comp.name] = component.plan(paths[comp.name], into=target, atomic=atomic)
        elif paths is None or wanted is not None:
            plans[comp.name] = component.plan(into=target, atomic=atomic)
    # Every component's blobs as one load: no pause between one component and the next.
    return dict(zip(plans, load_components(reader.store, list(plans.values())), strict=True))


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


class RunView(Protocol):
    """What :func:`mark_corrupt` needs of a run (a ``Run`` is one)."""

    @property
    def db(self) -> Database:
        """The run's manifest."""

    @property
    def store(self) -> ObjectStore:
        """The run's object store."""

    @property
    def id(self) -> int:
        """The run's id in the manifest."""

    @property
    def name(self) -> str:
        """The run's name."""

    @property
    def writable(self) -> bool:
        """Whether this is the run's writer (it may mark checkpoints corrupt)."""


def mark_corrupt(
    run: RunView, info: CheckpointInfo, error: IntegrityError, *, check_store: bool = True
) -> None:
    """What a load does with a checkpoint of ``run`` that failed verification (public, through
    :mod:`ckptstore.extending`): say so loudly; the run's writer marks it corrupt and quarantines
    the damaged blob, a read-only run changes nothing and names the command that would.

    With ``check_store``, a missing blob first proves the store is the right one: when none of
    the checkpoint's other blobs is there either, ``StoreNotFoundError`` is raised and nothing
    is marked. A caller that must keep other processes in step before raising checks later.
    """
    reader = Reader(run.db, run.store, run.id, run.name, run.writable)
    if check_store and isinstance(error, MissingBlobError):
        check_store_holds(reader, info, error)
    report_corrupt(reader, info, error)


def report_corrupt(reader: Reader, info: CheckpointInfo, exc: IntegrityError) -> None:
    """Say loudly that the checkpoint failed verification and that the previous committed one
    is used instead. A writer marks it corrupt and quarantines its damaged blob; a read-only
    reader changes nothing and names the command that would."""
    if not reader.writable:
        log.error(
            "CHECKPOINT CORRUPT: run %r step %d failed verification (%s); the previous "
            "committed checkpoint is used instead. It was NOT marked corrupt and nothing was "
            "moved, because the run is open read-only: `ckptstore verify %s@%d` (or a load "
            "from the run's writer) marks it and quarantines the damaged blob",
            reader.name,
            info.step,
            exc,
            reader.name,
            info.step,
        )
        return
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
