"""The light tables: the manifest's tables named as Core clauses, and the one place rows
become records.

Why Core: importing SQLAlchemy's ORM and declaring the models (:mod:`ckptstore.manifest.models`)
took about a third of the start-up of a process that only reads (``ckptstore latest RUN``:
~80 of ~250 ms here), and a lookup needs neither. So the statements of this level name the
tables as light clauses (:func:`sqlalchemy.table`) whose columns are the records' fields (a new
field selects its column), typed only where a driver's value must be converted (JSON, times,
booleans); ``tests/manifest/test_lookups.py`` holds them to the models. The statuses come from
:mod:`ckptstore.manifest.statuses`, so no read command imports the ORM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import JSON, Boolean, DateTime, Select, column, table
from sqlalchemy.engine import Connection, Row
from sqlalchemy.sql.expression import ColumnClause, TableClause

from ckptstore.manifest.records import CheckpointInfo, ComponentInfo, RunInfo, field_names

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

R = TypeVar("R")

#: Values bound in one ``IN (...)`` list: statements over many ids or digests go in batches
#: (SQLite refuses more than 32,766 parameters in one statement).
BATCH = 500

#: The columns whose driver values SQLAlchemy converts: SQLite returns JSON and times as text
#: and booleans as integers. Every other column comes back as the driver gives it.
_TYPES: dict[str, Any] = {
    "config": JSON(),
    "training_info": JSON(),
    "metrics": JSON(),
    "created_at": DateTime(timezone=True),
    "committed_at": DateTime(timezone=True),
    "last_claimed_at": DateTime(timezone=True),
    "condemned_at": DateTime(timezone=True),
    "higher_is_better": Boolean(),
    "in_store": Boolean(),
}


def _columns(record_type: type[Any], *, omit: Sequence[str] = ()) -> list[ColumnClause[Any]]:
    return [column(name, _TYPES.get(name)) for name in field_names(record_type) if name not in omit]


runs = table("runs", *_columns(RunInfo))
checkpoints = table(
    "checkpoints", column("run_id"), *_columns(CheckpointInfo, omit=("run", "components"))
)
components = table("components", column("checkpoint_id"), *_columns(ComponentInfo))
# Blob rows have no record: their columns by name (what ``du`` sums, in manifest.reporting).
blobs = table(
    "blobs",
    *(
        column(name, _TYPES.get(name))
        for name in (
            "digest",
            "kind",
            "logical_bytes",
            "stored_bytes",
            "codec",
            "created_at",
            "last_claimed_at",
            "state",
            "condemned_at",
            "in_store",
        )
    ),
)
checkpoint_blobs = table("checkpoint_blobs", column("checkpoint_id"), column("digest"))
blob_copies = table(
    "blob_copies", column("digest"), column("node"), column("created_at", _TYPES["created_at"])
)


def to_record(record_type: type[R], source: TableClause, row: Row[Any], **given: Any) -> R:
    """The ``record_type`` made from ``row``'s columns of ``source`` and the ``given`` fields
    (those that are no column: a checkpoint's run name and components)."""
    mapping = row._mapping
    return record_type(
        **{name: mapping[col] for name, col in _fields(record_type, source)}, **given
    )


#: (record type, table name) -> each field of the record that is a column of the table, with
#: that column: worked out once, as ``ls`` makes a record of every row.
_FIELDS: dict[tuple[type[Any], str], list[tuple[str, ColumnClause[Any]]]] = {}


def _fields(record_type: type[Any], source: TableClause) -> list[tuple[str, ColumnClause[Any]]]:
    key = (record_type, source.name)
    if key not in _FIELDS:
        _FIELDS[key] = [(n, source.c[n]) for n in field_names(record_type) if n in source.c]
    return _FIELDS[key]


def fetch_rows(conn: Connection | Session, statement: Select[Any]) -> list[Row[Any]]:
    """The rows ``statement`` selects, on a Core connection or an ORM session."""
    return list(conn.execute(statement))
