"""A small trainer config for tests (seconds per run) and a way to run the controller in-process."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from trainer.config import TrainerConfig, load_config
from trainer.controller import Controller

#: The checkout: ``trainer`` is imported from here, not from the installed package.
CHECKOUT = Path(__file__).resolve().parents[1]


def checkout_env(**extra: str) -> dict[str, str]:
    """This process's environment for a trainer child process, with the checkout first on
    PYTHONPATH (a script such as tests/trainer/kill_child.py does not put it on sys.path)."""
    paths = [str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **extra}


def small_overrides(root: Path, **extra: Any) -> list[str]:
    values: dict[str, Any] = {
        "seed": 3,
        "task.num_digits": 3,
        "policy.d_model": 32,
        "policy.n_layers": 1,
        "policy.n_heads": 2,
        "warmup.steps": 4,
        "warmup.batch_size": 16,
        "grpo.num_prompts_per_step": 2,
        "grpo.num_generations_per_prompt": 4,
        "grpo.max_num_steps": 4,
        "data.train.num_prompts": 64,
        "async_rl.max_inflight_prompts": 4,
        "async_rl.max_buffered_rollouts": 8,
        "checkpointing.run_name": "t",
        "checkpointing.save_period": 2,
        "checkpointing.db": str(root / "manifest.db"),
        "checkpointing.store": str(root / "store"),
    }
    values.update(extra)
    return [f"{key}={'null' if value is None else value}" for key, value in values.items()]


def small_config(root: Path, **extra: Any) -> TrainerConfig:
    """The config for ``backend=local``; keys use dots with ``__`` in place of ``.``."""
    overrides = {key.replace("__", "."): value for key, value in extra.items()}
    overrides.setdefault("backend", "local")
    return load_config(None, small_overrides(root, **overrides))


#: A time budget no test run reaches by itself (``budget_stop_at`` moves the clock to it).
LONG_BUDGET = "00:01:00:00"


def train(
    cfg: TrainerConfig, process_start: float | None = None, *, budget_stop_at: int | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Run the controller in this process to the end; returns its summary and printed lines.

    ``budget_stop_at=k`` makes ``checkpoint_must_save_by`` (which must be set, e.g. to
    LONG_BUDGET) run out exactly at step k: the deadline's clock reads the budget's end from
    then on, so the run saves at step k and stops early, whatever the machine's speed.
    """
    controller = Controller(cfg, time.time() if process_start is None else process_start)
    if budget_stop_at is not None:
        checkpointer = controller.checkpointer
        assert checkpointer.budget is not None, "set checkpointing.checkpoint_must_save_by"
        end = checkpointer.process_start + checkpointer.budget

        def clock() -> float:
            return end if controller.train_steps >= budget_stop_at else time.time()

        checkpointer.clock = clock
    summary = asyncio.run(controller.run_training())
    return summary, controller.drain()
