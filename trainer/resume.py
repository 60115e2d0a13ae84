"""Resuming (DESIGN.md §9.5): a checkpoint read back into the state the controller starts from.

:func:`read_checkpoint` decides everything a resume restores before the controller changes
anything (and, on a fork's first start, before anything is stored): the counters, the policy and
optimizer state, the prompt stream, the replay buffer, the prompt ledger (the prompts to
dispatch again, with their start weights) and the sampler's dispatch index. The controller
applies the :class:`Restored` record it returns before the pumps start. A checkpoint that cannot
be resumed with this configuration is a :class:`ResumeError` naming what to change.

What carries over when the configuration changed between the runs:

- another sampler: the saved replay buffer and the prompts admitted but not trained on are
  skipped (the reference's rule: warn, skip the buffer, train on); their batches, target steps
  and dispatch indices belong to the old sampler. The dispatch index is derived from the step.
- another ``data.train.dataset_name``: the dataloader starts fresh; buffered groups are kept
  (same sampler), the saved prompts that were not buffered are not dispatched again.
- a fork that changed the seed or the task (so the prompts themselves differ): the weights and
  optimizer are kept; the data order starts fresh and nothing buffered or in flight is kept.
- a smaller ``async_rl.max_buffered_rollouts``: the freshest groups that fit are restored, the
  others' prompts are dispatched again as permits free up; prompts promised to a target step
  (``in_order``) must all fit, or the resume is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptstore import LoadedCheckpoint, Run
from trainer.config import TrainerConfig
from trainer.data import PromptStream
from trainer.errors import ResumeError
from trainer.ledger import PromptLedger
from trainer.policy_state import SHARDED_INFO, is_sharded
from trainer.replay import ReplayBuffer, ReplayBufferError

__all__ = ["Restored", "read_checkpoint"]


#: Kinds of the controller's own components.
KINDS = {"dataloader": "dataloader", "rollout_state": "state", "replay_buffer": "replay_buffer"}
#: What the controller itself loads of a checkpoint whose policy is sharded.
CONTROLLER_COMPONENTS = tuple(KINDS)


@dataclass(frozen=True, kw_only=True)
class Restored:
    """What a checkpoint restores; the controller applies it before the pumps start."""

    #: ``run 'name' step N``, for messages.
    where: str
    #: The run the checkpoint belongs to (the parent's, on a fork's first start).
    run: str
    step: int
    consumed_samples: int
    consumed_generations: int
    total_valid_tokens: int
    #: The policy saved whole (one worker), or None: saved sharded (``sharded``).
    policy: dict[str, Any] | None
    #: The whole policy's optimizer state; None: the optimizer starts fresh (or is sharded).
    optimizer: dict[str, Any] | None
    #: The policy was saved sharded by N workers (the ``dcp/*`` components): the policy
    #: workers read it from the store themselves.
    sharded: bool = False
    #: ...and the optimizer's shards are to be loaded with it.
    sharded_optimizer: bool = False
    stream: PromptStream
    buffer: ReplayBuffer
    ledger: PromptLedger
    dispatch_index: int
    #: (group id, prompt id) of saved prompts that are neither restored nor dispatched again.
    skipped: list[tuple[int, int]]
    #: Lines to print (each a warning).
    warnings: list[str]


def load_to_resume(run: Run, step: int | None = None) -> LoadedCheckpoint:
    """A checkpoint to resume from (``step``, or the newest that verifies). A sharded policy's
    components are left to the policy workers, which read them from the store themselves."""
    info = run.checkpoint(step) if step is not None else run.latest()
    if info is None or not is_sharded(info):
        loaded = run.load(step)
    else:
        loaded = run.load(step, components=CONTROLLER_COMPONENTS)
    if is_sharded(loaded.info) or "policy" in loaded.state:
        return loaded
    # Fell back past a corrupt sharded checkpoint to one whose policy was saved whole.
    whole = run.load(loaded.info.step)
    return dataclasses.replace(whole, skipped=loaded.skipped)


def read_checkpoint(
    loaded: LoadedCheckpoint,
    cfg: TrainerConfig,
    sampler_name: str,
    new_stream: Callable[[], PromptStream],
    data_reset: str | None = None,
) -> Restored:
    """Everything ``loaded`` restores under ``cfg``; ``data_reset`` says why the data starts
    fresh although the dataset name is unchanged (a fork that changed the seed or the task)."""
    info, state = loaded.info, loaded.state
    training = info.training_info or {}
    sharded = is_sharded(info)
    save_optimizer = cfg.checkpointing.save_optimizer
    where = f"run {info.run!r} step {info.step}"
    group_size = cfg.grpo.num_generations_per_prompt
    _check_group_size(training, group_size, where)
    step = int(training["current_step"])
    consumed = int(training.get("consumed_samples", 0))
    warnings: list[str] = []
    saved_sampler = training.get("sampler_name")
    same_sampler = saved_sampler == sampler_name and data_reset is None
    same_data = training.get("dataset_name") == cfg.data.train.dataset_name and data_reset is None
    stream = new_stream()
    if same_data:
        _load_stream(stream, state, where)
    else:
        warnings.append(_data_warning(training, cfg, data_reset))
    buffer = ReplayBuffer(cfg.async_rl.max_buffered_rollouts, group_size)
    if same_sampler and "replay_buffer" in state:
        _load_buffer(buffer, state["replay_buffer"], where)
    ready = {g.group_id for g in buffer.groups}
    rollout = state.get("rollout_state") or {}
    ledger = PromptLedger()
    skipped: list[tuple[int, int]] = []
    saved_index = rollout.get("dispatch_index")
    if same_data and same_sampler:
        ledger.load_state_dict(rollout, ready, where)
        _check_capacity(ledger, cfg.async_rl.max_buffered_rollouts, sampler_name, where)
        dispatch_index = step - 1 if saved_index is None else int(saved_index)
    else:
        saved = PromptLedger()
        saved.load_state_dict(rollout, ready, where)
        ledger.next_group_id = saved.next_group_id
        skipped = [(p.group_id, p.prompt_id) for _, p in saved.redispatch]
        for group in buffer.groups:  # groups whose prompts belong to another dataset
            ledger.adopt(group.group_id, group.prompt_id, group.dispatch_index, group.target_step)
        dispatch_index = step - 1  # the reference's rule: no saved batch is dispatched again
        if not same_sampler and data_reset is None:
            warnings.append(
                f"warning: sampler changed ({saved_sampler!r} -> {sampler_name!r}): skipping "
                f"the saved replay buffer and {len(skipped)} prompts admitted but not trained "
                "on (the data order goes on after them)"
            )
    return Restored(
        where=where,
        run=info.run,
        step=step,
        consumed_samples=consumed,
        consumed_generations=int(training.get("consumed_generations", consumed * group_size)),
        total_valid_tokens=int(training.get("total_valid_tokens", 0)),
        policy=None if sharded else state["policy"],
        optimizer=None if sharded else _optimizer(state, save_optimizer, where, warnings),
        sharded=sharded,
        sharded_optimizer=sharded and _sharded_optimizer(training, save_optimizer, where, warnings),
        stream=stream,
        buffer=buffer,
        ledger=ledger,
        dispatch_index=dispatch_index,
        skipped=skipped,
        warnings=warnings,
    )


def _check_group_size(training: Mapping[str, Any], group_size: int, where: str) -> None:
    saved = training.get("num_generations_per_prompt")
    if saved is not None and int(saved) != group_size:
        raise ResumeError(
            f"{where} was trained with grpo.num_generations_per_prompt={saved}, the config "
            f"says {group_size}: its replay buffer and advantages assume groups of "
            f"{saved}. Set grpo.num_generations_per_prompt={saved}, or start a new run "
            "(checkpointing.run_name)"
        )


def _optimizer(
    state: Mapping[str, Any], save_optimizer: bool, where: str, warnings: list[str]
) -> dict[str, Any] | None:
    if not save_optimizer:
        return None
    optimizer = state.get("optimizer")
    if optimizer is None:
        warnings.append(f"warning: {where} has no optimizer state: the optimizer starts fresh")
    return optimizer


def _sharded_optimizer(
    training: Mapping[str, Any], save_optimizer: bool, where: str, warnings: list[str]
) -> bool:
    if not save_optimizer:
        return False
    if not (training.get(SHARDED_INFO) or {}).get("optimizer"):
        warnings.append(f"warning: {where} has no optimizer state: the optimizer starts fresh")
        return False
    return True


def _load_stream(stream: PromptStream, state: Mapping[str, Any], where: str) -> None:
    if "dataloader" not in state:
        raise ResumeError(
            f"{where} has no dataloader state, so resuming would replay or skip prompts; "
            "load an older checkpoint or start a new run (checkpointing.run_name)"
        )
    try:
        stream.load_state_dict(state["dataloader"])
    except ValueError as exc:
        raise ResumeError(
            f"{where}: its dataloader state cannot be resumed ({exc}); start a new run "
            "(checkpointing.run_name) or load a checkpoint saved by this trainer version"
        ) from None


def _data_warning(training: Mapping[str, Any], cfg: TrainerConfig, data_reset: str | None) -> str:
    if data_reset is not None:
        return (
            f"warning: the fork changed {data_reset}, so its prompts differ: the data order "
            "starts fresh and no saved prompt (buffered or in flight) carries over; the "
            "weights and the optimizer do"
        )
    return (
        f"warning: dataset changed ({training.get('dataset_name')!r} -> "
        f"{cfg.data.train.dataset_name!r}): starting the dataloader fresh"
    )


def _load_buffer(buffer: ReplayBuffer, saved: Any, where: str) -> None:
    try:
        buffer.load_state_dict(saved)
    except ReplayBufferError as exc:
        raise ResumeError(f"{where}: its replay buffer cannot be restored: {exc}") from None


def _check_capacity(ledger: PromptLedger, capacity: int, sampler_name: str, where: str) -> None:
    """Prompts promised to a target step must all hold a permit at once: a later target's
    groups holding the permits an earlier target's prompts wait for would stop both pumps."""
    count = len(ledger.outstanding)
    stamped = any(batch.target_step is not None for batch, _ in ledger.outstanding.values())
    if stamped and count > capacity:
        raise ResumeError(
            f"{where} has {count} prompts admitted for target steps (sampler {sampler_name!r}) "
            f"but async_rl.max_buffered_rollouts={capacity} cannot hold them at once: set it to "
            f"at least {count} (or change the sampler, which skips them)"
        )
