"""The public records: one frozen dataclass per kind of row, what the API, the CLI and ``--json``
show. Rows become records in one place, :mod:`ckptstore.manifest._sql.tables`, which fills each
record's fields from the columns of the same names, so a new column is the model, its
migration, the light table in ``_sql.tables`` and a field here -- and then it appears everywhere.

A :class:`CheckpointInfo` also crosses between processes (a coordinator hands it to ranks that
never open the manifest, DESIGN.md §12) as plain JSON: :func:`checkpoint_info_to_json` writes
every field and :func:`checkpoint_info_from_json` reads every field back, checked, so a new
field travels without code elsewhere (a field of a new type needs its reader in ``_READERS``).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import ConfigError
from ckptstore.names import check_step


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


# -- a checkpoint record as JSON ----------------------------------------------------------------

#: What a document that does not fit the records means, and its cure.
_SAME_VERSION = "plan and load with the same ckptstore version"


def checkpoint_info_to_json(info: CheckpointInfo) -> dict[str, Any]:
    """A checkpoint record as plain JSON values: every field, times as ISO 8601 text, components
    as a list of objects; what :func:`checkpoint_info_from_json` reads back."""
    return _record_to_json(info)


def checkpoint_info_from_json(doc: object, *, what: str) -> CheckpointInfo:
    """The record :func:`checkpoint_info_to_json` wrote: every field present, none unknown, each
    of its type and the step in range; else ``ConfigError`` naming ``what`` (the document it
    came in, e.g. ``"DCP load plan"``) and the field."""
    info: CheckpointInfo = _record_from_json(CheckpointInfo, doc, what, "checkpoint")
    try:
        check_step(info.step)
    except ConfigError as exc:
        raise ConfigError(f"{what}: checkpoint.step: {exc}") from None
    return info


def _record_to_json(record: Any) -> dict[str, Any]:
    doc = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if isinstance(value, dt.datetime):
            value = value.isoformat()
        elif isinstance(value, tuple):
            value = [_record_to_json(item) for item in value]
        else:  # the document must not share the record's dicts (records are immutable)
            value = copy.deepcopy(value)
        doc[field.name] = value
    return doc


def _record_from_json(record_type: type[Any], doc: object, what: str, where: str) -> Any:
    fields = dataclasses.fields(record_type)
    if not isinstance(doc, dict):
        raise ConfigError(
            f"{what}: {where} must be a JSON object, got {type(doc).__name__}; {_SAME_VERSION}"
        )
    missing = sorted({f.name for f in fields} - set(doc))
    extra = sorted(set(doc) - {f.name for f in fields})
    if missing or extra:
        raise ConfigError(
            f"{what}: {where} lacks {missing} and has unknown {extra}; {_SAME_VERSION}"
        )
    values = {}
    for field in fields:
        read = _READERS.get(str(field.type))
        if read is None:  # a programming error, not the document's: no ConfigError
            raise TypeError(
                f"{record_type.__name__}.{field.name} is of type {field.type}, which has no "
                "JSON reader: add one to _READERS in ckptstore/manifest/records.py"
            )
        try:
            values[field.name] = read(doc[field.name], what, f"{where}.{field.name}")
        except ConfigError:  # a nested record's own (ConfigError is also a ValueError)
            raise
        except (TypeError, ValueError):
            raise ConfigError(
                f"{what}: {where}.{field.name} is {doc[field.name]!r}, not {field.type}; "
                f"{_SAME_VERSION}"
            ) from None
    return record_type(**values)


#: Reads one field's JSON value (the document's name and the field's path, for nested records);
#: TypeError or ValueError if the value is not of the field's type.
_Reader = Callable[[Any, str, str], Any]


def _of(kind: type[Any], *, optional: bool = False) -> _Reader:
    def read(value: Any, what: str, where: str) -> Any:
        if value is None and optional:
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise TypeError(value)
        return value

    return read


def _datetime(value: Any, what: str, where: str) -> dt.datetime | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(value)
    return dt.datetime.fromisoformat(value)


def _components(value: Any, what: str, where: str) -> tuple[ComponentInfo, ...]:
    if not isinstance(value, list):
        raise TypeError(value)
    return tuple(
        _record_from_json(ComponentInfo, item, what, f"{where}[{i}]")
        for i, item in enumerate(value)
    )


#: How each field type of the records reads back from JSON (by the annotation's text).
_READERS: dict[str, _Reader] = {
    "int": _of(int),
    "str": _of(str),
    "str | None": _of(str, optional=True),
    "float | None": _of(float, optional=True),
    "dt.datetime | None": _datetime,
    "dict[str, Any] | None": _of(dict, optional=True),
    "tuple[ComponentInfo, ...]": _components,
}
