"""A save in progress (snapshot taken, uploads running), and what is printed once committed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptstore import CheckpointInfo, ShardSave


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


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def saved_lines(info: CheckpointInfo) -> list[str]:
    """What the trainer prints of a committed save (and a warning if it stored stale state)."""
    where = " to the node-local tiers" if info.status == "local" else ""
    lines = [
        f"saved step {info.step} ({info.trigger}){where}: {_mib(info.logical_bytes)} logical, "
        f"{_mib(info.uploaded_bytes)} uploaded, {_mib(info.deduplicated_bytes)} deduplicated, "
        f"blocked {info.blocked_seconds or 0:.3f}s, save {info.save_seconds or 0:.2f}s"
    ]
    stale = (info.training_info or {}).get("stale_components")
    if stale:
        lines.append(
            f"WARNING: step {info.step} stored the same {', '.join(stale)} as the previous "
            "checkpoint although training steps happened in between: the saved weights are "
            "stale (recorded in training_info.stale_components)"
        )
    return lines


def exit_noting(
    close: Callable[[], None], what: str, _: object, error: BaseException | None, *__: object
) -> None:
    """A writer's exit as ckptstore's, without its log: a close failure raises on a clean exit
    and is a note on the error in flight otherwise, naming ``what`` ("checkpoint save", ...).
    The driver prints that error as one line; ckptstore's exit would also log the close failure
    with its traceback."""
    if error is None:
        close()
        return
    try:
        close()
    except Exception as exc:
        error.add_note(f"trainer: the pending {what} also failed: {exc!r}")
        if exc.__cause__ is not None:
            error.add_note(f"trainer: caused by {exc.__cause__!r}")
