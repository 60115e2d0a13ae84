"""``save_state`` / ``load_state``: Accelerate's checkpoint calls, stored through ckptstore."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptstore import SaveHandle
from ckptstore.extending import CheckpointInfo, Run, check_step
from ckptstore.integrations.accelerate import _collective, _parts
from ckptstore.integrations.accelerate._collective import Job, Loaded, Target


def _job(accelerator: Any, target: Target) -> Job:
    _parts.check_supported(accelerator)
    return Job(accelerator.process_index, accelerator.num_processes, target)


def save_state(
    accelerator: Any,
    target: Target,
    step: int,
    *,
    training_info: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    trigger: str = "manual",
) -> SaveHandle | None:
    """Checkpoint everything ``accelerator.save_state`` would, as checkpoint ``step`` of a run.

    Call it on every process, like ``accelerator.save_state``. ``target``: the run
    (``open_run(...)``) on the main process; on the others the run's object store (its URL or an
    ``ObjectStore``) is enough -- they never open the manifest. What is stored: each prepared
    model (unwrapped), optimizer and LR scheduler, the gradient scaler, each object given to
    ``register_for_checkpointing`` (its ``state_dict()``, which must hold tensors, arrays and
    plain values: anything else is refused, naming it), and per process ``accelerator.step``,
    the Python, NumPy, torch and device generators and each prepared dataloader's position.

    The main process commits one checkpoint row once every process has stored its part (none
    if any failed: ``SaveError`` on every process). Returns the main process's
    :class:`SaveHandle` (a run opened with ``async_save=True`` uploads in the background: its
    ``wait()`` gives the committed record), None on the others.

    A save in the middle of an epoch needs a stateful dataloader with a reproducible order
    (``DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)``); one
    that a resume could not replay is refused with that fix.
    """
    check_step(step)
    job = _job(accelerator, target)
    info = {**dict(training_info or {}), _parts.INFO_KEY: _parts.counts(accelerator)}

    def own() -> tuple[str, Any]:
        return _parts.process_component(job.rank), _parts.process_state(accelerator)

    def commit(run: Run, components: dict[str, Any], receipts: list[Any]) -> SaveHandle:
        return run.save(
            step,
            components,
            receipts=receipts,
            training_info=info,
            metrics=metrics,
            trigger=trigger,
        )

    handle: SaveHandle | None = _collective.save(
        job, step, own, lambda: _parts.shared_state(accelerator), commit
    )
    return handle


def load_state(
    accelerator: Any,
    target: Target,
    step: int | None = None,
    *,
    rng: bool = True,
) -> CheckpointInfo | None:
    """Put back what :func:`save_state` stored: checkpoint ``step``, or the run's newest
    committed one (one query, by the main process). Returns its record on every process, or
    None when the run has no checkpoint yet (a fresh start: nothing is changed).

    Call it on every process after ``accelerator.prepare(...)`` and
    ``register_for_checkpointing(...)``, with the same objects the saving job had (else a
    ``ConfigError`` naming the difference). Every process reads its part into fresh memory and
    checks it; only when all succeeded is any state changed. A newest checkpoint that fails
    verification is marked corrupt and the one before it is loaded (all processes together).

    ``rng=False`` loads the model, optimizer, schedulers, scaler, registered objects and
    dataloader positions but leaves this process's generators as they are (which also allows
    a different number of processes than the job that saved it).
    """
    if step is not None:
        check_step(step)
    job = _job(accelerator, target)
    own = _parts.process_component(job.rank)

    def wanted(info: CheckpointInfo) -> list[str]:
        where = f"run {info.run!r} step {info.step}"
        saved = (info.training_info or {}).get(_parts.INFO_KEY)
        _parts.check_counts(accelerator, saved, where, rng)
        names = [c.name for c in info.components]
        shared = [n for n in names if not n.startswith("process/")]
        return [*shared, own] if own in names or rng else shared

    checked: dict[str, _parts.ProcessState] = {}

    def check(loaded: Loaded) -> None:
        where = f"run {loaded.info.run!r} step {loaded.info.step}"
        _parts.check_shared(accelerator, loaded.states, where)
        if own in loaded.states:
            state = loaded.states[own]
            checked[own] = _parts.check_process(accelerator, state, f"{where} {own}", rng)

    loaded = _collective.load(job, step, wanted, check)
    if loaded is None:
        return None
    _parts.apply_shared(accelerator, loaded.states)
    if own in checked:
        _parts.apply_process(accelerator, checked[own])
    return loaded.info
