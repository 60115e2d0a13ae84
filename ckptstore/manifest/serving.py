"""What ``ckptstore serve`` reads: a manifest database that cannot write, and the statements its
pages need beyond :mod:`ckptstore.manifest.reading` and :mod:`ckptstore.manifest.reporting`.

:func:`open_readonly` opens the database the way ``ckptstore sql`` runs a query
(:mod:`ckptstore.manifest.readonly`), so a wrong handler cannot write either:

- SQLite: every connection is ``query_only`` with an authorizer that allows reads, functions,
  ``BEGIN``/``ROLLBACK`` and the schema pragmas SQLAlchemy reads (``table_info``...) only;
- PostgreSQL: every connection becomes ``ckptstore_reader`` (``SET ROLE``, checked as
  ``ckptstore sql`` checks it: a superuser login is refused unless allowed), with read-only
  transactions and a statement timeout.

The statements run on SQLAlchemy Core over the light tables of
:mod:`ckptstore.manifest._sql.tables` (no ORM), each filling the dataclass declared next to it.
Unlike the other operation modules, each takes the connection a page opened
(:meth:`Database.connect <ckptstore.manifest.db.Database.connect>`), so that one page reads one
snapshot of the manifest.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import Text, and_, event, exists, func, select, type_coerce
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from ckptstore.manifest._sql import lookups
from ckptstore.manifest._sql.tables import (
    BATCH,
    blobs,
    checkpoint_blobs,
    checkpoints,
    components,
    runs,
)
from ckptstore.manifest.db import Database
from ckptstore.manifest.readonly.pg_role import READER_ROLE, become_reader
from ckptstore.manifest.records import CheckpointInfo, field_names
from ckptstore.manifest.statuses import BlobState, Status

#: What the SQLite authorizer allows: reads, and calls of functions but those below.
_SQLITE_READS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)
#: Functions no statement may call: loading code, or handing SQLite a pointer.
_DENIED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer"})
#: Pragmas that only describe the schema; SQLAlchemy reads ``table_info`` to check it.
_SCHEMA_PRAGMAS = frozenset(
    {"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo", "foreign_key_list"}
)
#: Transaction statements a read needs (SQLAlchemy begins and rolls back every read).
_READ_TRANSACTIONS = frozenset({"BEGIN", "ROLLBACK"})
#: How long one statement of the server may run on PostgreSQL.
_STATEMENT_TIMEOUT_MS = 30_000


# -- the read-only database -------------------------------------------------------------------


def open_readonly(location: str | None, *, allow_superuser: bool = False) -> Database:
    """The manifest database at ``location`` (None: the default), opened so that no
    statement can write; it must exist and be at this ckptstore's schema.

    Raises :class:`~ckptstore.errors.ConfigError` for a missing database, and on PostgreSQL for
    a superuser login (unless ``allow_superuser``) or a login that cannot become
    ``ckptstore_reader``.
    """
    db = Database(location, check_schema=False, create=False)
    try:
        if db.is_sqlite:
            event.listen(db.engine, "connect", _sqlite_read_only)
        else:
            listener = functools.partial(_postgres_read_only, allow_superuser=allow_superuser)
            event.listen(db.engine, "connect", listener)
        db.ensure_schema()
    except BaseException:
        db.close()
        raise
    return db


def _sqlite_read_only(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    # Runs after Database's own connect listener (busy timeout, foreign keys), which needs
    # pragmas this authorizer refuses.
    dbapi_conn.execute("PRAGMA query_only = ON")
    dbapi_conn.set_authorizer(_engine_reads_only)


def _engine_reads_only(action: int, arg1: str | None, arg2: str | None, *_rest: object) -> int:
    """The authorizer of ``ckptstore sql`` (reads and harmless functions only: no write, no
    ATTACH, no pragma that changes anything), plus what SQLAlchemy's reads need: ``BEGIN``,
    ``ROLLBACK`` and the schema pragmas."""
    if action == sqlite3.SQLITE_TRANSACTION:
        allowed = (arg1 or "").upper() in _READ_TRANSACTIONS
    elif action == sqlite3.SQLITE_PRAGMA:
        allowed = (arg1 or "").lower() in _SCHEMA_PRAGMAS
    elif action == sqlite3.SQLITE_FUNCTION:
        allowed = (arg2 or "").lower() not in _DENIED_FUNCTIONS
    else:
        allowed = action in _SQLITE_READS
    return sqlite3.SQLITE_OK if allowed else sqlite3.SQLITE_DENY


def _postgres_read_only(dbapi_conn: Any, _record: Any, *, allow_superuser: bool) -> None:
    dbapi_conn.read_only = True  # psycopg: every transaction BEGIN READ ONLY
    with dbapi_conn.cursor() as cursor:
        become_reader(cursor, allow_superuser)  # checks, then SET LOCAL ROLE
        # For the connection's life, not the transaction's: every later read runs as the role.
        cursor.execute(f"SET ROLE {READER_ROLE}")
        cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        cursor.execute(f"SET statement_timeout = {_STATEMENT_TIMEOUT_MS}")
    dbapi_conn.commit()


# -- runs and lineage -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lineage:
    """A run and the checkpoint it was forked from (all None for a run started fresh)."""

    run: str
    created_at: dt.datetime | None
    parent_checkpoint_id: int | None
    parent_run: str | None
    parent_step: int | None


def lineage(conn: Connection) -> list[Lineage]:
    """Every run with its fork parent, by run name."""
    parent = checkpoints.alias("parent")
    parent_run = runs.alias("parent_run")
    query = (
        select(
            runs.c.name,
            runs.c.created_at,
            runs.c.parent_checkpoint_id,
            parent_run.c.name,
            parent.c.step,
        )
        .select_from(runs)
        .outerjoin(parent, parent.c.id == runs.c.parent_checkpoint_id)
        .outerjoin(parent_run, parent_run.c.id == parent.c.run_id)
        .order_by(runs.c.name)
    )
    return [Lineage(*row) for row in conn.execute(query)]


@dataclass(frozen=True, slots=True)
class StatusCount:
    """How many checkpoints of a run are in one status, and the newest one's id."""

    run: str
    status: str
    count: int
    newest_id: int


def status_counts(conn: Connection, run_id: int | None = None) -> list[StatusCount]:
    """Checkpoints per run and status (of one run, or of all): what the pages count, and how
    they notice a change (a new row or a status change moves a count or a newest id)."""
    query = (
        select(runs.c.name, checkpoints.c.status, func.count(), func.max(checkpoints.c.id))
        .join(runs, runs.c.id == checkpoints.c.run_id)
        .group_by(runs.c.name, checkpoints.c.status)
        .order_by(runs.c.name, checkpoints.c.status)
    )
    if run_id is not None:
        query = query.where(checkpoints.c.run_id == run_id)
    return [
        StatusCount(name, status, int(n), int(top)) for name, status, n, top in conn.execute(query)
    ]


# -- one run's history ------------------------------------------------------------------------


class SavePoint(NamedTuple):
    """One checkpoint of a run as its charts and retention fates read it. A named tuple, not a
    dataclass like the other records: a run page makes one per checkpoint (10,000 and more), and
    a frozen dataclass costs several times as much to build."""

    id: int
    step: int
    status: str
    trigger: str
    metrics: dict[str, Any] | None
    error: str | None
    logical_bytes: int
    stored_bytes: int
    uploaded_bytes: int
    save_seconds: float | None
    blocked_seconds: float | None


def history(
    conn: Connection, run_id: int, statuses: Sequence[str] | None = None
) -> list[SavePoint]:
    """The run's checkpoints (in ``statuses``, or all), oldest first, without components (one
    statement)."""
    # The metrics come as text (the driver's value on SQLite) and are parsed in one call below:
    # parsing 10,000 small documents one by one costs more than the rest of the statement.
    columns = [
        type_coerce(checkpoints.c.metrics, Text) if name == "metrics" else checkpoints.c[name]
        for name in SavePoint._fields
    ]
    rows = conn.execute(
        lookups.select_checkpoints_of(run_id, statuses).with_only_columns(*columns)
    ).all()
    at = SavePoint._fields.index("metrics")
    parsed = _json_values([row[at] for row in rows])
    return [
        SavePoint._make((*row[:at], metrics, *row[at + 1 :]))
        for row, metrics in zip(rows, parsed, strict=True)
    ]


def _json_values(values: Sequence[Any]) -> list[Any]:
    """Each JSON text of ``values`` parsed (a value the driver parsed already is kept, one that
    is not valid JSON becomes None), the texts in one ``json.loads``."""
    texts = [v for v in values if isinstance(v, str)]
    try:
        parsed = iter(json.loads(f"[{','.join(texts)}]"))
    except ValueError:  # one bad row: parse each alone
        parsed = iter([_json_or_none(t) for t in texts])
    return [next(parsed) if isinstance(v, str) else v for v in values]


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def checkpoint_page(
    conn: Connection,
    run_id: int,
    run: str,
    *,
    limit: int,
    offset: int,
    statuses: Sequence[str] | None = None,
) -> list[CheckpointInfo]:
    """One page of the run's checkpoints (in ``statuses``, or all), newest first, with their
    components: the records ``ckptstore ls --json`` prints."""
    query = (
        lookups.select_checkpoints_of(run_id, statuses)
        .order_by(None)
        .order_by(checkpoints.c.step.desc(), checkpoints.c.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return lookups.fetch_with_components(conn, query, run)


# -- blobs ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlobFact:
    """A blob row: its kind, raw and stored sizes, codec and state."""

    digest: str
    kind: str
    logical_bytes: int
    stored_bytes: int
    codec: str | None
    state: str


def blob_facts(conn: Connection, digests: Sequence[str]) -> dict[str, BlobFact]:
    """The rows of ``digests`` that exist (one statement per :data:`BATCH`)."""
    found: dict[str, BlobFact] = {}
    unique = sorted(set(digests))
    columns = [blobs.c[name] for name in field_names(BlobFact)]
    for i in range(0, len(unique), BATCH):
        query = select(*columns).where(blobs.c.digest.in_(unique[i : i + BATCH]))
        found.update((row[0], BlobFact(*row)) for row in conn.execute(query))
    return found


@dataclass(frozen=True, slots=True)
class KindUsage:
    """Bytes of the committed checkpoints' components of one kind."""

    kind: str
    components: int
    logical_bytes: int
    #: Stored bytes of the blobs each component references, each component counted alone.
    stored_bytes: int
    #: Components with distinct contents (index digests): one saved again unchanged counts once.
    distinct: int
    #: Stored bytes of the distinct components.
    distinct_stored_bytes: int


def kind_usage(conn: Connection) -> list[KindUsage]:
    """Per component kind over committed checkpoints, by kind."""
    committed = select(checkpoints.c.id).where(checkpoints.c.status == Status.COMMITTED)
    per_index = (
        select(
            components.c.kind,
            func.count().label("n"),
            func.sum(components.c.logical_bytes).label("logical"),
            func.sum(components.c.stored_bytes).label("stored"),
            func.max(components.c.stored_bytes).label("once"),
        )
        .where(components.c.checkpoint_id.in_(committed))
        .group_by(components.c.kind, components.c.index_digest)
        .subquery()
    )
    query = (
        select(
            per_index.c.kind,
            func.sum(per_index.c.n),
            func.sum(per_index.c.logical),
            func.sum(per_index.c.stored),
            func.count(),
            func.sum(per_index.c.once),
        )
        .group_by(per_index.c.kind)
        .order_by(per_index.c.kind)
    )
    return [KindUsage(kind, *(int(v or 0) for v in rest)) for kind, *rest in conn.execute(query)]


@dataclass(frozen=True, slots=True)
class BlobKindUsage:
    """Blob rows of one kind (chunk, pack, index) and state."""

    kind: str
    state: str
    blobs: int
    logical_bytes: int
    stored_bytes: int

    @property
    def compression_ratio(self) -> float | None:
        """Raw bytes per stored byte (None without bytes)."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else None


def blob_kind_usage(conn: Connection) -> list[BlobKindUsage]:
    """Every blob row, per kind and state."""
    query = (
        select(
            blobs.c.kind,
            blobs.c.state,
            func.count(),
            func.coalesce(func.sum(blobs.c.logical_bytes), 0),
            func.coalesce(func.sum(blobs.c.stored_bytes), 0),
        )
        .group_by(blobs.c.kind, blobs.c.state)
        .order_by(blobs.c.kind, blobs.c.state)
    )
    return [
        BlobKindUsage(k, s, int(n), int(lb), int(sb)) for k, s, n, lb, sb in conn.execute(query)
    ]


# -- what garbage collection would do -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GcPreview:
    """What ``ckptstore gc`` would do now, worked out with reads only (``gc --dry-run`` takes
    the GC lease, a write). Objects without a row are not counted: that needs a store listing."""

    grace_seconds: float
    #: Live blobs no checkpoint keeps, unclaimed for the grace period: the next gc condemns them.
    condemn: int
    condemn_bytes: int
    #: Blobs condemned for longer than the grace period: the next gc deletes them.
    sweep: int
    sweep_bytes: int
    #: Blobs only corrupt checkpoints reference: kept for repair (``gc --release-corrupt``).
    kept_for_corrupt: int
    kept_for_corrupt_bytes: int
    corrupt_checkpoints: int


_KEEPING = (Status.COMMITTED, Status.PENDING)


def _referenced_by(statuses: Sequence[str]) -> ColumnElement[bool]:
    """SQL: the blob is referenced by a checkpoint in one of ``statuses`` (garbage's rule)."""
    return exists(
        select(1)
        .select_from(checkpoint_blobs)
        .join(checkpoints, checkpoints.c.id == checkpoint_blobs.c.checkpoint_id)
        .where(
            checkpoint_blobs.c.digest == blobs.c.digest,
            checkpoints.c.status.in_(list(statuses)),
        )
    )


def gc_preview(conn: Connection, grace: dt.timedelta, now: dt.datetime) -> GcPreview:
    """What a gc with ``grace`` would condemn and delete at ``now`` (corrupt checkpoints'
    blobs kept, as ``gc`` keeps them by default)."""
    cutoff = now - grace
    protected = _referenced_by((*_KEEPING, Status.CORRUPT))
    condemnable = and_(
        blobs.c.state == BlobState.LIVE, blobs.c.last_claimed_at < cutoff, ~protected
    )
    sweepable = and_(
        blobs.c.state == BlobState.CONDEMNED,
        blobs.c.condemned_at < cutoff,
        blobs.c.last_claimed_at < cutoff,
        ~protected,
    )
    only_corrupt = and_(_referenced_by([Status.CORRUPT]), ~_referenced_by(_KEEPING))

    def tally(condition: ColumnElement[bool]) -> tuple[int, int]:
        n, size = conn.execute(
            select(func.count(), func.coalesce(func.sum(blobs.c.stored_bytes), 0)).where(condition)
        ).one()
        return int(n), int(size)

    condemn, sweep, kept = tally(condemnable), tally(sweepable), tally(only_corrupt)
    corrupt = conn.scalar(
        select(func.count()).select_from(checkpoints).where(checkpoints.c.status == Status.CORRUPT)
    )
    return GcPreview(grace.total_seconds(), *condemn, *sweep, *kept, int(corrupt or 0))


@dataclass(frozen=True, slots=True)
class DamagedBlob:
    """A condemned blob that a corrupt checkpoint references: damage found by a load or
    ``verify`` (its object was moved under ``quarantine/``)."""

    digest: str
    kind: str
    stored_bytes: int
    condemned_at: dt.datetime | None


def damaged_blobs(conn: Connection, *, limit: int) -> list[DamagedBlob]:
    """Up to ``limit`` condemned blobs of corrupt checkpoints, the most recently condemned
    first."""
    query = (
        select(blobs.c.digest, blobs.c.kind, blobs.c.stored_bytes, blobs.c.condemned_at)
        .where(blobs.c.state == BlobState.CONDEMNED, _referenced_by([Status.CORRUPT]))
        .order_by(blobs.c.condemned_at.desc(), blobs.c.digest)
        .limit(limit)
    )
    return [DamagedBlob(*row) for row in conn.execute(query)]
