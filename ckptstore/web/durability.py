"""What each checkpoint survives, as the CLI reports it: the records the run and checkpoint
pages show and their API returns are ``ckptstore ls --json``'s and ``show --json``'s, the
manifest's record with ``durability`` and ``replicas`` beside its fields.

Both come from the manifest's read functions (:func:`ckptstore.manifest.reading.durability`,
:func:`~ckptstore.manifest.reading.replica_counts`), the ones the CLI calls: one query for a
page of checkpoints, not one per checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptstore.manifest import reading as reads
from ckptstore.manifest.db import Database
from ckptstore.manifest.records import CheckpointInfo

#: What each durability means, for the checkpoint page.
MEANING = {
    "remote": "committed: the object store holds it",
    "local": "on node-local tiers only: a drain commits it to the object store",
}


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """A checkpoint as ``ckptstore ls --json`` and ``show --json`` report it: the manifest's
    record, what it survives (``"remote"``, ``"local"`` or None: not loadable) and the fewest
    node-local tier copies any of its blobs has (None: it references no blob). Its JSON is the
    record's fields with ``durability`` and ``replicas`` added
    (:func:`ckptstore.web.routes.plain`)."""

    info: CheckpointInfo
    durability: str | None
    replicas: int | None


def records(db: Database, checkpoints: Sequence[CheckpointInfo]) -> list[CheckpointRecord]:
    """``checkpoints`` with their durability and replica counts (one query for all)."""
    if not checkpoints:
        return []
    replicas = reads.replica_counts(db, [c.id for c in checkpoints])
    return [
        CheckpointRecord(c, reads.durability(c.status), replicas.get(c.id)) for c in checkpoints
    ]


def durability_text(record: CheckpointRecord) -> str:
    """``"local, 2 tier copies"``, ``"remote, 0 tier copies"``, ``"remote"`` (no blob) or
    ``"-"`` (neither: not loadable)."""
    if record.durability is None:
        return "-"
    if record.replicas is None:
        return record.durability
    n = record.replicas
    return f"{record.durability}, {n} tier cop{'y' if n == 1 else 'ies'}"
