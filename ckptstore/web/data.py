"""What each page shows, as records: the JSON API returns them as they are (``/api/...``) and
the HTML pages render them (:mod:`ckptstore.web.pages`).

Everything is read through the manifest's read functions (:mod:`ckptstore.manifest.reading`,
:mod:`~ckptstore.manifest.reporting`, :mod:`~ckptstore.manifest.serving`) on a database
opened read-only, and, for state-dict names only, the component indexes in the store. The
records inside are the CLI's: a run's summary is ``ckptstore runs --json``'s, a checkpoint
``ckptstore ls --json``'s and ``show --json``'s (with its durability and replica count:
:mod:`ckptstore.web.durability`), usage ``ckptstore du --json``'s.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, ConfigError
from ckptstore.maintenance.usage import DiskUsage, disk_usage
from ckptstore.manifest import reading as reads
from ckptstore.manifest import reporting as reports
from ckptstore.manifest import serving as webqueries
from ckptstore.manifest import step_metrics
from ckptstore.manifest.db import Database
from ckptstore.manifest.records import CheckpointInfo, RunInfo
from ckptstore.manifest.reporting import RunSummary
from ckptstore.manifest.serving import (
    BlobKindUsage,
    DamagedBlob,
    GcPreview,
    KindUsage,
    Lineage,
    SavePoint,
)
from ckptstore.manifest.statuses import Status
from ckptstore.web import commands
from ckptstore.web.durability import CheckpointRecord, records
from ckptstore.web.entries import IndexCache, TensorRow, layout_of, tensor_rows
from ckptstore.web.fate import Fate, fates, metric_value, policy_of, ranked_by_metric
from ckptstore.web.listing import PageInfo, Slice, sized, take

if TYPE_CHECKING:
    from ckptstore.objectstore import ObjectInfo, ObjectStore

PER_PAGE = 100
#: The config key whose value (an http or https URL) links a run to its metrics tracker.
TRACKER_KEY = "tracker_url"
#: The grace the storage page's gc preview assumes (``ckptstore gc``'s default).
GC_GRACE = dt.timedelta(hours=6)
_MAX_LISTED = 200


class Site:
    """What the pages read: the read-only database, the store (opened on first use, only for
    component indexes and the quarantine listing) and the index cache."""

    def __init__(self, db: Database, store_location: str, *, db_label: str) -> None:
        """Pages over ``db`` and the store at ``store_location``; ``db_label`` is the
        database as the copyable commands name it (password masked)."""
        self.db = db
        self.store_location = store_location
        self.db_label = db_label
        self.indexes = IndexCache(self.store)
        self._store: ObjectStore | None = None
        self._lock = threading.Lock()

    def store(self) -> ObjectStore:
        """The object store, opened read-only on first use (never created)."""
        with self._lock:
            if self._store is None:
                from ckptstore.objectstore import open_store  # boto3 for S3: only when needed

                self._store = open_store(self.store_location, create=False)
            return self._store

    def close(self) -> None:
        """Close the store and the database."""
        with self._lock:
            if self._store is not None:
                self._store.close()
        self.db.close()


# -- runs and lineage ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunRow:
    """One run of the runs page: ``ckptstore runs``'s summary, counts per status, its parent."""

    summary: RunSummary
    counts: dict[str, int]
    lineage: Lineage


@dataclass(frozen=True, slots=True)
class RunsView:
    """The runs page: every run whose name contains ``query`` (all for "")."""

    runs: list[RunRow]
    query: str
    changes: str


def runs_view(site: Site, query: str = "") -> RunsView:
    """The runs page."""
    summaries = reports.run_summaries(site.db)
    with site.db.connect() as conn:
        tallies = webqueries.status_counts(conn)
        lines = {line.run: line for line in webqueries.lineage(conn)}
    by_run: dict[str, dict[str, int]] = {}
    for tally in tallies:
        by_run.setdefault(tally.run, {})[tally.status] = tally.count
    rows = [
        RunRow(s, by_run.get(s.run, {}), lines.get(s.run) or Lineage(s.run, None, None, None, None))
        for s in summaries
        if query.casefold() in s.run.casefold()
    ]
    return RunsView(rows, query, fingerprint(tallies))


def lineage_view(site: Site) -> list[Lineage]:
    """Every run and where it was forked from."""
    with site.db.connect() as conn:
        return webqueries.lineage(conn)


def fingerprint(tallies: Sequence[webqueries.StatusCount]) -> str:
    """A short digest of checkpoint counts: it changes when a save begins, commits or fails,
    or retention deletes one (what a page polls for)."""
    text = ";".join(f"{t.run}|{t.status}|{t.count}|{t.newest_id}" for t in tallies)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def changes(site: Site, run: str | None) -> str:
    """The fingerprint of one run's checkpoints (or of all runs')."""
    run_id = None if run is None else reads.require_run(site.db, run).id
    with site.db.connect() as conn:
        return fingerprint(webqueries.status_counts(conn, run_id))


# -- one run -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    """A checkpoint of the run page's table (``ckptstore ls --json``'s record) and its fate."""

    checkpoint: CheckpointRecord
    fate: Fate


@dataclass(frozen=True, slots=True)
class Best:
    """The run's best committed checkpoint by its metric, as retention ranks them."""

    checkpoint_id: int
    step: int
    value: float | None


@dataclass(frozen=True, slots=True)
class RunView:
    """The run page, its table at ``page`` (of ``pages``, newest first, in ``status``)."""

    run: RunInfo
    counts: dict[str, int]
    latest_step: int | None
    best: Best | None
    lineage: Lineage
    forks: list[Lineage]
    tracker_url: str | None
    metrics: list[str]
    #: The metrics logged per step (``/api/runs/NAME/steps`` has their curves).
    step_metrics: list[str]
    checkpoints: list[CheckpointRow]
    page: int
    pages: int
    status: str | None
    changes: str


class HistoryPoint(NamedTuple):
    """A checkpoint as the run page's charts plot it (one per checkpoint: a named tuple, as
    :class:`~ckptstore.manifest.serving.SavePoint`)."""

    point: SavePoint
    fate: Fate


def run_view(site: Site, name: str, *, page: int = 1, status: str | None = None) -> RunView:
    """The run page's facts and table (its history: :func:`run_history`)."""
    return run_page(site, name, page=page, status=status)[0]


def run_page(
    site: Site, name: str, *, page: int = 1, status: str | None = None
) -> tuple[RunView, list[HistoryPoint]]:
    """The run page: its facts and table, and every checkpoint for the charts (one read of
    the history serves both)."""
    run = reads.require_run(site.db, name)
    if status is not None and status not in set(Status):
        raise ConfigError(f"unknown status {status!r}: use one of {', '.join(Status)}")
    if page < 1:
        raise ConfigError(f"page {page} does not exist: pages start at 1")
    with site.db.connect() as conn:
        tallies = webqueries.status_counts(conn, run.id)
        every = webqueries.history(conn, run.id)
        rows = webqueries.checkpoint_page(
            conn,
            run.id,
            run.name,
            limit=PER_PAGE,
            offset=(page - 1) * PER_PAGE,
            statuses=None if status is None else [status],
        )
        lines = webqueries.lineage(conn)
        stepped = step_metrics.metric_names(conn, run.id)
    fate = fates(every, run.metric_name, run.higher_is_better, policy_of(run.config))
    tally = {t.status: t.count for t in tallies}
    total = tally.get(status, 0) if status else sum(tally.values())
    own = {p.id for p in every}
    view = RunView(
        run=run,
        counts=tally,
        latest_step=max((p.step for p in every if p.status == Status.COMMITTED), default=None),
        best=best_of(every, run.metric_name, run.higher_is_better),
        lineage=next(
            (ln for ln in lines if ln.run == run.name), Lineage(run.name, None, None, None, None)
        ),
        forks=[ln for ln in lines if ln.parent_checkpoint_id in own],
        tracker_url=tracker_url(run.config),
        metrics=metric_names(every, run.metric_name, stepped),
        step_metrics=stepped,
        checkpoints=[CheckpointRow(c, fate[c.info.id]) for c in records(site.db, rows)],
        page=page,
        pages=max(1, math.ceil(total / PER_PAGE)),
        status=status,
        changes=fingerprint(tallies),
    )
    return view, [HistoryPoint(p, fate[p.id]) for p in every]


def run_history(site: Site, name: str) -> list[HistoryPoint]:
    """Every checkpoint of the run with its fate, oldest first (what the charts plot)."""
    run = reads.require_run(site.db, name)
    with site.db.connect() as conn:
        every = webqueries.history(conn, run.id)
    fate = fates(every, run.metric_name, run.higher_is_better, policy_of(run.config))
    return [HistoryPoint(p, fate[p.id]) for p in every]


def best_of(points: Sequence[SavePoint], metric: str | None, higher_is_better: bool) -> Best | None:
    """The best committed checkpoint by ``metric`` (None without a metric or a committed one)."""
    committed = [p for p in points if p.status == Status.COMMITTED]
    if metric is None or not committed:
        return None
    top = ranked_by_metric(committed, metric, higher_is_better, None)[0]
    return Best(top.id, top.step, metric_value(top.metrics, metric))


def tracker_url(config: dict[str, Any] | None) -> str | None:
    """The run's tracker page (``config["tracker_url"]``), if it is an http(s) URL."""
    value = (config or {}).get(TRACKER_KEY)
    if isinstance(value, str) and value.lower().startswith(("https://", "http://")):
        return value
    return None


def metric_names(
    points: Sequence[SavePoint], first: str | None, stepped: Sequence[str] = (), limit: int = 12
) -> list[str]:
    """Names of the numeric metrics the checkpoints recorded, and of those ``stepped`` (logged
    per step): the run's metric first."""
    names: set[str] = set(stepped)
    for p in points:
        for key, value in (p.metrics or {}).items():
            if key not in names and isinstance(value, int | float) and not isinstance(value, bool):
                names.add(key)
    ordered = sorted(names - {first}) if first in names else sorted(names)
    return ([first] if first in names else []) + ordered[: limit - (first in names)]


# -- one checkpoint --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckpointView:
    """The checkpoint page: ``ckptstore show --json``'s record, its run, its fate, its
    state-dict names (or why they could not be read), its lineage and how to use it."""

    checkpoint: CheckpointRecord
    run: RunInfo
    fate: Fate
    layout: str
    #: The page of state-dict names the query asked for (``entries`` says which).
    tensors: list[TensorRow]
    entries: PageInfo | None
    tensors_error: str | None
    ancestry: list[Lineage]
    forks: list[Lineage]
    previous_id: int | None
    commands: list[str]


#: How the checkpoint page sorts its state-dict names (``?sort=KEY``).
TENSOR_SORTS = {
    "name": lambda r: r.name,
    "component": lambda r: r.component,
    "kind": lambda r: r.kind,
    "dtype": lambda r: r.dtype,
    "shape": lambda r: r.shape,
    "bytes": lambda r: r.nbytes,
    "stored": lambda r: sized(r.stored_bytes),
    "ranks": lambda r: r.ranks,
}
#: The checkpoint page's order without ``?sort=``: as saved.
TENSOR_DEFAULT_SORT = "component"


def checkpoint_view(
    site: Site, checkpoint_id: int, *, tensors: bool = True, where: Slice | None = None
) -> CheckpointView:
    """The checkpoint page (``tensors=False``: without reading the store), its state-dict
    names filtered, sorted and paged as ``where`` asks (default: the first page)."""
    info = find_checkpoint(site, checkpoint_id)
    run = reads.require_run(site.db, info.run)
    with site.db.connect() as conn:
        # Its fate needs the committed ones only (the ranks retention keeps by).
        every = webqueries.history(conn, run.id, [Status.COMMITTED])
        lines = webqueries.lineage(conn)
    own = SavePoint(**{name: getattr(info, name) for name in SavePoint._fields})
    if info.status != Status.COMMITTED:
        every.append(own)
    fate = fates(every, run.metric_name, run.higher_is_better, policy_of(run.config))[info.id]
    rows, error = tensor_table(site, info) if tensors else ([], None)
    where = where or Slice("", TENSOR_DEFAULT_SORT, 1)
    shown, entries = (
        take(rows, where, lambda r: r.name, TENSOR_SORTS) if tensors and not error else ([], None)
    )
    earlier = [
        p for p in every if p.status == Status.COMMITTED and (p.step, p.id) < (info.step, info.id)
    ]
    return CheckpointView(
        checkpoint=records(site.db, [info])[0],
        run=run,
        fate=fate,
        layout=layout_of(info.components),
        tensors=shown,
        entries=entries,
        tensors_error=error,
        ancestry=ancestry(lines, run.name),
        forks=[ln for ln in lines if ln.parent_checkpoint_id == info.id],
        previous_id=earlier[-1].id if earlier else None,
        commands=commands.for_checkpoint(
            info, layout_of(info.components), site.db_label, site.store_location
        ),
    )


def find_checkpoint(site: Site, checkpoint_id: int) -> CheckpointInfo:
    """The checkpoint with this id (any status), or CheckpointNotFoundError."""
    info = reads.checkpoint(site.db, checkpoint_id)
    if info is None:
        raise CheckpointNotFoundError(f"no checkpoint with id {checkpoint_id}")
    return info


def ancestry(lines: Sequence[Lineage], run: str) -> list[Lineage]:
    """The run's line back to its root: the run, its parent run, ... (a cycle stops it)."""
    by_run = {ln.run: ln for ln in lines}
    chain: list[Lineage] = []
    current = by_run.get(run)
    while current is not None and current not in chain:
        chain.append(current)
        current = by_run.get(current.parent_run) if current.parent_run else None
    return chain


def tensor_table(site: Site, info: CheckpointInfo) -> tuple[list[TensorRow], str | None]:
    """The checkpoint's state-dict names with stored sizes and codecs, or why they could not be
    read (the store is unreachable, an index is damaged): the page shows the manifest anyway."""
    try:
        rows = tensor_rows(
            info.components,
            lambda comp: site.indexes.get(comp.index_digest, f"component {comp.name!r}"),
        )
    except CkptStoreError as exc:
        return [], str(exc)
    with site.db.connect() as conn:
        facts = webqueries.blob_facts(conn, [p.digest for r in rows for p in r.pieces])
    return [with_sizes(row, facts) for row in rows], None


def with_sizes(row: TensorRow, facts: dict[str, webqueries.BlobFact]) -> TensorRow:
    """``row`` with its share of its blobs' stored bytes and their codecs."""
    stored, known, codecs = 0.0, True, set()
    for piece in row.pieces:
        fact = facts.get(piece.digest)
        if fact is None or fact.logical_bytes <= 0:
            known = known and fact is not None and piece.length == 0
            continue
        stored += fact.stored_bytes * piece.length / fact.logical_bytes
        if fact.codec:
            codecs.add(fact.codec)
    return TensorRow(
        row.component,
        row.name,
        row.kind,
        row.dtype,
        row.shape,
        row.nbytes,
        row.ranks,
        row.pieces,
        row.value,
        round(stored) if known else None,
        tuple(sorted(codecs)),
    )


# -- storage ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StorageView:
    """The storage page: ``ckptstore du``'s usage, bytes per component and blob kind, what
    gc would do, and the damage found so far."""

    usage: DiskUsage
    kinds: list[KindUsage]
    blob_kinds: list[BlobKindUsage]
    gc: GcPreview
    corrupt: list[CheckpointInfo]
    damaged: list[DamagedBlob]
    quarantined: list[ObjectInfo]
    quarantine_error: str | None


def storage_view(site: Site) -> StorageView:
    """The storage page."""
    usage = DiskUsage.of(*disk_usage(site.db))
    now = dt.datetime.now(dt.UTC)
    with site.db.connect() as conn:
        kinds = webqueries.kind_usage(conn)
        blob_kinds = webqueries.blob_kind_usage(conn)
        gc = webqueries.gc_preview(conn, GC_GRACE, now)
        damaged = webqueries.damaged_blobs(conn, limit=_MAX_LISTED)
    corrupt = reads.targets(site.db, run=None, step=None, status=Status.CORRUPT)[:_MAX_LISTED]
    quarantined, error = quarantine_listing(site)
    return StorageView(usage, kinds, blob_kinds, gc, corrupt, damaged, quarantined, error)


def quarantine_listing(site: Site) -> tuple[list[ObjectInfo], str | None]:
    """Up to 200 objects under ``quarantine/`` (damaged blobs moved aside), or why the store
    could not list them."""
    found: list[ObjectInfo] = []
    try:
        for info in site.store().list("quarantine/"):
            found.append(info)
            if len(found) >= _MAX_LISTED:
                break
    except CkptStoreError as exc:
        return found, str(exc)
    return found, None
