"""What a rank needs to read one DCP checkpoint from the store alone: a :class:`LoadPlan`.

The coordinator resolves it from the manifest (``plan_load``); every other rank gets it from
the coordinator (a broadcast, or any channel a controller uses: :meth:`LoadPlan.to_json`) and
never opens the database (DESIGN.md §12, "workers never touch the manifest"). The rank
components' index digests are in the metadata document, so the checkpoint record and the
metadata component's digest are all a reader needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ckptstore.errors import ComponentNotFoundError, ConfigError, IntegrityError
from ckptstore.extending import (
    CheckpointInfo,
    check_digest,
    checkpoint_info_from_json,
    checkpoint_info_to_json,
)
from ckptstore.integrations.dcp._metadata import METADATA_COMPONENT

PLAN_FORMAT = "ckptstore/dcp-load-plan"
PLAN_VERSION = 1
#: What the plan's errors call it.
_WHAT = "DCP load plan"
#: The keys of a plan document (its checkpoint record is checked by checkpoint_info_from_json).
_PLAN_KEYS = {"format", "version", "store_url", "checkpoint"}


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
                "checkpoint": checkpoint_info_to_json(self.info),
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
        missing, extra = sorted(_PLAN_KEYS - set(doc)), sorted(set(doc) - _PLAN_KEYS)
        if missing or extra:
            raise ConfigError(
                f"{_WHAT}: the plan lacks {missing} and has unknown {extra}; plan and load with "
                "the same ckptstore version"
            )
        store_url = doc["store_url"]
        if store_url is not None and not isinstance(store_url, str):
            raise ConfigError(f"{_WHAT}: store_url must be a string or null")
        info = checkpoint_info_from_json(doc["checkpoint"], what=_WHAT)
        for component in info.components:
            try:
                check_digest(component.index_digest)
            except IntegrityError as exc:  # a malformed document, not damaged bytes (§12)
                raise ConfigError(f"{_WHAT}: component {component.name!r}: {exc}") from None
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
