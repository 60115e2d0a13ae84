"""The rollout pump (DESIGN.md §9.2, §9.4): admit prompt batches, reserve, generate, commit.

It admits a batch from the prompt stream while the sampler's gate and the in-flight limit allow,
dispatches prompts to dispatch again (restored at a resume, or whose rollout failed) first,
takes a capacity permit per prompt before reserving its replay-buffer slot, and has the rollout
workers generate the groups in turn. The :class:`~trainer.controller.Controller` runs it beside
its train pump; both share the buffer, the ledger and the permits through the controller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from trainer.config import TrainerConfig
from trainer.data import PromptStream
from trainer.ledger import Batch, Entry, Prompt, PromptLedger
from trainer.replay import ReplayBuffer
from trainer.samplers import PromptGroupSampler
from trainer.task import PromptDataset
from trainer.trace import PromptTrace
from trainer.workers import RolloutRequest

#: Rollouts that may fail in a row (their prompts are dispatched again) before training stops.
MAX_ROLLOUT_FAILURES = 3


class RolloutPump:
    """The controller's rollout side (a mixin of :class:`~trainer.controller.Controller`)."""

    cfg: TrainerConfig
    prompts_per_step: int
    train_steps: int
    sampler: PromptGroupSampler
    stream: PromptStream
    dataset: PromptDataset
    buffer: ReplayBuffer
    ledger: PromptLedger
    trace: PromptTrace
    permits: asyncio.Semaphore
    rollout_workers: list[Any]
    rollout_tasks: set[asyncio.Task[None]]
    launched: int
    rollout_failures: int
    fatal: BaseException | None
    exhausted: bool
    stop: bool
    permits_wanted: int
    _cond: asyncio.Condition
    emit: Callable[[str], None]

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def _wait_until(self, predicate: Callable[[], bool]) -> bool:
        """Wait until ``predicate()`` holds (True) or the run stops (False)."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.stop or predicate())
        return not self.stop

    def _next_batch(self) -> Batch | None:
        """Admit the next batch from the prompt stream (None when the data is exhausted)."""
        prompt_ids = self.stream.next_batch()
        if prompt_ids is None:
            return None
        target = self.sampler.admit(self.train_steps)
        return self.ledger.admit(self.sampler.dispatch_index, target, prompt_ids.tolist())

    def _may_admit(self) -> bool:
        max_inflight = self.cfg.async_rl.max_inflight_prompts
        return (
            not self.exhausted
            and self.sampler.can_admit(self.train_steps)
            and self.ledger.inflight + self.prompts_per_step <= max_inflight
        )

    async def _rollout_pump(self) -> None:
        while not self.stop:
            # Prompts to dispatch again (restored, or whose rollout failed) go first and are
            # not gated: they were admitted already.
            if not await self._wait_until(
                lambda: bool(self.ledger.redispatch) or self._may_admit()
            ):
                return
            todo = self.ledger.take_redispatch()
            if not todo:
                batch = self._next_batch()
                if batch is None:
                    self.exhausted = True
                    await self._notify()
                    continue
                todo = [(batch, p) for p in batch.prompts]
            await self._dispatch(todo)

    async def _dispatch(self, todo: list[Entry]) -> None:
        """Reserve a buffer slot per prompt (a capacity permit each) and start the rollouts.
        Prompts that hold permits are sent before the pump waits for more: held back, they
        could never become the ready groups whose training frees the permits."""
        chunk: list[Entry] = []
        for done, (batch, prompt) in enumerate(todo):
            if chunk and self.permits.locked():
                self._launch(chunk)
                chunk = []
            self.permits_wanted = len(todo) - done
            await self.permits.acquire()
            self.permits_wanted = 0
            # A restored prompt keeps the weight version its rollout first started at, so the
            # sampler orders and evicts it as the uninterrupted run did.
            start = self.train_steps if prompt.start_weight is None else prompt.start_weight
            self.buffer.reserve(
                prompt.group_id,
                prompt_id=prompt.prompt_id,
                dispatch_index=batch.dispatch_index,
                start_weight=start,
                target_step=batch.target_step,
            )
            self.ledger.dispatched(prompt, start)
            chunk.append((batch, prompt))
        self._launch(chunk)

    def _launch(self, todo: list[Entry]) -> None:
        worker = self.rollout_workers[self.launched % len(self.rollout_workers)]
        self.launched += 1
        task = asyncio.create_task(self._rollout(worker, todo))
        self.rollout_tasks.add(task)
        task.add_done_callback(self.rollout_tasks.discard)

    async def _rollout(self, worker: Any, todo: list[Entry]) -> None:
        requests = [
            RolloutRequest(group_id=p.group_id, digits=self.dataset.digits[p.prompt_id].tolist())
            for _, p in todo
        ]
        try:
            results = await worker.generate.remote(requests)
        except BaseException as exc:
            await self._rollout_failed(todo, exc)
            raise
        self.rollout_failures = 0
        for (_, prompt), result in zip(todo, results, strict=True):
            if prompt.group_id in self.ledger.aborted:
                self._drop(prompt, "aborted")
                continue
            self.buffer.commit(result, end_weight=self.train_steps)
            self.ledger.ready(prompt)
        await self._notify()

    async def _rollout_failed(self, todo: list[Entry], exc: BaseException) -> None:
        cancelled = isinstance(exc, asyncio.CancelledError)
        for _, prompt in todo:
            self._drop(prompt, None if cancelled else "failed")
        # Once fatal, the rollouts still in flight that fail change nothing: the run stops with
        # the failure (and the count) that made it fatal.
        if not cancelled and self.fatal is None:
            self.rollout_failures += 1
            if self.rollout_failures >= MAX_ROLLOUT_FAILURES:
                self.fatal = exc
                self.stop = True
            else:
                self.emit(f"warning: rollout failed ({exc!r}); its prompts are dispatched again")
                self.ledger.requeue(todo)
        await self._notify()

    def _drop(self, prompt: Prompt, reason: str | None) -> None:
        """Forget a prompt's group (failed, aborted, evicted or cancelled) and free its permit."""
        try:
            self.buffer.rollback(prompt.group_id)
        except KeyError:
            pass
        else:
            self.permits.release()
        self.ledger.forget(prompt.group_id)
        if reason is not None:
            self.trace.drop(self.train_steps, prompt.group_id, prompt.prompt_id, reason)
