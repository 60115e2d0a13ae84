"""The single controller: a rollout pump and a train pump over one asyncio loop (DESIGN.md §9).

The rollout pump admits prompt batches from the prompt stream (gated by the sampler and by
capacity permits), reserves a replay-buffer slot per prompt and has a rollout worker generate the
group. The train pump waits until the sampler selects enough ready groups, has the policy worker
take a train step, syncs the new weights to every rollout worker, and then asks the checkpointer
(``trainer/checkpointing.py``) whether to save. The prompt ledger (``trainer/ledger.py``) tracks
every prompt admitted and not yet trained on, so a resumed run trains on exactly the same prompts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from ckptstore.checkpointer import LoadedCheckpoint
from trainer import actors
from trainer.checkpointing import TrainerCheckpointer
from trainer.config import TrainerConfig
from trainer.data import PromptStream
from trainer.errors import ConfigurationError, ResumeError, RolloutError
from trainer.ledger import Batch, Entry, Prompt, PromptLedger
from trainer.policy import Policy, supervised_warmup
from trainer.replay import Group, ReplayBuffer, ReplayBufferError
from trainer.samplers import make_sampler
from trainer.task import PromptDataset
from trainer.trace import PromptTrace
from trainer.workers import PolicyWorker, RolloutWorker, policy_config

log = logging.getLogger("trainer")

#: Rollouts that may fail in a row (their prompts are dispatched again) before training stops.
MAX_ROLLOUT_FAILURES = 3

__all__ = ["Controller"]


class Controller:
    """Owns the pumps, the replay buffer, the sampler, the prompt ledger and the counters."""

    def __init__(self, cfg: TrainerConfig, process_start: float) -> None:
        torch.set_num_threads(1)
        self.cfg = cfg
        grpo = cfg.grpo
        self.max_steps = grpo.max_num_steps
        self.prompts_per_step = grpo.num_prompts_per_step
        self.group_size = grpo.num_generations_per_prompt
        self.capacity = cfg.async_rl.max_buffered_rollouts
        try:
            self.sampler = make_sampler(cfg.async_rl.sampler.options())
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(str(exc)) from None
        need = self.sampler.required_buffer_capacity(self.prompts_per_step)
        if self.capacity < need:
            raise ConfigurationError(
                f"async_rl.max_buffered_rollouts={self.capacity} is too small for sampler "
                f"{self.sampler.name!r} with {self.prompts_per_step} prompts per step: it needs "
                f"at least {need}"
            )
        self.buffer = ReplayBuffer(self.capacity, self.group_size)
        self.dataset_name = cfg.data.train.dataset_name
        self.dataset = PromptDataset(
            self.dataset_name, cfg.data.train.num_prompts, cfg.task.num_digits, cfg.seed
        )
        self.stream = PromptStream(
            self.dataset, self.prompts_per_step, cfg.seed, grpo.max_num_epochs
        )
        self.ledger = PromptLedger()
        self.lines: list[str] = []
        self.checkpointer = TrainerCheckpointer(cfg, process_start, self.emit)
        self.trace = PromptTrace(cfg.logger.prompt_trace)
        # Counters (saved in training_info).
        self.train_steps = 0
        self.consumed_samples = 0  # prompts trained on, as the reference counts
        self.consumed_generations = 0  # samples (prompts x G)
        self.total_valid_tokens = 0
        # Run state.
        self.rollout_failures = 0  # in a row
        self.fatal: BaseException | None = None
        self.exhausted = False
        self.stop = False
        self.stopped_early = False
        self.rollout_tasks: set[asyncio.Task[None]] = set()
        self.history: list[dict[str, Any]] = []
        #: Seconds of all train steps so far, and how many (the deadline uses their mean).
        self.step_seconds_total = 0.0
        self.resumed_from: int | None = None
        self.policy: Any = None

    @property
    def run_name(self) -> str:
        """The run this controller trains (a fork's new name once decided)."""
        return self.checkpointer.run_name

    # -- output -------------------------------------------------------------------------------

    def emit(self, line: str) -> None:
        """Queue a line for the driver to print."""
        self.lines.append(line)

    def drain(self) -> list[str]:
        """The lines queued since the last call."""
        lines, self.lines = self.lines, []
        return lines

    # -- setup ------------------------------------------------------------------------------------

    async def setup(self) -> None:
        """Check the config against the run, warm up (once), start the workers, restore."""
        checkpointer = self.checkpointer
        await asyncio.to_thread(checkpointer.plan)
        base_weights = await asyncio.to_thread(self._base_weights)
        cfg = self.cfg
        store = cfg.checkpointing.store if checkpointer.enabled else None
        self.policy = actors.spawn(PolicyWorker, cfg.backend, cfg, base_weights, store)
        self.rollout_workers = [
            actors.spawn(RolloutWorker, cfg.backend, cfg)
            for _ in range(cfg.async_rl.num_rollout_workers)
        ]
        self._cond = asyncio.Condition()
        self.permits = asyncio.Semaphore(self.capacity)
        if checkpointer.enabled:
            await asyncio.to_thread(checkpointer.open)
            loaded = await asyncio.to_thread(checkpointer.restore)
            if loaded is not None:
                await self._restore(loaded)
        await self._sync_weights(self.train_steps)

    def _base_weights(self) -> dict[str, torch.Tensor]:
        torch.manual_seed(self.cfg.seed)
        model = Policy(policy_config(self.cfg))
        return self.checkpointer.base_weights(model, self._warmup)

    def _warmup(self, model: torch.nn.Module) -> list[float]:
        w = self.cfg.warmup
        self.emit(f"supervised warm-up: {w.steps} steps")
        return supervised_warmup(
            model, steps=w.steps, batch_size=w.batch_size, lr=w.lr, seed=self.cfg.seed
        )

    # -- resume -----------------------------------------------------------------------------------

    async def _restore(self, loaded: LoadedCheckpoint) -> None:
        """Counters, dispatch index, dataloader, buffer, permits — all before the pumps start."""
        info, state = loaded.info, loaded.state
        training = info.training_info or {}
        where = f"run {info.run!r} step {info.step}"
        self._check_group_size(training, where)
        step = int(training["current_step"])
        self.train_steps = step
        self.consumed_samples = int(training.get("consumed_samples", 0))
        self.consumed_generations = int(
            training.get("consumed_generations", self.consumed_samples * self.group_size)
        )
        self.total_valid_tokens = int(training.get("total_valid_tokens", 0))
        await self._restore_policy(info.run, where, state)
        rollout = state.get("rollout_state") or {}
        same_data = training.get("dataset_name") == self.dataset_name
        self._restore_stream(where, state, training, same_data)
        restored = self._restore_buffer(where, state, training)
        for _ in restored:
            await self.permits.acquire()
        ready = {g.group_id for g in restored}
        if same_data:
            self.ledger.load_state_dict(rollout, ready, where)
        else:
            self.ledger.next_group_id = int(rollout.get("next_group_id", 0))
        for group in restored:  # groups whose prompts belong to another dataset
            self.ledger.adopt(
                group.group_id, group.prompt_id, group.dispatch_index, group.target_step
            )
        # The dispatch index as saved: deriving it from the step (the reference's rule) makes
        # fresh batches reuse re-dispatched batches' indices (DESIGN.md §9.5).
        saved_index = rollout.get("dispatch_index")
        if same_data and saved_index is not None:
            self.sampler.dispatch_index = int(saved_index)
        else:
            self.sampler.set_dispatch_index(step)
        self.resumed_from = info.step
        self.trace.resume(step)
        self.emit(
            f"resumed run {info.run!r} from step {info.step}: {len(restored)} buffered groups, "
            f"{len(self.ledger.redispatch)} prompts to re-dispatch"
        )

    def _check_group_size(self, training: dict[str, Any], where: str) -> None:
        saved = training.get("num_generations_per_prompt")
        if saved is not None and int(saved) != self.group_size:
            raise ResumeError(
                f"{where} was trained with grpo.num_generations_per_prompt={saved}, the config "
                f"says {self.group_size}: its replay buffer and advantages assume groups of "
                f"{saved}. Set grpo.num_generations_per_prompt={saved}, or start a new run "
                "(checkpointing.run_name)"
            )

    async def _restore_policy(self, run: str, where: str, state: dict[str, Any]) -> None:
        save_optimizer = self.cfg.checkpointing.save_optimizer
        optimizer = state.get("optimizer") if save_optimizer else None
        if save_optimizer and optimizer is None:
            log.warning("%s has no optimizer state: the optimizer starts fresh", where)
            self.emit(f"warning: {where} has no optimizer state: the optimizer starts fresh")
        fits = await self.policy.load.remote(state["policy"], optimizer)
        if fits:
            return
        if run == self.run_name:
            raise ResumeError(
                f"{where}: the saved policy does not fit the configured model; the run's "
                "model config must not change (set checkpointing.fork=true to fork it)"
            )
        self.emit(
            f"the fork {self.run_name!r} starts from the warm-up model "
            f"{self.checkpointer.base_name!r} (fork_init=fresh) and keeps the training state "
            f"of {where}"
        )

    def _restore_stream(
        self, where: str, state: dict[str, Any], training: dict[str, Any], same_data: bool
    ) -> None:
        if "dataloader" not in state:
            raise ResumeError(
                f"{where} has no dataloader state, so resuming would replay or skip prompts; "
                "load an older checkpoint or start a new run (checkpointing.run_name)"
            )
        if not same_data:
            log.warning(
                "data.train.dataset_name changed from %r to %r: the dataloader starts fresh",
                training.get("dataset_name"),
                self.dataset_name,
            )
            self.emit(
                f"warning: dataset changed ({training.get('dataset_name')!r} -> "
                f"{self.dataset_name!r}): starting the dataloader fresh"
            )
            return
        try:
            self.stream.load_state_dict(state["dataloader"])
        except ValueError as exc:
            raise ResumeError(
                f"{where}: its dataloader state cannot be resumed ({exc}); start a new run "
                "(checkpointing.run_name) or load a checkpoint saved by this trainer version"
            ) from None

    def _restore_buffer(
        self, where: str, state: dict[str, Any], training: dict[str, Any]
    ) -> list[Group]:
        saved_sampler = training.get("sampler_name")
        if "replay_buffer" not in state:
            return []
        if saved_sampler != self.sampler.name:
            log.warning(
                "the checkpoint's sampler %r differs from the configured %r: its replay buffer "
                "is not restored",
                saved_sampler,
                self.sampler.name,
            )
            self.emit(
                f"warning: sampler changed ({saved_sampler!r} -> {self.sampler.name!r}): "
                "skipping the saved replay buffer"
            )
            return []
        try:
            return self.buffer.load_state_dict(state["replay_buffer"])
        except ReplayBufferError as exc:
            raise ResumeError(f"{where}: its replay buffer cannot be restored: {exc}") from None

    # -- the pumps ------------------------------------------------------------------------------

    async def run_training(self) -> dict[str, Any]:
        """Set up, restore, run both pumps to the end, flush the last save; returns a summary."""
        try:
            await self.setup()
            if self.train_steps >= self.max_steps:
                self.emit(
                    f"run {self.run_name!r} is already at step {self.train_steps}, "
                    f"grpo.max_num_steps={self.max_steps}: nothing to train. Raise "
                    f"grpo.max_num_steps to train further (e.g. grpo.max_num_steps="
                    f"{self.train_steps + 100})."
                )
                self.stop = True
            rollout = asyncio.create_task(self._rollout_pump())
            try:
                await self._train_pump()
            finally:
                self.stop = True
                rollout.cancel()
                for task in list(self.rollout_tasks):
                    task.cancel()
                await asyncio.gather(rollout, *self.rollout_tasks, return_exceptions=True)
        except BaseException as exc:
            await self._shutdown(exc)
            raise
        await self._shutdown(None)
        return self.summary()

    async def _shutdown(self, error: BaseException | None) -> None:
        try:
            await self.checkpointer.close(self.policy, error)
        finally:
            self.trace.close()
            if self.policy is not None:
                await self.policy.close.remote()

    def summary(self) -> dict[str, Any]:
        """What the run did, for the driver and the tests."""
        return {
            "run": self.run_name,
            "train_steps": self.train_steps,
            "consumed_samples": self.consumed_samples,
            "consumed_generations": self.consumed_generations,
            "saved_steps": list(self.checkpointer.saved_steps),
            "resumed_from": self.resumed_from,
            "stopped_early": self.stopped_early,
            "history": list(self.history),
        }

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def _wait_until(self, predicate: Callable[[], bool]) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.stop or predicate())

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

    def _mean_step_seconds(self) -> float | None:
        """The mean train-step time of this process so far (None before its first step)."""
        done = self.train_steps - (self.resumed_from or 0)
        return self.step_seconds_total / done if done > 0 else None

    async def _rollout_pump(self) -> None:
        worker = 0
        while not self.stop:
            # Prompts to dispatch again (restored, or whose rollout failed) go first and are
            # not gated: they were admitted already.
            await self._wait_until(lambda: bool(self.ledger.redispatch) or self._may_admit())
            if self.stop:
                return
            todo = self.ledger.take_redispatch()
            if not todo:
                batch = self._next_batch()
                if batch is None:
                    self.exhausted = True
                    await self._notify()
                    continue
                todo = [(batch, p) for p in batch.prompts]
            for batch, prompt in todo:
                await self.permits.acquire()
                self.buffer.reserve(
                    prompt.group_id,
                    prompt_id=prompt.prompt_id,
                    dispatch_index=batch.dispatch_index,
                    start_weight=self.train_steps,
                    target_step=batch.target_step,
                )
                self.ledger.dispatched(prompt)
            handle = self.rollout_workers[worker % len(self.rollout_workers)]
            worker += 1
            task = asyncio.create_task(self._rollout(handle, todo))
            self.rollout_tasks.add(task)
            task.add_done_callback(self.rollout_tasks.discard)

    async def _rollout(self, worker: Any, todo: list[Entry]) -> None:
        requests = [
            {"group_id": p.group_id, "digits": self.dataset.digits[p.prompt_id].tolist()}
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
            self.buffer.commit(
                prompt.group_id,
                sample_ids=result["sample_ids"],
                seq_lens=result["seq_lens"],
                weight_versions=result["weight_versions"],
                payload=result["payload"],
                end_weight=self.train_steps,
            )
            self.ledger.ready(prompt)
        await self._notify()

    async def _rollout_failed(self, todo: list[Entry], exc: BaseException) -> None:
        cancelled = isinstance(exc, asyncio.CancelledError)
        for _, prompt in todo:
            self._drop(prompt, None if cancelled else "failed")
        if not cancelled:
            self.rollout_failures += 1
            if self.rollout_failures >= MAX_ROLLOUT_FAILURES:
                self.fatal = exc
                self.stop = True
            else:
                log.warning("rollout failed (%r); its prompts are dispatched again", exc)
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

    def _evict(self) -> None:
        v = self.train_steps
        for group in self.sampler.evict(self.buffer.ready_groups(), v):
            _, prompt = self.ledger.entry(group.group_id)
            self._drop(prompt, "evicted")
        for group in self.buffer.groups:
            if not group.ready and self.sampler.should_abort_inflight(group, v):
                self.ledger.aborted.add(group.group_id)

    def _selectable(self) -> list[Group] | None:
        """Groups for the next train step, or None while it must wait."""
        self._evict()
        chosen = self.sampler.select(
            self.buffer.ready_groups(), self.train_steps, self.prompts_per_step
        )
        if len(chosen) >= self.cfg.min_groups:
            return chosen
        drained = self.exhausted and self.ledger.inflight == 0 and not self.ledger.redispatch
        return chosen if drained else None

    async def _train_pump(self) -> None:
        while self.train_steps < self.max_steps:
            started = time.perf_counter()
            chosen: list[Group] | None = None

            def ready() -> bool:
                nonlocal chosen
                chosen = self._selectable()
                return chosen is not None

            await self._wait_until(ready)
            if self.fatal is not None:
                raise RolloutError(
                    f"rollouts failed {self.rollout_failures} times in a row, the last with "
                    f"{type(self.fatal).__name__}: {self.fatal}"
                ) from self.fatal
            if self.stop or chosen is None:
                return
            if not chosen:  # rollouts exhausted and nothing left to train on
                break
            await self._train_on(chosen, started)
            if self.stopped_early:
                return
        self.checkpointer.report()

    async def _train_on(self, chosen: list[Group], started: float) -> None:
        taken = self.buffer.take(chosen)
        version = self.train_steps
        groups = [group for group, _ in taken]
        self.trace.train(
            version + 1,
            [g.prompt_id for g in groups],
            [g.group_id for g in groups],
            [g.start_weight for g in groups],
        )
        for group in groups:
            self.ledger.forget(group.group_id)
            self.permits.release()
        data: TensorDict = torch.cat([payload for _, payload in taken])  # type: ignore[assignment]
        stats = await self.policy.train_step.remote(data)
        # The new version becomes visible to the rollout pump only once every worker has it.
        await self._sync_weights(version + 1)
        self.train_steps = version + 1
        self.consumed_samples += len(groups)
        self.consumed_generations += int(data.batch_size[0])
        self.total_valid_tokens += int(stats["tokens"])
        reward = float(data["rewards"].mean())
        staleness = float((version - data["weight_version"]).float().mean())
        self.history.append(
            {
                "step": self.train_steps,
                "reward": reward,
                "prompt_ids": [g.prompt_id for g in groups],
            }
        )
        self.step_seconds_total += time.perf_counter() - started
        await self._notify()
        save_note = await self._checkpoint(reward)
        if self.train_steps % self.cfg.logger.print_every == 0 or save_note:
            self.emit(
                f"step {self.train_steps:>4} | reward {reward:.3f} | buffer {len(self.buffer):>3} "
                f"| staleness {staleness:.2f} | kl {stats['kl']:.4f}{save_note}"
            )
        if self.stopped_early:
            checkpointer = self.checkpointer
            self.emit(
                f"checkpoint_must_save_by: the time budget ({checkpointer.budget:.0f} s from "
                f"process start) would run out before another step; saved step "
                f"{self.train_steps} of run {self.run_name!r} and stopping early. Re-run the "
                "same command to resume."
            )

    async def _checkpoint(self, reward: float) -> str:
        """Commit a finished save, and save this step if a trigger fires."""
        checkpointer = self.checkpointer
        if not checkpointer.enabled:
            return ""
        await checkpointer.poll(self.policy)
        checkpointer.report()
        drained = self.exhausted and self.ledger.inflight == 0 and not self.buffer.ready_groups()
        last = self.train_steps >= self.max_steps or drained
        trigger, stop = checkpointer.trigger(self.train_steps, self._mean_step_seconds(), last)
        if trigger is None:
            return ""
        metric = self.cfg.checkpointing.metric_name
        blocked = await checkpointer.save(
            trigger,
            self.train_steps,
            policy=self.policy,
            buffer_state=self.buffer.state_dict(),
            components={
                "dataloader": self.stream.state_dict(),
                "rollout_state": self.ledger.state_dict(self.sampler.dispatch_index),
            },
            training_info=self._training_info(reward),
            metrics={metric: reward},
        )
        self.stopped_early = stop
        return f" | save ({trigger}) blocked {blocked:.3f}s"

    def _training_info(self, reward: float) -> dict[str, Any]:
        return {
            "consumed_samples": self.consumed_samples,
            "consumed_generations": self.consumed_generations,
            "current_step": self.train_steps,
            "current_epoch": self.stream.epoch,
            "total_steps": self.max_steps,
            "total_valid_tokens": self.total_valid_tokens,
            "sampler_name": self.sampler.name,
            "dataset_name": self.dataset_name,
            "num_generations_per_prompt": self.group_size,
            self.cfg.checkpointing.metric_name: reward,
        }

    async def _sync_weights(self, version: int) -> None:
        weights = await self.policy.weights.remote()
        if self.cfg.backend == "ray":
            import ray

            weights = ray.put(weights)
        await asyncio.gather(
            *(w.set_weights.remote(version, weights) for w in self.rollout_workers)
        )
