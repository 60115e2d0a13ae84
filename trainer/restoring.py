"""The controller's resume: a checkpoint read and applied before the pumps start.

:class:`Restoring` is a mixin of :class:`~trainer.controller.Controller`: it reads the newest
checkpoint that verifies (``trainer/resume.py`` decodes it), loads its policy into the policy
workers (falling back past a sharded policy whose data is damaged) and takes over its counters,
prompt stream, replay buffer and prompt ledger.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ckptstore import IntegrityError, LoadedCheckpoint
from trainer.checkpointing import TrainerCheckpointer
from trainer.config import TrainerConfig
from trainer.data import PromptStream
from trainer.errors import ResumeError
from trainer.ledger import PromptLedger
from trainer.replay import ReplayBuffer
from trainer.resume import Restored, read_checkpoint
from trainer.samplers import PromptGroupSampler
from trainer.tiering import resume_reads, tier_sources
from trainer.trace import PromptTrace

__all__ = ["Restoring"]


class Restoring:
    """The controller's resume side (a mixin of :class:`~trainer.controller.Controller`)."""

    cfg: TrainerConfig
    checkpointer: TrainerCheckpointer
    sampler: PromptGroupSampler
    policy: Any
    train_steps: int
    consumed_samples: int
    consumed_generations: int
    total_valid_tokens: int
    stream: PromptStream
    buffer: ReplayBuffer
    ledger: PromptLedger
    permits: asyncio.Semaphore
    trace: PromptTrace
    resumed_from: int | None
    emit: Callable[[str], None]
    _new_stream: Callable[[], PromptStream]

    @property
    def run_name(self) -> str:
        """The run this controller trains (a fork's new name once decided)."""
        return self.checkpointer.run_name

    def _read(self, loaded: LoadedCheckpoint, data_reset: str | None = None) -> Restored:
        return read_checkpoint(loaded, self.cfg, self.sampler.name, self._new_stream, data_reset)

    async def _restore_newest(self) -> Restored | None:
        """The newest checkpoint that verifies, its policy loaded into the policy workers.
        A sharded policy is verified by the workers as they read it; when its data is
        damaged, the checkpoint is marked corrupt here and the previous one is taken."""
        checkpointer = self.checkpointer
        while True:
            loaded = await asyncio.to_thread(checkpointer.restore)
            if loaded is None:
                return None
            restored = self._read(loaded)
            try:
                policy_read = await self._restore_policy(restored)
            except IntegrityError as exc:
                if not restored.sharded:
                    raise
                await asyncio.to_thread(checkpointer.condemn, loaded.info, exc)
                continue
            if checkpointer.tiers is not None:
                self.emit(resume_reads(loaded, policy_read))
            return restored

    async def _apply(self, restored: Restored) -> None:
        """Take over what a checkpoint restores (trainer/resume.py), before the pumps start;
        the policy is already restored (:meth:`_restore_policy`)."""
        step = restored.step
        self.train_steps = step
        self.consumed_samples = restored.consumed_samples
        self.consumed_generations = restored.consumed_generations
        self.total_valid_tokens = restored.total_valid_tokens
        self.stream, self.buffer, self.ledger = restored.stream, restored.buffer, restored.ledger
        for _ in restored.buffer.groups:  # one capacity permit per restored group
            await self.permits.acquire()
        self.sampler.dispatch_index = restored.dispatch_index
        self.resumed_from = step
        self.trace.resume(step)
        for group_id, prompt_id in restored.skipped:
            self.trace.drop(step, group_id, prompt_id, "skipped")
        for line in restored.warnings:
            self.emit(line)
        self.emit(
            f"resumed run {restored.run!r} from step {step}: {len(self.buffer)} buffered "
            f"groups, {len(self.ledger.redispatch)} prompts to re-dispatch"
        )

    async def _restore_policy(self, restored: Restored) -> dict[str, int]:
        """Load the policy; the bytes its workers read from each node's tier and the store
        (a sharded policy read through the tiers; else nothing: the controller read it)."""
        checkpointer = self.checkpointer
        if restored.sharded and not (restored.run != self.run_name and checkpointer.fork_fresh):
            plan = await asyncio.to_thread(checkpointer.policy_plan, restored.run, restored.step)
            sources = await asyncio.to_thread(tier_sources, checkpointer.run, plan.info)
            read: dict[str, int] = await self.policy.load_sharded.remote(
                plan, restored.sharded_optimizer, sources
            )
            return read
        if not restored.sharded and await self.policy.load.remote(
            restored.policy, restored.optimizer
        ):
            return {}
        if restored.run == self.run_name:
            raise ResumeError(
                f"{restored.where}: the saved policy does not fit the configured model; the "
                "run's model config must not change (set checkpointing.fork=true to fork it)"
            )
        self.emit(
            f"the fork {self.run_name!r} starts from the warm-up model "
            f"{self.checkpointer.base_name!r} (fork_init=fresh) and keeps the training state "
            f"of {restored.where}"
        )
        return {}
