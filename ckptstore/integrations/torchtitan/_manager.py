"""The torchtitan checkpoint manager that stores through ckptstore (see the package docstring).

torchtitan calls, on every rank: ``load(step)`` once before training, ``save(step,
last_step)`` after each step, ``maybe_wait_for_staging()`` before the optimizer changes the
weights, and ``close()`` at the end. ``BaseCheckpointManager`` guards them (nothing runs when
checkpointing is disabled) and calls the ``_``-prefixed hooks below.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

# torchtitan ships no type information (no py.typed): its classes are Any to mypy.
from torchtitan.components.checkpointer import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
    TORCH_DTYPE_MAP,
)

from ckptstore import RetentionPolicy, open_run
from ckptstore.errors import ConfigError
from ckptstore.extending import (
    CheckpointInfo,
    ObjectStore,
    Run,
    TierConfig,
    parse_step_id,
    writer_store,
)
from ckptstore.integrations.dcp import SnapshotStager, save
from ckptstore.integrations.torchtitan._hf import export_last
from ckptstore.integrations.torchtitan._resume import (
    Choice,
    load_choice,
    parse_initial_load_path,
    resume,
)
from ckptstore.integrations.torchtitan._tiers import Drains, job_tiers

if TYPE_CHECKING:
    import torch.nn as nn

log = logging.getLogger("ckptstore.integrations.torchtitan")


class CkptStoreCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]
    """torchtitan's checkpointing on ckptstore: each rank uploads its shards, rank 0 commits,
    resume is a query, retention runs after each commit."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint options, plus where ckptstore keeps the checkpoints.

        ``keep_latest_k=1`` is allowed: a checkpoint still saving is not committed, so it is
        neither resumed from nor counted, and the newest committed one is always kept.
        ``initial_load_path`` is ``"RUN@STEP"``, a checkpoint of another run in the same
        database that a new run starts from (recorded as its parent).
        """

        db: str | None = None
        """Manifest database: a SQLite path or a PostgreSQL URL; default
        ``<dump_folder>/<folder>/manifest.db``."""

        store: str | None = None
        """Object store: a directory or ``s3://bucket/prefix``; default
        ``<dump_folder>/<folder>/store``."""

        run: str = "torchtitan"
        """The ckptstore run the checkpoints belong to; re-running the same command resumes
        its newest committed checkpoint."""

        async_save: bool = False
        """Return from ``save`` once the state is copied into host memory; upload and commit
        in the background (the next save, ``close`` or the last step waits for it)."""
        local_dir: str | None = None
        """Node-local tiers (a RAM disk or NVMe; may contain ``{node}``): every save goes to
        the tiers of ``local_replicas`` nodes and is committed local-durable, then drained to
        ``store`` in the background; a resume reads each blob from its nearest copy. None:
        saves go to the store."""
        local_replicas: int = 1
        """With ``local_dir``: on how many nodes' tiers each blob is before a save commits
        (more than 1 needs every node's tier reachable from every node, e.g. mounted)."""

        def __post_init__(self) -> None:
            if not self.folder.strip():
                raise ConfigError("checkpoint.folder cannot be empty")
            if self.interval < 1:
                raise ConfigError(f"checkpoint.interval={self.interval}: use 1 or more steps")
            if self.keep_latest_k < 0:
                raise ConfigError(
                    f"checkpoint.keep_latest_k={self.keep_latest_k}: use 0 (keep all) or more"
                )
            if MODEL in self.exclude_from_loading:
                raise ConfigError(
                    f"checkpoint.exclude_from_loading: {MODEL!r} is always loaded; remove it"
                )
            if self.initial_load_in_hf or self.initial_load_in_hf_quantized:
                raise ConfigError(
                    "checkpoint.initial_load_in_hf: the ckptstore manager loads checkpoints it "
                    "stored; start from Hugging Face weights with torchtitan's CheckpointManager "
                    "and switch once a checkpoint is saved, or set initial_load_in_hf=False"
                )
            if self.last_save_in_hf and not self.last_save_model_only:
                raise ConfigError(
                    "checkpoint.last_save_in_hf exports the model only: set "
                    "last_save_model_only=True or last_save_in_hf=False"
                )
            if self.initial_load_path:
                parse_initial_load_path(self.initial_load_path)
            if self.local_dir is not None:
                TierConfig(local_dir=self.local_dir, replicas=self.local_replicas)

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: Future[Any] | None = None
        if not self.enable:
            return
        self.config = config
        self.folder = os.path.join(base_folder, config.folder)
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.sd_adapter = sd_adapter
        if config.last_save_in_hf and sd_adapter is None:
            raise ConfigError(
                "checkpoint.last_save_in_hf needs the model's state-dict adapter (sd_adapter), "
                "and this model has none; set last_save_in_hf=False"
            )
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.store_url = config.store or os.path.join(self.folder, "store")
        distributed = dist.is_available() and dist.is_initialized()
        # Async saves talk over a gloo group of their own, as torchtitan's do: a background
        # save must not queue collectives on the training group.
        self.pg = dist.new_group(backend="gloo") if config.async_save and distributed else None
        self.stager = SnapshotStager() if config.async_save else None
        #: The job's node-local tiers (``local_dir``), and this rank's writer store on them.
        self.tiers = job_tiers(config.local_dir, config.local_replicas, distributed)
        self.drains = Drains()
        self.run: Run | None = None
        if not distributed or dist.get_rank() == 0:
            self.run = self._open_run(config)
        self.tier_store = (
            writer_store(self.tiers) if self.tiers is not None and self.run is None else None
        )
        log.info("checkpointing to ckptstore run %r (store %s)", config.run, self.store_url)

    def _open_run(self, config: Config) -> Run:
        """Rank 0's run (writable unless ``load_only``): the only process that opens the
        manifest database."""
        keep = config.keep_latest_k
        retention = RetentionPolicy(keep_top_k=0, keep_latest_k=keep) if keep else None
        fork = (
            parse_initial_load_path(config.initial_load_path) if config.initial_load_path else None
        )
        return open_run(
            config.run,
            db=config.db or os.path.join(self.folder, "manifest.db"),
            store=self.store_url,
            retention=retention,
            async_save=False,
            fork_from=fork,
            # A load_only job (an evaluation) must not fence the run's writer.
            writable=not config.load_only,
            tiers=self.tiers,
        )

    # -- torchtitan's hooks --------------------------------------------------------------

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save when torchtitan's rules say so (interval, first step, last step)."""
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step:
            self._save_last(curr_step)
            return True
        result = save(
            self._flattened(self.states),
            self._target(),
            curr_step,
            process_group=self.pg,
            async_save=self.config.async_save,
            stager=self.stager,
            trigger="period",
            training_info={"model_only": False},
        )
        if isinstance(result, Future):
            self.save_future = result
        elif self.run is not None and self.tiers is not None:
            self.drains.start(self.run)  # the commit is done: to the store in the background
        return True

    def _target(self) -> Run | ObjectStore | str:
        """What this rank saves to: its run (rank 0), its tiers' writer store, or the store."""
        if self.run is not None:
            return self.run
        return self.tier_store if self.tier_store is not None else self.store_url

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    def _save_last(self, curr_step: int) -> None:
        """The last step, saved synchronously: the model alone in ``export_dtype`` (and as
        Hugging Face files) with ``last_save_model_only``, else the full state."""
        model_only = self.config.last_save_model_only
        states = self._model_for_export() if model_only else self._flattened(self.states)
        info = save(
            states,
            self._target(),
            curr_step,
            trigger="last",
            training_info={"model_only": model_only},
        )
        if self.config.last_save_in_hf and self.run is not None:
            assert isinstance(info, CheckpointInfo)  # rank 0 of a synchronous save
            directory = Path(self.folder) / "hf" / f"step-{curr_step}"
            files = export_last(self.run, info, directory, self.sd_adapter)
            log.info("exported step %d to %s (%d files)", curr_step, directory, len(files))

    def _model_for_export(self) -> dict[str, Any]:
        dtype = self.export_dtype
        return {
            key: value.to(dtype)
            if isinstance(value, torch.Tensor) and value.is_floating_point()
            else value
            for key, value in self.states[MODEL].state_dict().items()
        }

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load ``step`` (-1: the newest committed checkpoint; a new run with
        ``initial_load_path`` starts from that one). False when there is nothing to load."""
        wanted = -1 if step == -1 else parse_step_id(step, what="checkpoint.load_step")
        initial = (
            parse_initial_load_path(self.config.initial_load_path)
            if self.config.initial_load_path
            else None
        )
        loaded = resume(
            self.run, wanted, initial, self.config.initial_load_model_only, self._load_choice
        )
        if loaded is None:
            log.info("no checkpoint in run %r: this is a fresh start", self.config.run)
            return False
        log.info("loaded run %r step %d", loaded.run, loaded.step)
        return True

    def _load_choice(self, choice: Choice) -> None:
        states = self._states_to_load(choice.model_only)
        load_choice(states, self.store_url, choice, tiers=self.tiers)
        # The model's tensors are flattened into ``states``; ModelWrapper refreshes its cache.
        self.states[MODEL].load_state_dict(states)

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: an async save returns only once its copy to host memory is
        done, so the optimizer may change the weights right away."""

    def _wait_for_saving(self) -> None:
        """Wait for the background save; its failure (a ``SaveError``) is raised here."""
        assert self.save_future is not None
        future, self.save_future = self.save_future, None
        future.result()
        if self.run is not None and self.tiers is not None:
            self.drains.start(self.run)

    def _close(self) -> None:
        """Finish the save in flight (raising its error), then release the run."""
        try:
            self.maybe_wait_for_saving()
            if self.run is not None and self.tiers is not None:
                # A finished job leaves its newest checkpoint remote-durable.
                self.drains.finish(self.run)
        finally:
            if self.run is not None:
                self.run.close()
                self.run = None
            if self.tier_store is not None:
                self.tier_store.close()

    # -- what is saved and loaded ----------------------------------------------------------

    def _flattened(self, states: dict[str, Any]) -> dict[str, Any]:
        """The model's tensors at the top level (as torchtitan's DCP checkpoints hold them),
        the other states by name; states that are None (no dataloader) are left out."""
        flat = {k: v for k, v in states.items() if k != MODEL and v is not None}
        if MODEL in states:
            flat.update(states[MODEL].state_dict())
        return flat

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return dict(self.states[MODEL].state_dict())
        unknown = [k for k in self.config.exclude_from_loading if k not in self.states]
        if unknown:
            raise ConfigError(
                f"checkpoint.exclude_from_loading names {unknown}, which are not saved states "
                f"({sorted(self.states)})"
            )
        wanted = {k: v for k, v in self.states.items() if k not in self.config.exclude_from_loading}
        return self._flattened(wanted)
