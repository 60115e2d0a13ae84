"""The public records: one frozen dataclass per kind of row, what the API, the CLI and ``--json``
show. Rows become records in one place, :mod:`ckptstore.manifest._sql.tables`, which fills each
record's fields from the columns of the same names, so a new column is the model, its
migration, the light table in ``_sql.tables`` and a field here -- and then it appears everywhere.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ComponentInfo:
    """One component of a checkpoint (a row of ``components``)."""

    name: str
    kind: str
    index_digest: str
    logical_bytes: int
    stored_bytes: int
    entries: int

    def as_dict(self) -> dict[str, Any]:
        """The record as a plain dict (for JSON)."""
        return as_dict(self)


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One checkpoint (a row of ``checkpoints``), with its run's name and its components."""

    id: int
    run: str
    step: int
    status: str
    trigger: str
    writer_epoch: int
    created_at: dt.datetime | None
    committed_at: dt.datetime | None
    training_info: dict[str, Any] | None
    metrics: dict[str, Any] | None
    logical_bytes: int
    stored_bytes: int
    uploaded_bytes: int
    save_seconds: float | None
    blocked_seconds: float | None
    error: str | None
    components: tuple[ComponentInfo, ...] = ()

    @property
    def deduplicated_bytes(self) -> int:
        """Bytes this checkpoint references that were already stored before it."""
        return max(0, self.stored_bytes - self.uploaded_bytes)

    def as_dict(self) -> dict[str, Any]:
        """The record as a plain dict (for JSON), components included."""
        return as_dict(self)


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One run (a row of ``runs``)."""

    id: int
    name: str
    created_at: dt.datetime | None
    config: dict[str, Any] | None
    config_fingerprint: str | None
    parent_checkpoint_id: int | None
    writer_epoch: int
    metric_name: str | None
    higher_is_better: bool

    def as_dict(self) -> dict[str, Any]:
        """The record as a plain dict (for JSON)."""
        return as_dict(self)


@dataclass(frozen=True, slots=True)
class BlobClaim:
    """One blob a checkpoint references, as reported by the writer that stored it."""

    digest: str
    kind: str
    logical_bytes: int
    stored_bytes: int
    codec: str | None
    #: The writer stored the object itself during this save.
    uploaded: bool


def as_dict(record: Any) -> dict[str, Any]:
    """Any record (nested records included) as plain dicts and lists."""
    return dataclasses.asdict(record)


def field_names(record_type: type[Any]) -> list[str]:
    """The fields of a record type, in declaration order (for tables and CSV headers)."""
    return [f.name for f in dataclasses.fields(record_type)]
