"""The trainer's checkpointer: base model, open or fork, restore, triggers, saves, retention.

It uses only ckptstore's public API. A save is asynchronous for every participant (DESIGN.md
§9.6): the policy worker snapshots its shards into reused buffers and uploads them in the
background while it takes its next train steps; the controller snapshots the replay buffer the
same way and keeps its small components (dataloader, rollout state, counters) as they were at the
save's step. The checkpoint is committed — one transaction over every receipt — once every
upload has finished (deferred finalization: checked after each train step, forced at the next
save and at exit). The manifest records the longest time any participant stopped training for
the save (``blocked_seconds``; with ``async_save=false`` the wait for the uploads too) and the
time from the first snapshot to the commit. One start opens the database and the store once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ckptstore import (
    CheckpointInfo,
    CheckpointNotFoundError,
    IntegrityError,
    LoadedCheckpoint,
    ObjectStore,
    RetentionPolicy,
    Run,
    SaveHandle,
    ShardReceipt,
    ShardWriter,
    WriterOptions,
    open_run,
    open_store,
    run_info,
)
from ckptstore.extending import (
    Database,
    TierConfig,
    default_store,
    mark_corrupt,
    writer_store,
)
from ckptstore.integrations import dcp as ckpt_dcp
from trainer.budget import StopBudget
from trainer.config import (
    TrainerConfig,
    fingerprint,
    model_config,
    parse_deadline,
    training_config,
)
from trainer.history import plan_fork, start_over
from trainer.pending import PendingSave, exit_noting, saved_lines, settle
from trainer.policy import Policy
from trainer.policy_state import SHARDED_INFO
from trainer.resume import KINDS, load_to_resume
from trainer.tiering import Drains, tier_config

#: Only these saves compete for keep_top_k (the reference ranks step % save_period == 0 saves).
RANKED_TRIGGERS = frozenset({"period"})


class TrainerCheckpointer:
    """Everything the controller does through ckptstore, behind a few calls."""

    def __init__(
        self, cfg: TrainerConfig, process_start: float, emit: Callable[[str], None]
    ) -> None:
        self.cfg = cfg
        self.ck = cfg.checkpointing
        self.enabled = self.ck.enabled
        self.emit = emit
        self.process_start = process_start
        self.budget = parse_deadline(self.ck.checkpoint_must_save_by, process_start)
        #: When this start stops early (its clock reads :attr:`clock` at each call).
        self.stops = StopBudget(
            self.budget, process_start, self.ck.stop_after_steps, lambda: self.clock()
        )
        self.run: Run | None = None
        self.run_name = self.ck.run_name
        #: What defines the model (task, architecture, warm-up, seed); resumes must not change it.
        self.model_spec = model_config(cfg)
        self.base_name = f"base-{fingerprint(self.model_spec)}"
        self.base_step = cfg.warmup.steps
        #: (parent run, its newest step) when this start forks a run whose config changed.
        self.fork_parent: tuple[str, int] | None = None
        self.fork_fresh = False
        #: The model-config keys a fork changed that change the prompts (seed, task), or None.
        self.data_reset: str | None = None
        #: The clock checkpoint_must_save_by is measured with (wall-clock seconds).
        self.clock: Callable[[], float] = time.time
        #: The run's committed steps once it is closed (what retention kept).
        self.kept_steps: list[int] | None = None
        self.pending: PendingSave | None = None
        self.committing: SaveHandle | None = None
        self.saved_steps: list[int] = []
        self._buffer_writer: ShardWriter | None = None
        #: The replay buffer's writer store on the tiers (with tiers).
        self._tier_store: ObjectStore | None = None
        self._db: Database | None = None
        self._store: ObjectStore | None = None
        #: The run's node-local tiers (checkpointing.local_dir), once the job's nodes are known.
        self.tiers: TierConfig | None = None
        #: The drains of local checkpoints to the store (with tiers).
        self.drains = Drains(emit, self.stops.monotonic_end)

    # -- before anything is trained or stored ------------------------------------------------

    def plan(self) -> None:
        """Refuse a model-config change (or decide the fork) before any warm-up or write."""
        if not self.enabled:
            return
        existing = self.existing_config()
        if existing is None:
            return
        fork = plan_fork(self.ck, existing, self.model_spec, self.latest_step)
        if fork is None:
            return
        self.fork_fresh, self.data_reset = fork.fresh, fork.data_reset
        self.fork_parent, self.run_name = fork.parent, fork.run_name
        self.emit(fork.message)

    def latest_step(self, name: str) -> int | None:
        """The step of run ``name``'s newest checkpoint (None: it has none)."""
        with self._open(name, writable=False) as parent:
            latest = parent.latest()
        return None if latest is None else latest.step

    def existing_config(self) -> dict[str, Any] | None:
        """The stored config of this start's run, or None for a run not created yet."""
        db = self.ck.db
        if db is not None and "://" not in db and not Path(db).exists():
            return None  # a new database: nothing to compare with (and nothing created yet)
        existing = run_info(self.ck.run_name, db=self.locations()[0])
        return existing.config if existing is not None else None

    def locations(self) -> tuple[Database, ObjectStore]:
        """The manifest database and the object store, opened on first use and shared by every
        run this start opens (:meth:`close` closes them)."""
        if self._db is None:
            self._db = Database(self.ck.db)
        if self._store is None:
            self._store = open_store(self.ck.store or default_store())
        return self._db, self._store

    def _open(self, name: str, **options: Any) -> Run:
        db, store = self.locations()
        return open_run(name, db=db, store=store, **options)

    def base_weights(
        self, model: Policy, warmup: Callable[[Policy], list[float]]
    ) -> dict[str, torch.Tensor]:
        """The warm-up model, stored once as run ``base-<hash>`` and shared by every GRPO run
        with the same task, architecture and warm-up (it is also the frozen reference)."""
        if not self.enabled:
            warmup(model)
            return model.state_dict()
        spec = self.model_spec
        with self._open(self.base_name, config=spec, async_save=False) as base:
            if base.latest() is None:
                losses = warmup(model)
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

    # -- node-local tiers ----------------------------------------------------------------------

    def use_tiers(self, node: str, nodes: list[str], transport: Any = None) -> TierConfig | None:
        """The run's tiers on the job's ``nodes`` (this process on ``node``): None without
        checkpointing.local_dir. Call before :meth:`open`."""
        if not self.enabled:
            return None
        self.tiers = tier_config(self.ck, node, nodes, transport, self.emit)
        return self.tiers

    def drain_leftover(self) -> None:
        """What an earlier start left local-durable (a stop on its time budget) goes to the
        store in the background, before anything this start saves."""
        assert self.run is not None
        self.drains.after(self.run, None, None)

    # -- opening and restoring ------------------------------------------------------------------

    def open(self) -> None:
        """Open (or create, or fork) the run for writing."""
        ck = self.ck
        config = training_config(self.cfg)
        if self.fork_fresh:
            config["fork_init"] = "fresh"
        fork_from = self.fork_parent or (self.base_name, self.base_step)
        self.run = self._open(
            self.run_name,
            config=config,
            retention=self.retention(),
            async_save=ck.async_save,
            fork_from=fork_from,
            # The model config identifies the run; runtime settings (steps, sampler, dataset,
            # save policy) may change between the runs of one job and are recorded.
            identity=self.model_spec,
            tiers=self.tiers,
        )
        # Replay-buffer groups: no packs, so an unchanged group stores the same blobs again.
        self._tier_store = writer_store(self.tiers) if self.tiers is not None else None
        target = self._tier_store if self._tier_store is not None else self.run.store
        self._buffer_writer = ShardWriter(target, options=WriterOptions(pack_threshold=0))

    def retention(self) -> RetentionPolicy:
        """The reference's rule: periodic saves compete for keep_top_k, the latest is kept,
        keep_latest_k protects the newest, keep_every_n_steps keeps multiples for good."""
        ck = self.ck
        return RetentionPolicy(
            keep_top_k=ck.keep_top_k,
            keep_latest_k=ck.keep_latest_k,
            keep_every_n_steps=ck.keep_every_n_steps,
            metric_name=ck.metric_name,
            higher_is_better=ck.higher_is_better,
            rank_triggers=RANKED_TRIGGERS,
        )

    def read_parent(self) -> LoadedCheckpoint | None:
        """On a fork's first start (no committed checkpoint of its own yet), the parent's
        checkpoint it starts from, read before anything is stored; None otherwise."""
        if self.fork_parent is None or self._has_checkpoint(self.run_name):
            return None
        name, step = self.fork_parent
        with self._open(name, writable=False) as parent:
            return load_to_resume(parent, step)  # the step the fork's lineage records

    def _has_checkpoint(self, name: str) -> bool:
        """Whether ``name`` has history of its own (committed checkpoints, or corrupt ones,
        which restore() must not silently abandon)."""
        if run_info(name, db=self.locations()[0]) is None:
            return False
        with self._open(name, writable=False) as run:
            return run.latest() is not None or bool(run.checkpoints(["corrupt"]))

    def restore(self) -> LoadedCheckpoint | None:
        """The newest committed checkpoint of the run that verifies, falling back past corrupt
        ones; None for a new run. A run whose every checkpoint is corrupt is refused unless
        ``checkpointing.start_fresh`` (its history is never silently abandoned)."""
        assert self.run is not None
        try:
            loaded = load_to_resume(self.run) if self.run.latest() is not None else None
        except CheckpointNotFoundError:  # every checkpoint failed verification
            if not self._lost_history():
                raise
            loaded = None
        else:
            if loaded is None:
                self._lost_history()
        if loaded is None:
            self.emit(f"new run {self.run_name!r} (forked from {self.base_name!r})")
            return None
        self.stops.saved(loaded.info.save_seconds)  # the next save's estimate
        for step, why in loaded.skipped:
            self.emit(
                f"warning: checkpoint step {step} of run {loaded.info.run!r} failed verification "
                f"({why}); it is marked corrupt and the run resumes from step {loaded.info.step}"
            )
        return loaded

    def _lost_history(self) -> bool:
        """Whether the run has checkpoints that are all corrupt; refused unless start_fresh."""
        assert self.run is not None
        corrupt = [c.step for c in self.run.checkpoints(["corrupt"])]
        return start_over(self.ck, self.run_name, corrupt, self.emit)

    def policy_plan(self, run_name: str, step: int) -> ckpt_dcp.LoadPlan:
        """What the policy workers need to read the sharded policy of ``run_name`` at ``step``
        from the store (they never open the database); its metadata is checked here first
        (``IntegrityError`` if it does not hold up)."""
        if self.run is not None and run_name == self.run.name:
            return ckpt_dcp.plan_load(self.run, step)
        with self._open(run_name, writable=False) as run:
            return ckpt_dcp.plan_load(run, step)

    def condemn(self, info: CheckpointInfo, error: IntegrityError) -> None:
        """Mark ``info`` corrupt (the policy workers found its stored data damaged) so the
        next :meth:`restore` takes the previous checkpoint."""
        assert self.run is not None
        mark_corrupt(self.run, info, error)
        self.emit(
            f"warning: checkpoint step {info.step} of run {info.run!r} failed verification "
            f"({error}); it is marked corrupt and the run resumes from an earlier checkpoint"
        )

    # -- saving -------------------------------------------------------------------------------

    def trigger(
        self, step: int, steps_done: int, mean_step_seconds: float | None, last: bool
    ) -> tuple[str | None, str | None]:
        """(trigger, stop): whether to save after ``step`` (the ``steps_done``-th of this
        start), and whether a budget ends the start ("time" or "steps", see
        :class:`~trainer.budget.StopBudget`). Saves at multiples of save_period are "period"
        saves, whatever else fired; a budget stop's save is a "timeout" save."""
        if not self.enabled:
            return None, None
        timeout = None if last else self.stops.after_step(steps_done, mean_step_seconds)
        if step % self.ck.save_period == 0:
            return "period", timeout
        if timeout:
            return "timeout", timeout
        if last:
            return "last", None
        if self.tiers is not None and step % self.ck.local_period == 0:
            return "local", None  # a frequent save to the tiers, not drained
        return None, None

    async def save(
        self,
        trigger: str,
        step: int,
        *,
        policy: Any,
        buffer_state: dict[str, Any],
        components: dict[str, Any],
        training_info: dict[str, Any],
        metrics: dict[str, Any],
    ) -> float:
        """Snapshot every participant and return the seconds training was blocked here; the
        uploads go on in the background and the commit follows when they are done (with
        ``async_save=false``: before this returns, and the wait counts as blocked)."""
        await self.flush(policy)
        started_at = time.time()
        began = time.perf_counter()
        if self.tiers is not None:
            # The previous local commit ends by dropping copies no checkpoint keeps from the
            # tiers: no writer may find one of them there and count on it meanwhile. Training
            # waits for that too: it counts as blocked.
            await asyncio.to_thread(self._wait_committed)
        workers = self.cfg.policy.num_workers
        if workers > 1:
            sharding = {"workers": workers, "optimizer": self.ck.save_optimizer}
            training_info = {**training_info, SHARDED_INFO: sharding}
        assert self._buffer_writer is not None
        # Both snapshots at once: training is blocked for the longer, not for their sum.
        _, buffer = await asyncio.gather(
            policy.snapshot_shards.remote(self.ck.save_optimizer),
            asyncio.to_thread(
                self._buffer_writer.save,
                {"replay_buffer": buffer_state},
                kinds={"replay_buffer": KINDS["replay_buffer"]},
            ),
        )
        blocked = time.perf_counter() - began
        self.pending = PendingSave(
            step, trigger, started_at, began, blocked, components, training_info, metrics, buffer
        )
        self.saved_steps.append(step)
        if not self.ck.async_save:
            await self.flush(policy)
            await asyncio.to_thread(self._wait_committed)
            blocked = time.perf_counter() - began
        return blocked

    async def poll(self, policy: Any) -> None:
        """Commit the pending save if every upload has finished (never waits for one)."""
        pending = self.pending
        if pending is None or not pending.buffer.done():
            return
        receipts = await policy.shard_receipts.remote(False)
        if receipts is not None:
            await self._commit(pending, receipts)

    async def flush(self, policy: Any) -> None:
        """Wait for the pending save's uploads and commit it (once: a failed flush is not
        tried again at exit)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            receipts = await policy.shard_receipts.remote(True)
        except Exception as exc:
            # The save's other half is seen with it (often the same broken store), not later.
            await asyncio.to_thread(settle, pending.buffer, exc)
            raise
        await self._commit(pending, receipts)

    async def _commit(self, pending: PendingSave, policy_receipts: list[ShardReceipt]) -> None:
        assert self.run is not None
        self.pending = None
        # The replay buffer's upload may still be running (a flush): waited for off the loop.
        buffer_receipts = await asyncio.to_thread(pending.buffer.receipts)
        receipts = [*policy_receipts, *buffer_receipts]
        # One commit in flight: report the previous one (Run.save would wait for it anyway).
        await asyncio.to_thread(self._wait_committed)
        # A synchronous save blocked training from its start until now (the uploads included);
        # Run.save adds its own part.
        blocked = pending.blocked if self.ck.async_save else time.perf_counter() - pending.began
        run = self.run
        handle = await asyncio.to_thread(
            run.save,
            pending.step,
            pending.components,
            receipts=receipts,
            training_info=pending.training_info,
            metrics=pending.metrics,
            trigger=pending.trigger,
            kinds={name: KINDS[name] for name in pending.components},
            started_at=pending.started_at,
            blocked_seconds=blocked,
            # The policy's own components: "policy" saved whole, "dcp/rank<r>" sharded.
            expect_changed=[r.component for r in policy_receipts if r.kind == "policy"]
            or [r.component for r in policy_receipts if r.component.startswith("dcp/rank")],
        )
        self.committing = handle
        if self.tiers is not None and pending.trigger != "local":
            self.drains.after(run, handle, pending.step)
        self.report()

    def report(self) -> None:
        """Print the committed save, if the commit in flight has finished."""
        handle = self.committing
        if handle is None or not handle.done():
            return
        self.committing = None
        self._emit_saved(handle.wait())

    def _wait_committed(self) -> None:
        handle, self.committing = self.committing, None
        if handle is not None:
            self._emit_saved(handle.wait())

    def _emit_saved(self, info: CheckpointInfo) -> None:
        self.stops.saved(info.save_seconds)
        for line in saved_lines(info):
            self.emit(line)

    async def close(self, policy: Any, error: BaseException | None) -> None:
        """Commit the pending save, then close the run, the replay-buffer writer, the database
        and the store. The run and the writer close through their own ``with`` exits, so
        ckptstore's rule holds: a failure raises on a clean exit and is a note on the exception
        already propagating otherwise (never masking it, and never printed a second time: the
        caller reports the one error)."""
        failure = error
        try:
            if policy is not None:
                await self.flush(policy)
            # A finished run leaves its last checkpoint remote-durable (one stopping on its
            # time budget, what fits before it).
            await self.drains.settle()
        except Exception as exc:
            if error is None:
                failure = exc
                raise
            # The policy worker's uploads are out of the run's sight: noted as the run would.
            error.add_note(f"trainer: the pending checkpoint save also failed: {exc!r}")
        finally:
            self.pending = None
            exits = self._take_exits()  # in a worker thread: they may wait for uploads
            if failure is None:
                await asyncio.to_thread(exits.__exit__, None, None, None)
            else:
                await asyncio.to_thread(
                    exits.__exit__, type(failure), failure, failure.__traceback__
                )

    def _take_exits(self) -> ExitStack:
        """What :meth:`close` closes, last first: the store and the database after the writer
        and the run, whose exits see the exception in flight (if any)."""
        exits = ExitStack()
        for resource in (self._store, self._db, self._tier_store):
            if resource is not None:
                exits.callback(resource.close)
        if self._buffer_writer is not None:
            exits.push(partial(exit_noting, self._buffer_writer.close, "shard save"))
        if self.run is not None:
            exits.push(partial(exit_noting, self.run.close, "checkpoint save"))
        if self.run is not None:
            exits.push(partial(self._finalize, self.run))
        self.run = self._buffer_writer = self._db = self._store = self._tier_store = None
        return exits

    def _finalize(self, run: Run, exc_type: type[BaseException] | None, *_: object) -> None:
        """On a clean exit: the last commit, reported, and the steps retention kept."""
        if exc_type is not None:
            return
        info = run.finalize()
        if info is not None and self.committing is not None:
            self._emit_saved(info)
        self.committing = None
        self.kept_steps = [c.step for c in run.checkpoints(["committed"])]
