"""What a rank needs to read one DCP checkpoint from the store alone: a :class:`LoadPlan`.

The coordinator resolves it from the manifest (``plan_load``); every other rank gets it from
the coordinator (a broadcast, or any channel a controller uses: :meth:`LoadPlan.to_json`) and
never opens the database (DESIGN.md §12, "workers never touch the manifest"). The rank
components' index digests are in the metadata document, so the checkpoint record and the
metadata component's digest are all a reader needs.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import CkptStoreError, ComponentNotFoundError, ConfigError
from ckptstore.floor import CheckpointInfo, ComponentInfo, check_digest, check_step
from ckptstore.integrations.dcp._metadata import METADATA_COMPONENT

PLAN_FORMAT = "ckptstore/dcp-load-plan"
PLAN_VERSION = 1


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """One committed DCP checkpoint, as every rank of a load needs it: its record (run, step,
    components) and, optionally, the URL of the store that holds it. Small, picklable, and
    carried as JSON by :meth:`to_json` / :meth:`from_json`."""

    #: The checkpoint's record, as ``Run.checkpoint`` / ``Run.latest`` returned it.
    info: CheckpointInfo
    #: The object store's URL (what ``ObjectStore.url`` says), for a rank given no store.
    store_url: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.info, CheckpointInfo):
            raise ConfigError(
                f"LoadPlan(info=...) takes the CheckpointInfo of the checkpoint to load, got "
                f"{type(self.info).__name__}; make plans with ckpt_dcp.plan_load(run)"
            )
        if self.store_url is not None and not isinstance(self.store_url, str):
            raise ConfigError("LoadPlan(store_url=...) must be a URL string or None")
        _metadata_digest(self.info)  # a checkpoint DCP did not save is refused here, by name

    @property
    def run(self) -> str:
        """The run's name."""
        return self.info.run

    @property
    def step(self) -> int:
        """The checkpoint's step."""
        return self.info.step

    @property
    def metadata_digest(self) -> str:
        """The index digest of the checkpoint's ``dcp/metadata`` component."""
        return _metadata_digest(self.info)

    def to_json(self) -> str:
        """The plan as JSON text (plain values only), for :meth:`from_json` in another
        process."""
        return json.dumps(
            {
                "format": PLAN_FORMAT,
                "version": PLAN_VERSION,
                "store_url": self.store_url,
                "checkpoint": _record_to_json(self.info),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> LoadPlan:
        """The plan :meth:`to_json` wrote; ``ConfigError`` naming what is wrong with any other
        text."""
        try:
            doc = json.loads(text)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"not a DCP load plan (not JSON: {exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
            raise ConfigError(
                f"not a DCP load plan: expected a JSON object with format {PLAN_FORMAT!r} "
                "(what LoadPlan.to_json writes)"
            )
        if doc.get("version") != PLAN_VERSION:
            raise ConfigError(
                f"DCP load plan version {doc.get('version')!r}: this ckptstore reads version "
                f"{PLAN_VERSION}; plan and load with the same ckptstore version"
            )
        _check_keys(doc, {"format", "version", "store_url", "checkpoint"}, "the plan")
        store_url = doc["store_url"]
        if store_url is not None and not isinstance(store_url, str):
            raise ConfigError("DCP load plan: store_url must be a string or null")
        try:
            info = _record_from_json(CheckpointInfo, doc["checkpoint"], "checkpoint")
            check_step(info.step)
            for component in info.components:
                check_digest(component.index_digest)
        except CkptStoreError as exc:
            raise ConfigError(f"DCP load plan: {exc}") from None
        return cls(info, store_url)


def _metadata_digest(info: CheckpointInfo) -> str:
    for component in info.components:
        if component.name == METADATA_COMPONENT:
            return component.index_digest
    raise ComponentNotFoundError(
        f"run {info.run!r} step {info.step} has no component {METADATA_COMPONENT!r}: it was "
        f"not saved through torch DCP with ckptstore (components: "
        f"{sorted(c.name for c in info.components)})"
    )


# -- records as JSON: every field of the record, so a new column travels without code here ---


def _record_to_json(record: Any) -> dict[str, Any]:
    doc = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if isinstance(value, dt.datetime):
            value = value.isoformat()
        elif isinstance(value, tuple):
            value = [_record_to_json(item) for item in value]
        doc[field.name] = value
    return doc


def _record_from_json(record_type: type[Any], doc: Any, where: str) -> Any:
    fields = dataclasses.fields(record_type)
    if not isinstance(doc, dict):
        raise ConfigError(f"DCP load plan: {where} must be a JSON object")
    _check_keys(doc, {f.name for f in fields}, where)
    values = {}
    for field in fields:
        read = _READERS.get(str(field.type))
        if read is None:  # a record field of a type this module was not taught
            raise ConfigError(f"DCP load plan: cannot read {where}.{field.name} ({field.type})")
        try:
            values[field.name] = read(doc[field.name])
        except (TypeError, ValueError):
            raise ConfigError(
                f"DCP load plan: {where}.{field.name} is {doc[field.name]!r}, not {field.type}"
            ) from None
    return record_type(**values)


def _check_keys(doc: dict[str, Any], wanted: set[str], where: str) -> None:
    missing, extra = sorted(wanted - set(doc)), sorted(set(doc) - wanted)
    if missing or extra:
        raise ConfigError(
            f"DCP load plan: {where} lacks {missing} and has unknown {extra}; plan and load "
            "with the same ckptstore version"
        )


def _of(kind: type[Any], optional: bool = False) -> Callable[[Any], Any]:
    def read(value: Any) -> Any:
        if value is None and optional:
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(value)
        return value

    return read


def _datetime(value: Any) -> dt.datetime | None:
    return None if value is None else dt.datetime.fromisoformat(_of(str)(value))


def _components(value: Any) -> tuple[ComponentInfo, ...]:
    if not isinstance(value, list):
        raise TypeError(value)
    return tuple(
        _record_from_json(ComponentInfo, item, f"checkpoint.components[{i}]")
        for i, item in enumerate(value)
    )


#: How each field type of the records reads back from JSON.
_READERS: dict[str, Callable[[Any], Any]] = {
    "int": _of(int),
    "str": _of(str),
    "str | None": _of(str, optional=True),
    "float | None": _of(float, optional=True),
    "dt.datetime | None": _datetime,
    "dict[str, Any] | None": _of(dict, optional=True),
    "tuple[ComponentInfo, ...]": _components,
}
