"""The single controller: a rollout pump and a train pump over one asyncio loop (DESIGN.md §9).

The rollout pump admits prompt batches from the stateful dataloader (gated by the sampler and by
capacity permits), reserves a replay-buffer slot per prompt and has a rollout worker generate the
group. The train pump waits until the sampler selects enough ready groups, has the policy worker
take a train step, syncs the new weights to every rollout worker, and then checks the save
triggers. A checkpoint holds the policy and optimizer shards (uploaded by the policy worker
itself), the replay buffer's ready groups, the dataloader state, the prompts admitted but not yet
trained (so a resumed run trains on exactly the same prompts) and the training counters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict
from torchdata.stateful_dataloader import StatefulDataLoader

from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer import (
    CheckpointInfo,
    RetentionPolicy,
    Run,
    SaveHandle,
    ShardWriter,
    open_run,
    run_info,
)
from trainer import actors
from trainer.config import (
    changed_keys,
    fingerprint,
    model_config,
    parse_deadline,
    training_config,
)
from trainer.policy import Policy, supervised_warmup
from trainer.replay import Group, ReplayBuffer
from trainer.samplers import make_sampler
from trainer.task import PromptDataset
from trainer.workers import PolicyWorker, RolloutWorker, policy_config

log = logging.getLogger("trainer")

#: Rollouts that may fail in a row (their prompts are dispatched again) before training stops.
MAX_ROLLOUT_FAILURES = 3


class TrainerError(RuntimeError):
    """A configuration or checkpoint problem the user must fix; the message says how."""


@dataclass
class Prompt:
    group_id: int
    prompt_id: int
    state: str = "waiting"  # waiting -> inflight -> ready; removed once trained or dropped


@dataclass
class Batch:
    """One admitted prompt batch (the unit the dispatch index counts)."""

    dispatch_index: int
    target_step: int | None
    prompts: list[Prompt] = field(default_factory=list)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class Controller:
    def __init__(self, cfg: dict[str, Any], process_start: float) -> None:
        torch.set_num_threads(1)
        self.cfg = cfg
        self.process_start = process_start
        grpo, rl = cfg["grpo"], cfg["async_rl"]
        self.max_steps = int(grpo["max_num_steps"])
        self.prompts_per_step = int(grpo["num_prompts_per_step"])
        self.group_size = int(grpo["num_generations_per_prompt"])
        self.max_inflight = int(rl["max_inflight_prompts"])
        self.capacity = int(rl["max_buffered_rollouts"])
        self.min_groups = int(rl["min_groups_for_streaming_train"] or self.prompts_per_step)
        self.sampler = make_sampler(rl["sampler"])
        need = self.sampler.required_buffer_capacity(self.prompts_per_step)
        if self.capacity < need:
            raise TrainerError(
                f"async_rl.max_buffered_rollouts={self.capacity} is too small for sampler "
                f"{self.sampler.name!r} with {self.prompts_per_step} prompts per step: it needs "
                f"at least {need}"
            )
        self.buffer = ReplayBuffer(self.capacity, self.group_size)
        ck = cfg["checkpointing"]
        self.ck = ck
        self.budget = parse_deadline(ck["checkpoint_must_save_by"], process_start)
        self.dataset_name = str(cfg["data"]["train"]["dataset_name"])
        self.dataset = PromptDataset(
            self.dataset_name,
            int(cfg["data"]["train"]["num_prompts"]),
            int(cfg["task"]["num_digits"]),
            int(cfg["seed"]),
        )
        self.dataloader = self._make_dataloader()
        self._data_iter: Any = None
        # Counters (saved in training_info).
        self.train_steps = 0
        self.consumed_samples = 0
        self.current_epoch = 0
        self.total_valid_tokens = 0
        self.next_group_id = 0
        # Dispatch bookkeeping.
        # Every prompt admitted and not yet trained on or dropped, by group id.
        self.outstanding: dict[int, tuple[Batch, Prompt]] = {}
        self.redispatch: deque[tuple[Batch, Prompt]] = deque()
        self.inflight = 0
        self.aborted: set[int] = set()
        self.rollout_failures = 0  # in a row
        self.fatal: BaseException | None = None
        self.exhausted = False
        self.stop = False
        self.rollout_tasks: set[asyncio.Task[None]] = set()
        # Outputs.
        self.lines: list[str] = []
        self.history: list[dict[str, Any]] = []
        self.step_seconds: list[float] = []
        self.deadline_fired = False
        self.stopped_early = False
        self.run: Run | None = None
        self.pending: SaveHandle | None = None
        self.pending_blocked = 0.0
        self.saved_steps: list[int] = []
        self.resumed_from: int | None = None

    # -- output -------------------------------------------------------------------------------

    def emit(self, line: str) -> None:
        self.lines.append(line)

    def drain(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines

    # -- setup ------------------------------------------------------------------------------------

    def _make_dataloader(self) -> StatefulDataLoader:
        generator = torch.Generator().manual_seed(int(self.cfg["seed"]))
        return StatefulDataLoader(
            self.dataset,
            batch_size=self.prompts_per_step,
            shuffle=True,
            drop_last=True,
            generator=generator,
        )

    async def setup(self) -> None:
        backend = self.cfg["backend"]
        base_weights = await asyncio.to_thread(self._base_weights)
        store = self.ck["store"] if self.ck["enabled"] else None
        self.policy = actors.spawn(PolicyWorker, backend, self.cfg, base_weights, store)
        workers = int(self.cfg["async_rl"]["num_rollout_workers"])
        self.rollout_workers = [
            actors.spawn(RolloutWorker, backend, self.cfg) for _ in range(max(1, workers))
        ]
        self._cond = asyncio.Condition()
        self.permits = asyncio.Semaphore(self.capacity)
        if self.ck["enabled"]:
            await asyncio.to_thread(self._open_run)
            await self._restore()
        await self._sync_weights(self.train_steps)

    def _base_weights(self) -> dict[str, torch.Tensor]:
        """The warm-up model, stored once as its own run and shared by every GRPO run that
        uses the same task, architecture and warm-up (it is also the frozen reference)."""
        spec = model_config(self.cfg)
        self.base_name = f"base-{fingerprint(spec)}"
        self.base_step = int(self.cfg["warmup"]["steps"])
        torch.manual_seed(int(self.cfg["seed"]))
        model = Policy(policy_config(self.cfg))
        if not self.ck["enabled"]:
            self._warmup(model)
            return model.state_dict()
        with open_run(
            self.base_name, db=self.ck["db"], store=self.ck["store"], config=spec, async_save=False
        ) as base:
            if base.latest() is None:
                losses = self._warmup(model)
                base.save(
                    self.base_step,
                    {"policy": model.state_dict()},
                    metrics={"warmup:loss": losses[-1] if losses else None},
                    kinds={"policy": "policy"},
                    trigger="last",
                )
                self.emit(f"stored the warm-up model as run {self.base_name!r}")
            else:
                loaded = base.load(components=["policy"])
                self.base_step = loaded.info.step
                model.load_state_dict(loaded.state["policy"])
        return model.state_dict()

    def _warmup(self, model: Policy) -> list[float]:
        w = self.cfg["warmup"]
        self.emit(f"supervised warm-up: {w['steps']} steps")
        return supervised_warmup(
            model,
            steps=int(w["steps"]),
            batch_size=int(w["batch_size"]),
            lr=float(w["lr"]),
            seed=int(self.cfg["seed"]),
        )

    def _open_run(self) -> None:
        ck = self.ck
        name = str(ck["run_name"])
        train_cfg = training_config(self.cfg)
        retention = RetentionPolicy(
            keep_top_k=ck["keep_top_k"],
            keep_latest_k=int(ck["keep_latest_k"] or 0),
            metric_name=ck["metric_name"],
            higher_is_better=bool(ck["higher_is_better"]),
        )
        self.restore_from: tuple[str, int] | None = None
        # The base run was opened for writing first, so the database exists by now.
        existing = run_info(name, db=ck["db"])
        old_cfg = existing.config if existing is not None else None
        old_model = model_config(old_cfg) if old_cfg is not None else None
        if old_model is not None and old_model != model_config(train_cfg):
            changed = changed_keys(old_model, model_config(train_cfg))
            if not ck["fork"]:
                raise TrainerError(
                    f"run {name!r} was trained with a different model config (changed: "
                    f"{', '.join(changed)}); resuming it would mix two trainings. Set "
                    "checkpointing.fork=true to start a new run from its newest checkpoint "
                    "(lineage is recorded), or choose another checkpointing.run_name."
                )
            parent = open_run(name, db=ck["db"], store=ck["store"], writable=False)
            try:
                latest = parent.latest()
            finally:
                parent.close()
            if latest is None:
                raise TrainerError(f"cannot fork run {name!r}: it has no committed checkpoint")
            fork_name = f"{name}-fork-{fingerprint(model_config(train_cfg))}"
            self.emit(
                f"config changed ({', '.join(changed)}): forking run {name!r}@{latest.step} "
                f"into {fork_name!r}"
            )
            self.restore_from = (name, latest.step)
            name, fork_from = fork_name, (name, latest.step)
        else:
            fork_from = (self.base_name, self.base_step)
        self.run = open_run(
            name,
            db=ck["db"],
            store=ck["store"],
            config=train_cfg,
            retention=retention,
            async_save=bool(ck["async_save"]),
            fork_from=fork_from,
            # Runtime settings (steps, sampler, dataset, save policy) may change between the
            # runs of one job; the model config was checked above.
            allow_config_change=True,
        )
        self.run_name = name
        # Replay-buffer groups: no packs, so an unchanged group stores the same blobs again.
        self.buffer_writer = ShardWriter(self.run.store, options=WriterOptions(pack_threshold=0))

    # -- resume -----------------------------------------------------------------------------------

    async def _restore(self) -> None:
        assert self.run is not None
        source = self.run
        latest = await asyncio.to_thread(source.latest)
        if latest is None and self.restore_from is not None:
            parent_name, step = self.restore_from
            source = open_run(parent_name, db=self.ck["db"], store=self.ck["store"], writable=False)
        try:
            if latest is None and self.restore_from is None:
                self.emit(f"new run {self.run_name!r} (forked from {self.base_name!r})")
                return
            step = latest.step if latest is not None else self.restore_from[1]  # type: ignore[index]
            loaded = await asyncio.to_thread(source.load, step)
        finally:
            if source is not self.run:
                source.close()
        await self._restore_state(loaded.info, loaded.state)

    async def _restore_state(self, info: CheckpointInfo, state: dict[str, Any]) -> None:
        """Counters, dispatch index, dataloader, buffer, permits — all before the pumps start."""
        training = info.training_info or {}
        step = int(training["current_step"])
        where = f"run {info.run!r} step {info.step}"
        self.train_steps = step
        self.consumed_samples = int(training.get("consumed_samples", 0))
        self.current_epoch = int(training.get("current_epoch", 0))
        self.total_valid_tokens = int(training.get("total_valid_tokens", 0))
        self.sampler.set_dispatch_index(step)
        fits = await self.policy.load.remote(
            state["policy"], state.get("optimizer") if self.ck["save_optimizer"] else None
        )
        if not fits:
            if info.run == getattr(self, "run_name", None):
                raise TrainerError(
                    f"{where}: the saved policy does not fit the configured model; the run's "
                    "model config must not change (set checkpointing.fork=true to fork it)"
                )
            self.emit(
                f"the policy of {where} does not fit the new model config: the fork starts "
                f"from the warm-up model {self.base_name!r} and keeps the training state"
            )
        rollout = state.get("rollout_state") or {}
        self.next_group_id = int(rollout.get("next_group_id", 0))
        same_data = training.get("dataset_name") == self.dataset_name
        if "dataloader" not in state:
            raise TrainerError(
                f"{where} has no dataloader state, so resuming would replay or skip prompts; "
                "load an older checkpoint or start a new run (checkpointing.run_name)"
            )
        if same_data:
            self.dataloader.load_state_dict(state["dataloader"])
        else:
            log.warning(
                "data.train.dataset_name changed from %r to %r: the dataloader starts fresh",
                training.get("dataset_name"),
                self.dataset_name,
            )
            self.emit(
                f"warning: dataset changed ({training.get('dataset_name')!r} -> "
                f"{self.dataset_name!r}): starting the dataloader fresh"
            )
            self.current_epoch = 0
        restored: list[Group] = []
        saved_sampler = training.get("sampler_name")
        if "replay_buffer" in state and saved_sampler == self.sampler.name:
            restored = self.buffer.load_state_dict(state["replay_buffer"])
            for _ in restored:
                await self.permits.acquire()
        elif "replay_buffer" in state:
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
        ready = {g.group_id for g in restored}
        if same_data:
            for saved in rollout.get("batches", []):
                self.sampler.admit(self.train_steps)
                batch = Batch(int(saved["dispatch_index"]), saved["target_step"])
                for group_id, prompt_id in saved["prompts"]:
                    prompt = Prompt(int(group_id), int(prompt_id))
                    self._register(batch, prompt)
                    if prompt.group_id in ready:
                        prompt.state = "ready"
                    else:
                        self.redispatch.append((batch, prompt))
        for group in restored:
            if group.group_id not in self.outstanding:  # its prompt belongs to another dataset
                alone = Batch(group.dispatch_index, group.target_step)
                self._register(alone, Prompt(group.group_id, group.prompt_id, "ready"))
        self.resumed_from = info.step
        self.emit(
            f"resumed run {info.run!r} from step {info.step}: {len(restored)} buffered groups, "
            f"{len(self.redispatch)} prompts to re-dispatch"
        )

    # -- the pumps ------------------------------------------------------------------------------

    async def run_training(self) -> dict[str, Any]:
        """Set up, restore, run both pumps to the end, flush the last save; returns a summary."""
        try:
            await self.setup()
            if self.train_steps >= self.max_steps:
                self.emit(
                    f"run {self.run_name!r} is already at step {self.train_steps}, "
                    f"grpo.max_num_steps={self.max_steps}: nothing to train. Raise "
                    "grpo.max_num_steps to train further (e.g. grpo.max_num_steps=300)."
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
            await asyncio.to_thread(self._close, exc)
            raise
        finally:
            policy = getattr(self, "policy", None)
            if policy is not None:
                await policy.close.remote()
        await asyncio.to_thread(self._close, None)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        return {
            "run": getattr(self, "run_name", None),
            "train_steps": self.train_steps,
            "consumed_samples": self.consumed_samples,
            "saved_steps": list(self.saved_steps),
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

    def _next_prompts(self) -> Batch | None:
        """Admit the next batch from the dataloader (None when the data is exhausted)."""
        while True:
            if self._data_iter is None:
                self._data_iter = iter(self.dataloader)
            try:
                item = next(self._data_iter)
                break
            except StopIteration:
                self._data_iter = None
                self.current_epoch += 1
                if self.current_epoch >= int(self.cfg["grpo"]["max_num_epochs"]):
                    return None
        target = self.sampler.admit(self.train_steps)
        batch = Batch(self.sampler.dispatch_index, target)
        for prompt_id in item["prompt_id"].tolist():
            self._register(batch, Prompt(self.next_group_id, int(prompt_id)))
            self.next_group_id += 1
        return batch

    async def _rollout_pump(self) -> None:
        worker = 0
        while not self.stop:
            # Prompts to dispatch again (restored, or whose rollout failed) go first and are
            # not gated: they were admitted already.
            await self._wait_until(
                lambda: (
                    bool(self.redispatch)
                    or (
                        not self.exhausted
                        and self.sampler.can_admit(self.train_steps)
                        and self.inflight + self.prompts_per_step <= self.max_inflight
                    )
                )
            )
            if self.stop:
                return
            if self.redispatch:
                todo = list(self.redispatch)
                self.redispatch.clear()
            else:
                batch = self._next_prompts()
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
                prompt.state = "inflight"
                self.inflight += 1
            handle = self.rollout_workers[worker % len(self.rollout_workers)]
            worker += 1
            task = asyncio.create_task(self._rollout(handle, todo))
            self.rollout_tasks.add(task)
            task.add_done_callback(self.rollout_tasks.discard)

    async def _rollout(self, worker: Any, todo: list[tuple[Batch, Prompt]]) -> None:
        requests = [
            {"group_id": p.group_id, "digits": self.dataset.digits[p.prompt_id].tolist()}
            for _, p in todo
        ]
        try:
            results = await worker.generate.remote(requests)
        except BaseException as exc:
            for batch, prompt in todo:
                self._drop(batch, prompt)
            if not isinstance(exc, asyncio.CancelledError):
                self.rollout_failures += 1
                if self.rollout_failures >= MAX_ROLLOUT_FAILURES:
                    self.fatal = exc
                    self.stop = True
                    await self._notify()
                    raise
                log.exception("rollout failed; its prompts are dispatched again")
                for batch, prompt in todo:
                    prompt.state = "waiting"
                    self._register(batch, prompt)
                    self.redispatch.append((batch, prompt))
            await self._notify()
            raise
        self.rollout_failures = 0
        for (batch, prompt), result in zip(todo, results, strict=True):
            self.inflight -= 1
            if prompt.group_id in self.aborted:
                self.aborted.discard(prompt.group_id)
                self._drop(batch, prompt, counted=False)
                continue
            self.buffer.commit(
                prompt.group_id,
                sample_ids=result["sample_ids"],
                seq_lens=result["seq_lens"],
                weight_versions=result["weight_versions"],
                payload=result["payload"],
                end_weight=self.train_steps,
            )
            prompt.state = "ready"
        await self._notify()

    def _drop(self, batch: Batch, prompt: Prompt, *, counted: bool = True) -> None:
        """Forget a prompt's group (failed, aborted, evicted or cancelled) and free its permit."""
        if counted and prompt.state == "inflight":
            self.inflight -= 1
        try:
            self.buffer.rollback(prompt.group_id)
        except KeyError:
            pass
        else:
            self.permits.release()
        self._forget(batch, prompt)

    def _register(self, batch: Batch, prompt: Prompt) -> None:
        batch.prompts.append(prompt)
        self.outstanding[prompt.group_id] = (batch, prompt)

    def _forget(self, batch: Batch, prompt: Prompt) -> None:
        if prompt in batch.prompts:
            batch.prompts.remove(prompt)
        self.outstanding.pop(prompt.group_id, None)

    def _prompt_of(self, group: Group) -> tuple[Batch, Prompt]:
        return self.outstanding[group.group_id]

    def _evict(self) -> None:
        v = self.train_steps
        for group in self.sampler.evict(self.buffer.ready_groups(), v):
            batch, prompt = self._prompt_of(group)
            self._drop(batch, prompt)
        for group in self.buffer.groups:
            if not group.ready and self.sampler.should_abort_inflight(group, v):
                self.aborted.add(group.group_id)

    def _selectable(self) -> list[Group] | None:
        """Groups for the next train step, or None while it must wait."""
        self._evict()
        chosen = self.sampler.select(
            self.buffer.ready_groups(), self.train_steps, self.prompts_per_step
        )
        if len(chosen) >= self.min_groups:
            return chosen
        drained = self.exhausted and self.inflight == 0 and not self.redispatch
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
                raise TrainerError(
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
        self._report_saves()

    async def _train_on(self, chosen: list[Group], started: float) -> None:
        taken = self.buffer.take(chosen)
        for group, _ in taken:
            batch, prompt = self._prompt_of(group)
            self._forget(batch, prompt)
            self.permits.release()
        data: TensorDict = torch.cat([payload for _, payload in taken])  # type: ignore[assignment]
        version = self.train_steps
        stats = await self.policy.train_step.remote(data)
        # The new version becomes visible to the rollout pump only once every worker has it.
        await self._sync_weights(version + 1)
        self.train_steps = version + 1
        self.consumed_samples += int(data.batch_size[0])
        self.total_valid_tokens += int(stats["tokens"])
        reward = float(data["rewards"].mean())
        staleness = float((version - data["weight_version"]).float().mean())
        self.history.append(
            {
                "step": self.train_steps,
                "reward": reward,
                "prompt_ids": [g.prompt_id for g, _ in taken],
            }
        )
        self.step_seconds.append(time.perf_counter() - started)
        await self._notify()
        save_note = ""
        trigger = self._trigger()
        if trigger is not None and self.run is not None:
            save_note = await self._save(trigger, reward)
        self._report_saves()
        self.emit(
            f"step {self.train_steps:>4} | reward {reward:.3f} | buffer {len(self.buffer):>3} "
            f"| staleness {staleness:.2f} | kl {stats['kl']:.4f}{save_note}"
        )
        if trigger == "timeout":
            self.stopped_early = True
            self.emit(
                f"checkpoint_must_save_by: the time budget ({self.budget:.0f} s from process "
                f"start) would run out before another step; saved step {self.train_steps} "
                f"of run {self.run_name!r} and stopping early. Re-run the same command to resume."
            )

    def _trigger(self) -> str | None:
        if self.budget is not None and not self.deadline_fired:
            elapsed = time.time() - self.process_start
            mean_step = sum(self.step_seconds) / len(self.step_seconds)
            if elapsed + mean_step >= self.budget:
                self.deadline_fired = True
                return "timeout"
        drained = self.exhausted and self.inflight == 0 and not self.buffer.ready_groups()
        if self.train_steps >= self.max_steps or drained:
            return "last"
        if self.train_steps % int(self.ck["save_period"]) == 0:
            return "period"
        return None

    async def _sync_weights(self, version: int) -> None:
        weights = await self.policy.weights.remote()
        if self.cfg["backend"] == "ray":
            import ray

            weights = ray.put(weights)
        await asyncio.gather(
            *(w.set_weights.remote(version, weights) for w in self.rollout_workers)
        )

    # -- saving -----------------------------------------------------------------------------------

    async def _save(self, trigger: str, reward: float) -> str:
        assert self.run is not None
        if self.pending is not None:  # one save in flight: report the previous one first
            previous, self.pending = self.pending, None
            self._emit_saved(await asyncio.to_thread(previous.wait))
        started = time.perf_counter()
        receipts = await self.policy.save_shards.remote(bool(self.ck["save_optimizer"]))
        buffer_receipt = await asyncio.to_thread(
            self.buffer_writer.write,
            "replay_buffer",
            self.buffer.state_dict(),
            kind="replay_buffer",
        )
        components = {
            "dataloader": self.dataloader.state_dict(),
            "rollout_state": self._rollout_state(),
        }
        training_info = {
            "consumed_samples": self.consumed_samples,
            "current_step": self.train_steps,
            "current_epoch": self.current_epoch,
            "total_steps": self.max_steps,
            "total_valid_tokens": self.total_valid_tokens,
            "sampler_name": self.sampler.name,
            "dataset_name": self.dataset_name,
            str(self.ck["metric_name"]): reward,
        }
        handle = await asyncio.to_thread(
            self.run.save,
            self.train_steps,
            components,
            receipts=[*receipts, buffer_receipt],
            training_info=training_info,
            metrics={str(self.ck["metric_name"]): reward},
            trigger=trigger,
            kinds={"dataloader": "dataloader", "rollout_state": "state"},
        )
        self.pending = handle
        self.pending_blocked = time.perf_counter() - started
        self.saved_steps.append(self.train_steps)
        return f" | save ({trigger}) blocked {self.pending_blocked:.3f}s"

    def _rollout_state(self) -> dict[str, Any]:
        """Prompts admitted and not yet trained on, in dispatch order (exactly-once resume)."""
        unique = {id(batch): batch for batch, _ in self.outstanding.values()}
        order = sorted(unique.values(), key=lambda b: (b.dispatch_index, b.prompts[0].group_id))
        batches = []
        for batch in order:
            batches.append(
                {
                    "dispatch_index": batch.dispatch_index,
                    "target_step": batch.target_step,
                    "prompts": [[p.group_id, p.prompt_id] for p in batch.prompts],
                }
            )
        return {"next_group_id": self.next_group_id, "batches": batches}

    def _report_saves(self) -> None:
        handle = self.pending
        if handle is None or not handle.done():
            return
        self.pending = None
        info = handle.wait()
        self._emit_saved(info)

    def _emit_saved(self, info: CheckpointInfo) -> None:
        self.emit(
            f"saved step {info.step} ({info.trigger}): {_mib(info.logical_bytes)} logical, "
            f"{_mib(info.uploaded_bytes)} uploaded, {_mib(info.deduplicated_bytes)} deduplicated, "
            f"blocked {self.pending_blocked:.3f}s, save {info.save_seconds or 0:.2f}s"
        )

    def _close(self, error: BaseException | None) -> None:
        """Flush the pending save; raise its failure on a clean exit, chain it during one."""
        run, self.run = self.run, None
        try:
            if run is not None and error is None:
                try:
                    info = run.finalize()
                    if info is not None and self.pending is not None:
                        self._emit_saved(info)
                finally:
                    run.close()
            elif run is not None:
                run.__exit__(type(error), error, error.__traceback__)
        finally:
            self.pending = None
            writer = getattr(self, "buffer_writer", None)
            if writer is not None:
                writer.close()
