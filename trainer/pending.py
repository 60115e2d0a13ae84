"""A trainer save between its snapshots and its commit (``trainer/checkpointing.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptstore import ShardSave


@dataclass
class PendingSave:
    """A save whose shards are still uploading; committed once every receipt has arrived."""

    step: int
    trigger: str
    started_at: float
    #: perf_counter() when the save began, and the seconds its snapshots blocked training.
    began: float
    blocked: float
    components: dict[str, Any]
    training_info: dict[str, Any]
    metrics: dict[str, Any]
    buffer: ShardSave  # the replay buffer's upload


def settle(save: ShardSave, failure: BaseException) -> None:
    """Wait for ``save``; its own failure becomes a note on ``failure``."""
    try:
        save.receipts()
    except Exception as exc:
        failure.add_note(f"trainer: the replay buffer's upload failed too: {exc!r}")
