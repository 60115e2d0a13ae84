"""``transformers.Trainer`` checkpointing to a ckptstore run: :class:`CkptStoreTrainer`.

A subclass, not a callback: a callback's ``on_save`` runs after the Trainer has written its
own ``checkpoint-N`` folder (pickled optimizer and RNG files included), so it could only add a
second copy, and no callback hook runs early enough in ``train()`` to restore the state the
Trainer's resume reads before it plans the epoch. The subclass replaces the Trainer's
checkpoint writer and its four loaders:

- ``_save_checkpoint`` stores ``model`` (unwrapped), ``optimizer``, ``scheduler``, ``scaler``
  (if any) and ``trainer_state`` (the ``TrainerState`` JSON) from the main process, and each
  process's generators as ``process/<rank>`` (:mod:`._rng`), as one checkpoint row per save
  (:mod:`._collective`): nothing is written to ``output_dir``.
- ``train(resume_from_checkpoint=True)`` loads the run's newest committed checkpoint (an int:
  that step) into memory, then runs the Trainer's own resume -- its epoch and batch skipping,
  its RNG reload after the skip -- with the loaders reading that state instead of files.

Written against transformers 5.25 (these are the Trainer's private methods; the tests pin
their behaviour). Retention is the run's (``open_run(retention=...)``), not
``save_total_limit``; ``load_best_model_at_end`` needs the Trainer's folders and is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Any

from transformers import Trainer

from ckptstore import SaveHandle
from ckptstore.errors import CheckpointNotFoundError, ConfigError
from ckptstore.extending import CheckpointInfo, Run
from ckptstore.integrations.accelerate import _collective, _parts, _rng
from ckptstore.integrations.accelerate._collective import Job, Loaded, Target

TRAINER_STATE = "trainer_state"
_STATE_FILE = "trainer_state.json"  # the name the Trainer's resume reads (TRAINER_STATE_NAME)


class CkptStoreTrainer(Trainer):  # type: ignore[misc,unused-ignore]
    """A ``transformers.Trainer`` whose checkpoints are ckptstore checkpoints of a run.

    ``ckpt_target``: the run (``open_run(...)``) on the main process; the run's store (URL or
    ``ObjectStore``) is enough on the others. Every other argument is the Trainer's.
    """

    def __init__(self, *args: Any, ckpt_target: Target, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.load_best_model_at_end:
            raise ConfigError(
                "CkptStoreTrainer: load_best_model_at_end reads the Trainer's checkpoint "
                "folders, which it does not write; set load_best_model_at_end=False and load "
                "the best checkpoint by metric from the run (Run.load(step))"
            )
        self.ckpt_target = ckpt_target
        #: The checkpoint a resume loaded (and the checked generators), until the loaders ran.
        self._ckpt_loaded: Loaded | None = None
        self._ckpt_rng: _rng.Checked | None = None
        #: The main process's handle of the last save (``wait()`` gives its record).
        self.last_save: SaveHandle | None = None

    def _job(self) -> Job:
        return Job(self.args.process_index, self.args.world_size, self.ckpt_target)

    # -- saving -------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        step = self.state.global_step
        self._record_callback_states()

        def own() -> tuple[str, Any]:
            component = _parts.process_component(self.args.process_index)
            return component, _parts.checked(component, {"rng": _rng.capture()})

        def commit(run: Run, components: dict[str, Any], receipts: list[Any]) -> SaveHandle:
            return run.save(
                step,
                components,
                receipts=receipts,
                training_info={"transformers.Trainer": {"processes": self.args.world_size}},
                metrics=self._metrics_of(step),
                trigger="period",
            )

        self.last_save = _collective.save(self._job(), step, own, self._shared_state, commit)

    def _shared_state(self) -> dict[str, Any]:
        parts: dict[str, Any] = {
            "model": self.accelerator.unwrap_model(self.model).state_dict(),
            TRAINER_STATE: {"json": json.dumps(dataclasses.asdict(self.state), sort_keys=True)},
        }
        if not self.args.save_only_model:
            optimizer: Any = self.optimizer
            scheduler: Any = self.lr_scheduler
            parts["optimizer"] = optimizer.state_dict()
            parts["scheduler"] = scheduler.state_dict()
            if self.accelerator.scaler is not None:
                parts["scaler"] = self.accelerator.scaler.state_dict()
        return {name: _parts.checked(name, state) for name, state in parts.items()}

    def _record_callback_states(self) -> None:
        """What the Trainer's own save records of its stateful callbacks, before the state is
        serialized."""
        from transformers.trainer_callback import ExportableState

        recorded: Any = self.state.stateful_callbacks
        for cb in [*self.callback_handler.callbacks, self.control]:
            if not isinstance(cb, ExportableState):
                continue
            name = cb.__class__.__name__
            if isinstance(recorded.get(name), list):
                recorded[name].append(cb.state())
            else:
                recorded[name] = cb.state()

    def _metrics_of(self, step: int) -> dict[str, float]:
        """The numbers logged at ``step`` (its loss, learning rate ...), for the row."""
        logged = [h for h in self.state.log_history if h.get("step") == step]
        merged: dict[str, Any] = {}
        for entry in logged:
            merged.update(entry)
        return {
            k: float(v)
            for k, v in merged.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"
        }

    # -- resuming -----------------------------------------------------------------------

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; ``resume_from_checkpoint=True`` resumes from the run's
        newest committed checkpoint (none yet: a fresh start), an int from that step. A path
        is refused: this Trainer's checkpoints are in the run."""
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return super().train(None, *args, **kwargs)
        if isinstance(resume_from_checkpoint, str | os.PathLike):
            raise ConfigError(
                f"CkptStoreTrainer resumes from its run, not from {resume_from_checkpoint!r}: "
                "pass resume_from_checkpoint=True (the newest checkpoint) or a step number"
            )
        step = None if resume_from_checkpoint is True else int(resume_from_checkpoint)
        loaded = _collective.load(self._job(), step, self._wanted, self._check)
        if loaded is None:
            if step is not None:
                raise CheckpointNotFoundError(f"the run has no checkpoint at step {step}")
            return super().train(None, *args, **kwargs)
        self._ckpt_loaded = loaded
        with tempfile.TemporaryDirectory(prefix="ckptstore-trainer-") as folder:
            # The one file the Trainer's resume plans from: the JSON the save stored.
            text = loaded.states[TRAINER_STATE]["json"]
            with open(os.path.join(folder, _STATE_FILE), "w", encoding="utf-8") as out:
                out.write(text)
            try:
                return super().train(folder, *args, **kwargs)
            finally:
                self._ckpt_loaded, self._ckpt_rng = None, None

    def _wanted(self, info: CheckpointInfo) -> list[str]:
        saved = (info.training_info or {}).get("transformers.Trainer")
        if not isinstance(saved, dict):
            raise ConfigError(
                f"run {info.run!r} step {info.step} was not saved by CkptStoreTrainer; "
                "resume from a checkpoint it saved"
            )
        names = [c.name for c in info.components if not c.name.startswith("process/")]
        own = _parts.process_component(self.args.process_index)
        return [*names, own] if saved.get("processes") == self.args.world_size else names

    def _check(self, loaded: Loaded) -> None:
        where = f"run {loaded.info.run!r} step {loaded.info.step}"
        state = loaded.states.get(TRAINER_STATE)
        if not (isinstance(state, dict) and isinstance(state.get("json"), str)):
            raise ConfigError(f"{where}: no trainer_state JSON (corrupt or crafted)")
        json.loads(state["json"])
        for name in ("model", "optimizer", "scheduler", "scaler"):
            if name in loaded.states and not isinstance(loaded.states[name], dict):
                raise ConfigError(f"{where} component {name!r}: not a state dict (corrupt)")
        own = _parts.process_component(self.args.process_index)
        if own in loaded.states:
            process = loaded.states[own]
            rng = process.get("rng") if isinstance(process, dict) else None
            self._ckpt_rng = _rng.check(rng, f"{where} {own}/rng")

    def _load_from_checkpoint(self, resume_from_checkpoint: Any, model: Any = None) -> None:
        if self._ckpt_loaded is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[no-any-return,unused-ignore]
        target: Any = self.model if model is None else self.accelerator.unwrap_model(model)
        target.load_state_dict(self._ckpt_loaded.states["model"])
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        if self._ckpt_loaded is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[no-any-return,unused-ignore]
        states = self._ckpt_loaded.states
        if "optimizer" in states:
            optimizer: Any = self.optimizer
            scheduler: Any = self.lr_scheduler
            optimizer.load_state_dict(states["optimizer"])
            scheduler.load_state_dict(states["scheduler"])
        return None

    def _load_scaler(self, checkpoint: Any) -> None:
        if self._ckpt_loaded is None:
            return super()._load_scaler(checkpoint)  # type: ignore[no-any-return,unused-ignore]
        scaler = self._ckpt_loaded.states.get("scaler")
        if scaler is not None and self.accelerator.scaler is not None:
            self.accelerator.scaler.load_state_dict(scaler)
        return None

    def _load_rng_state(self, checkpoint: Any) -> None:
        if self._ckpt_loaded is None:
            return super()._load_rng_state(checkpoint)  # type: ignore[no-any-return,unused-ignore]
        if self._ckpt_rng is not None:
            _rng.restore(self._ckpt_rng)
        return None


__all__ = ["CkptStoreTrainer"]
