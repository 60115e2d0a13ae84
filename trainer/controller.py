"""The single controller: a rollout pump and a train pump over one asyncio loop (DESIGN.md §9).

The rollout pump admits prompt batches from the prompt stream (gated by the sampler and by
capacity permits), reserves a replay-buffer slot per prompt and has a rollout worker generate the
group. The train pump waits until the sampler selects enough ready groups, has the policy worker
take a train step, syncs the new weights to every rollout worker, and then asks the checkpointer
(``trainer/checkpointing.py``) whether to save. The prompt ledger (``trainer/ledger.py``) tracks
every prompt admitted and not yet trained on, so a resumed run trains on exactly the same prompts.
A resume is read by ``trainer/resume.py`` and applied here before the pumps start; a watchdog
(``trainer/watchdog.py``) stops a run whose pumps wait on each other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from trainer import actors
from trainer.checkpointing import TrainerCheckpointer
from trainer.config import TrainerConfig
from trainer.data import PromptStream
from trainer.errors import ConfigurationError, RolloutError
from trainer.ledger import PromptLedger
from trainer.policy import Policy, supervised_warmup
from trainer.progress import progress_line
from trainer.replay import Group, ReplayBuffer
from trainer.restoring import Restoring
from trainer.rollouts import RolloutPump
from trainer.samplers import make_sampler
from trainer.sharded import PolicyGroup
from trainer.task import PromptDataset
from trainer.tiering import check_store, start_tiers
from trainer.trace import PromptTrace
from trainer.watchdog import StallError, Watchdog, diagnose
from trainer.workers import PolicyWorker, RolloutWorker, TrainStats, policy_config

__all__ = ["Controller"]


class Controller(RolloutPump, Restoring):
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
            self.sampler = make_sampler(cfg.async_rl.sampler)
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
        self.stream = self._new_stream()
        self.ledger = PromptLedger()
        self.lines: list[str] = []
        #: Progress lines: what start-up is doing (the driver prints them on stderr).
        self.progress: list[str] = []
        self.process_start = process_start
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
        self.workers_started = False  # False at the end: the budget ran out during start-up
        #: Why this start stops early after a step's save ("time" or "steps"), or None.
        self.stop_why: str | None = None
        self.rollout_tasks: set[asyncio.Task[None]] = set()
        self.launched = 0  # rollouts started (they go to the workers in turn)
        self.history: list[dict[str, Any]] = []
        # What each pump waits for, for the watchdog's diagnosis.
        self.watchdog = Watchdog(cfg.watchdog.factor, cfg.watchdog.min_seconds)
        self.stalled: StallError | None = None
        self.train_wait = "groups"
        self.permits_wanted = 0  # > 0: the rollout pump waits for that many permits
        #: Seconds of all train steps so far, and how many (the deadline uses their mean).
        self.step_seconds_total = 0.0
        self.resumed_from: int | None = None
        self.policy: Any = None

    def _new_stream(self) -> PromptStream:
        return PromptStream(
            self.dataset, self.prompts_per_step, self.cfg.seed, self.cfg.grpo.max_num_epochs
        )

    # -- output -------------------------------------------------------------------------------

    def emit(self, line: str) -> None:
        """Queue a line for the driver to print."""
        self.lines.append(line)

    def drain(self) -> list[str]:
        """The lines queued since the last call."""
        lines, self.lines = self.lines, []
        return lines

    def phase(self, what: str) -> None:
        """Queue a progress line: the seconds since process start and what begins now."""
        self.progress.append(progress_line(self.process_start, what))

    def drain_all(self) -> tuple[list[str], list[str]]:
        """The lines and the progress lines queued since the last call."""
        progress, self.progress = self.progress, []
        return self.drain(), progress

    # -- setup ------------------------------------------------------------------------------------

    async def setup(self) -> None:
        """Check the config against the run, warm up (once), start the workers, restore. A
        fork's parent is read first: a refusal comes before anything is trained or stored."""
        checkpointer = self.checkpointer
        self.phase(f"controller up; checking run {self.run_name!r}")
        await asyncio.to_thread(checkpointer.plan)
        restored = None
        if checkpointer.enabled:
            parent = await asyncio.to_thread(checkpointer.read_parent)
            if parent is not None:
                restored = self._read(parent, checkpointer.data_reset)
        self.phase(f"warm-up model {checkpointer.base_name!r}: loading it, or training it once")
        base_weights = await asyncio.to_thread(self._base_weights)
        if self._past_deadline():
            return
        cfg = self.cfg
        self.phase(
            f"starting {cfg.policy.num_workers} policy and "
            f"{cfg.async_rl.num_rollout_workers} rollout worker(s)"
        )
        store = cfg.checkpointing.store if checkpointer.enabled else None
        if cfg.policy.num_workers > 1:
            group = await PolicyGroup.start(cfg, base_weights, store)
            self.policy = group
            self.emit(
                f"policy sharded over {len(group.ranks)} workers (FSDP2) on "
                f"{len(set(group.nodes))} node(s)"
            )
        else:
            self.policy = actors.spawn(PolicyWorker, cfg.backend, cfg, base_weights, store)
        self.workers_started = True
        self.rollout_workers = [
            actors.spawn(RolloutWorker, cfg.backend, cfg)
            for _ in range(cfg.async_rl.num_rollout_workers)
        ]
        self._cond = asyncio.Condition()
        self.permits = asyncio.Semaphore(self.capacity)
        if checkpointer.enabled:
            self.phase(
                "waiting for the workers to start and check the store; then opening run "
                f"{self.run_name!r} and its newest checkpoint"
            )
            await check_store(checkpointer, self.policy)
            await start_tiers(cfg, checkpointer, self.policy)
            await asyncio.to_thread(checkpointer.open)
            if checkpointer.tiers is not None:
                checkpointer.drain_leftover()
            if restored is not None:
                await self._restore_policy(restored)
            else:
                restored = await self._restore_newest()
            if restored is not None:
                await self._apply(restored)
        await self._sync_weights(self.train_steps)

    def _past_deadline(self) -> bool:
        """Whether the time budget already ran out during start-up (before the workers
        start, the slowest part left): then this start stops at once, training nothing."""
        stops = self.checkpointer.stops
        remaining = stops.remaining() if self.checkpointer.enabled else None
        if remaining is None or remaining > 0:
            return False
        stops.fired = self.stopped_early = self.stop = True
        checkpointer = self.checkpointer
        step: int | None = None
        if checkpointer.fork_parent is None and checkpointer.existing_config() is not None:
            step = checkpointer.latest_step(checkpointer.run_name)
        if step is not None:  # where this run stays: its newest checkpoint
            self.train_steps = self.resumed_from = step
        self.emit(stops.startup_line(self.run_name, step or 0, step is None))
        return True

    def _base_weights(self) -> dict[str, torch.Tensor]:
        torch.manual_seed(self.cfg.seed)
        model = Policy(policy_config(self.cfg))
        return self.checkpointer.base_weights(model, self._warmup)

    def _warmup(self, model: Policy) -> list[float]:
        w = self.cfg.warmup
        self.emit(f"supervised warm-up: {w.steps} steps")
        return supervised_warmup(
            model, steps=w.steps, batch_size=w.batch_size, lr=w.lr, seed=self.cfg.seed
        )

    # -- the pumps ------------------------------------------------------------------------------

    async def run_training(self) -> dict[str, Any]:
        """Set up, restore, run both pumps to the end, flush the last save; returns a summary."""
        try:
            await self.setup()
            if self.stopped_early:  # the time budget ran out during start-up: no workers
                await self._shutdown(None)
                return self.summary()
            if self.train_steps >= self.max_steps:
                self.emit(
                    f"run {self.run_name!r} is already at step {self.train_steps}, "
                    f"grpo.max_num_steps={self.max_steps}: nothing to train. Raise "
                    f"grpo.max_num_steps to train further (e.g. grpo.max_num_steps="
                    f"{self.train_steps + 100})."
                )
                self.stop = True
            else:
                self.phase(f"step {self.train_steps + 1}: waiting for the first rollouts")
            await self._run_pumps()
        except BaseException as exc:
            await self._shutdown(exc)
            raise
        await self._shutdown(None)
        return self.summary()

    async def _run_pumps(self) -> None:
        """Both pumps and the watchdog, which cancels the train pump when it stalls."""
        rollout = asyncio.create_task(self._rollout_pump())
        train = asyncio.create_task(self._train_pump())
        self.watchdog.restart()
        watch = asyncio.create_task(self.watchdog.watch(lambda idle: self._stall(idle, train)))
        try:
            await train
        except asyncio.CancelledError:
            if self.stalled is None:
                raise
        finally:
            self.stop = True
            for task in (rollout, watch, *self.rollout_tasks):
                task.cancel()
            await asyncio.gather(rollout, watch, *self.rollout_tasks, return_exceptions=True)
        if self.stalled is not None:
            raise self.stalled

    def _stall(self, idle: float, train: asyncio.Task[None]) -> None:
        self.stalled = StallError(diagnose(self, self.watchdog, idle))
        train.cancel()

    async def _shutdown(self, error: BaseException | None) -> None:
        try:
            await self.checkpointer.close(self.policy, error)
        finally:
            self.trace.close()
            if self.policy is not None:
                await self.policy.close.remote()

    def summary(self) -> dict[str, Any]:
        """What the run did, for the driver and the tests."""
        ck = self.cfg.checkpointing
        return {
            "run": self.run_name,
            "train_steps": self.train_steps,
            "consumed_samples": self.consumed_samples,
            "consumed_generations": self.consumed_generations,
            "saved_steps": list(self.checkpointer.saved_steps),
            "kept_steps": self.checkpointer.kept_steps,
            "store": ck.store if ck.enabled else None,
            "db": ck.db if ck.enabled else None,
            "resumed_from": self.resumed_from,
            "stopped_early": self.stopped_early,
            "workers_started": self.workers_started,
            "history": list(self.history),
        }

    def _mean_step_seconds(self) -> float | None:
        """The mean train-step time of this process so far (None before its first step)."""
        done = self.train_steps - (self.resumed_from or 0)
        return self.step_seconds_total / done if done > 0 else None

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

            self.train_wait = "groups"
            waited = await self._wait_in_budget(ready)
            if self.fatal is not None:
                raise RolloutError(
                    f"rollouts failed {self.rollout_failures} times in a row, the last with "
                    f"{type(self.fatal).__name__}: {self.fatal}"
                ) from self.fatal
            if await self._out_of_time():  # checked before every step, the first included
                return
            if not waited:
                continue
            if self.stop or chosen is None:
                return
            if not chosen:  # rollouts exhausted and nothing left to train on
                break
            await self._train_on(chosen, started)
            self.watchdog.stepped()
            if self.train_steps - (self.resumed_from or 0) == 1:
                self.phase(f"step {self.train_steps} trained; training on")
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
        self.train_wait = f"the policy worker's train step {version + 1}"
        stats: TrainStats = await self.policy.train_step.remote(data)
        # The new version becomes visible to the rollout pump only once every worker has it.
        self.train_wait = f"the rollout workers to take weight version {version + 1}"
        await self._sync_weights(version + 1)
        self.train_steps = version + 1
        self.consumed_samples += len(groups)
        self.consumed_generations += int(data.batch_size[0])
        self.total_valid_tokens += stats.tokens
        metrics = {
            "reward": float(data["rewards"].mean()),
            "kl": stats.kl,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "clip_frac": stats.clip_frac,
            "staleness": float((version - data["weight_version"]).float().mean()),
            "buffer": float(len(self.buffer)),
        }
        self.history.append(
            {
                "step": self.train_steps,
                "reward": metrics["reward"],
                "prompt_ids": [g.prompt_id for g in groups],
                "metrics": metrics,
            }
        )
        run = self.checkpointer.run
        if run is not None and run.writable:  # the per-step curve, written in batches
            run.log_metrics(self.train_steps, {f"train:{k}": v for k, v in metrics.items()})
        self.step_seconds_total += time.perf_counter() - started
        await self._notify()
        self.train_wait = f"the checkpoint save of step {self.train_steps}"
        save_note = await self._checkpoint(metrics)
        if self.train_steps % self.cfg.logger.print_every == 0 or save_note:
            self.emit(
                f"step {self.train_steps:>4} | reward {metrics['reward']:.3f} | buffer "
                f"{metrics['buffer']:>3.0f} | staleness {metrics['staleness']:.2f} | kl "
                f"{metrics['kl']:.4f}{save_note}"
            )
        if self.stop_why is not None:
            mean = self._mean_step_seconds()
            stops = self.checkpointer.stops
            self.emit(stops.stop_line(self.stop_why, self.run_name, self.train_steps, mean, True))

    async def _checkpoint(self, metrics: dict[str, float]) -> str:
        """Commit a finished save, and save this step if a trigger fires."""
        checkpointer = self.checkpointer
        if not checkpointer.enabled:
            return ""
        await checkpointer.poll(self.policy)
        checkpointer.report()
        drained = self.exhausted and self.ledger.inflight == 0 and not self.buffer.ready_groups()
        last = self.train_steps >= self.max_steps or drained
        done = self.train_steps - (self.resumed_from or 0)
        trigger, stop = checkpointer.trigger(
            self.train_steps, done, self._mean_step_seconds(), last
        )
        if trigger is None:
            return ""
        blocked = await self._save(trigger, metrics)
        self.stop_why = stop
        self.stopped_early = stop is not None
        return f" | save ({trigger}) blocked {blocked:.3f}s"

    async def _wait_in_budget(self, ready: Callable[[], bool]) -> bool:
        """Wait until ``ready()`` holds or the run stops (True), or until the time budget can
        no longer hold a step and a save (False)."""
        mean = self._mean_step_seconds()
        left = self.checkpointer.stops.left_to_wait(mean) if self.checkpointer.enabled else None
        try:
            await asyncio.wait_for(self._wait_until(ready), timeout=left)
        except TimeoutError:
            return False
        return True

    async def _out_of_time(self) -> bool:
        """Before a step: whether the time budget cannot hold it and a save; then what is not
        saved yet is saved at once and the start stops (a deadline is never overrun)."""
        checkpointer, mean = self.checkpointer, self._mean_step_seconds()
        stops = checkpointer.stops
        if not checkpointer.enabled or stops.fired or not stops.out_of_time(mean):
            return False
        stops.fired = self.stopped_early = True
        if mean is None:  # no step in this start: nothing new exists
            new = self.resumed_from is None
            self.emit(stops.startup_line(self.run_name, self.train_steps, new))
            return True
        unsaved = self.train_steps > max(checkpointer.saved_steps, default=0)
        if unsaved:
            await self._save("timeout", self.history[-1]["metrics"])
        self.emit(stops.stop_line("time", self.run_name, self.train_steps, mean, unsaved))
        return True

    async def _save(self, trigger: str, metrics: dict[str, float]) -> float:
        """Save this step (the uploads go on in the background); the seconds it blocked."""
        return await self.checkpointer.save(
            trigger,
            self.train_steps,
            policy=self.policy,
            buffer_state=self.buffer.state_dict(),
            components={
                "dataloader": self.stream.state_dict(),
                "rollout_state": self.ledger.state_dict(self.sampler.dispatch_index),
            },
            training_info=self._training_info(metrics),
            metrics={f"train:{key}": value for key, value in metrics.items()},
        )

    def _training_info(self, metrics: dict[str, float]) -> dict[str, Any]:
        metric_name = self.cfg.checkpointing.metric_name
        return {
            "consumed_samples": self.consumed_samples,
            "consumed_generations": self.consumed_generations,
            "current_step": self.train_steps,
            "current_epoch": self.stream.epoch,
            "total_steps": self.train_steps,  # steps taken, as the reference records
            "total_valid_tokens": self.total_valid_tokens,
            "sampler_name": self.sampler.name,
            "dataset_name": self.dataset_name,
            "num_generations_per_prompt": self.group_size,
            metric_name: metrics[metric_name.partition(":")[2]],
        }

    async def _sync_weights(self, version: int) -> None:
        weights = await self.policy.weights.remote()
        if self.cfg.backend == "ray":
            import ray

            weights = ray.put(weights)
        await asyncio.gather(
            *(w.set_weights.remote(version, weights) for w in self.rollout_workers)
        )
