"""What a start does with a run's history: fork a run whose model config changed (DESIGN.md
§9.6: refused unless ``checkpointing.fork``, and with the parent's weights only if the
architecture is the same), and start over a run whose every checkpoint is corrupt (refused
unless ``checkpointing.start_fresh``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptstore.extending import identity_changes
from trainer.config import CheckpointingConfig, architecture_changed, fingerprint
from trainer.errors import ResumeError


@dataclass(frozen=True)
class Fork:
    """A decided fork: the parent checkpoint, the new run and how it starts."""

    #: (parent run, its newest step).
    parent: tuple[str, int]
    run_name: str
    #: The fork starts from the warm-up model (the architecture changed).
    fresh: bool
    #: The model-config keys it changed that change the prompts (seed, task), or None.
    data_reset: str | None
    #: The line to print.
    message: str


def plan_fork(
    ck: CheckpointingConfig,
    existing: dict[str, Any],
    model_spec: dict[str, Any],
    latest_step: Callable[[str], int | None],
) -> Fork | None:
    """None if ``model_spec`` is the run's recorded model config (``existing``), else the fork
    to start, or ``ResumeError`` naming the option that allows it. ckptstore's own rule
    (``open_run`` takes the model config as the run's identity), asked before any warm-up or
    write."""
    changed = identity_changes(existing, model_spec)
    if not changed:
        return None
    name = ck.run_name
    if not ck.fork:
        raise ResumeError(
            f"run {name!r} was trained with a different model config (changed: "
            f"{', '.join(changed)}); resuming it would mix two trainings. Set "
            "checkpointing.fork=true to start a new run from its newest checkpoint "
            "(lineage is recorded), or choose another checkpointing.run_name."
        )
    arch_changed = architecture_changed(changed)
    if arch_changed and ck.fork_init != "fresh":
        raise ResumeError(
            f"cannot fork run {name!r} with its weights: the architecture changed "
            f"({', '.join(changed)}), so the saved policy does not fit. Set "
            "checkpointing.fork_init=fresh to start the fork from the warm-up model "
            "(recorded in the run's config), or keep the architecture."
        )
    step = latest_step(name)
    if step is None:
        raise ResumeError(f"cannot fork run {name!r}: it has no committed checkpoint")
    data_reset = ", ".join(k for k in changed if k == "seed" or k.startswith("task.")) or None
    run_name = f"{name}-fork-{fingerprint(model_spec)}"
    how = "from the warm-up model (fork_init=fresh)" if arch_changed else "with its weights"
    message = (
        f"config changed ({', '.join(changed)}): forking run {name!r}@{step} into "
        f"{run_name!r}, {how}"
    )
    return Fork((name, step), run_name, arch_changed, data_reset, message)


def start_over(
    ck: CheckpointingConfig, name: str, corrupt: list[int], emit: Callable[[str], None]
) -> bool:
    """Whether the run ``name``, whose checkpoints at steps ``corrupt`` are all corrupt, starts
    over from step 0 (``checkpointing.start_fresh``); False if it has none; else ResumeError."""
    if not corrupt:
        return False
    if not ck.start_fresh:
        raise ResumeError(
            f"run {name!r} has no checkpoint to resume from: its checkpoints at steps "
            f"{corrupt} are corrupt (`ckptstore show {name}@{corrupt[-1]}` says why). Re-run "
            "with checkpointing.start_fresh=true to start it over from step 0 (the corrupt "
            "checkpoints stay in its history), or choose another checkpointing.run_name"
        )
    emit(
        f"warning: run {name!r} has no checkpoint that loads (steps {corrupt} are corrupt): "
        "starting it over from step 0 (checkpointing.start_fresh=true)"
    )
    return True
