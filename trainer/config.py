"""Configuration: defaults, a YAML file and dotted command-line overrides (DESIGN.md §9.1)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ckptstore.checkpointer import config_fingerprint
from ckptstore.durations import parse_duration
from ckptstore.errors import ConfigError

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    # "ray": controller, rollout workers and the policy worker are Ray actors; "local": the same
    # classes in this process (for tests and debugging).
    "backend": "ray",
    "task": {"num_digits": 5},
    "policy": {"d_model": 64, "n_layers": 2, "n_heads": 4, "lr": 1.0e-3},
    # The supervised warm-up that makes the base (reference) model, stored as its own run.
    "warmup": {"steps": 14, "batch_size": 64, "lr": 3.0e-3},
    "grpo": {
        "max_num_steps": 200,
        "max_num_epochs": 100,
        "num_prompts_per_step": 8,
        "num_generations_per_prompt": 8,
        "clip_eps": 0.2,
        "kl_coef": 0.02,
        "temperature": 1.0,
    },
    "data": {"train": {"dataset_name": "reverse-digits", "num_prompts": 2048}},
    "async_rl": {
        "num_rollout_workers": 1,
        "max_inflight_prompts": 8,
        "max_buffered_rollouts": 16,
        "min_groups_for_streaming_train": None,  # None: num_prompts_per_step
        "sampler": {
            "name": "windowed",
            "max_staleness_versions": 2,
            "gate_window": 2,
            "class": None,  # "module:Class" for the custom sampler
        },
    },
    "checkpointing": {
        "enabled": True,
        "store": None,  # None: $CKPTSTORE_STORE or ./.ckptstore/store
        "db": None,  # None: $CKPTSTORE_DB or ./.ckptstore/manifest.db
        "run_name": "grpo-demo",
        "save_period": 5,
        "keep_top_k": 3,
        "keep_latest_k": 2,
        "metric_name": "train:reward",
        "higher_is_better": True,
        "save_optimizer": True,
        "async_save": True,
        # "DD:HH:MM:SS" after process start, or an absolute ISO-8601 time ("2026-12-01T06:00Z").
        "checkpoint_must_save_by": None,
        # Resuming with a different model config (task, policy architecture, warm-up, seed) is
        # refused unless fork=true, which starts a new run "<run_name>-fork-<hash>" from the
        # newest checkpoint (lineage recorded).
        "fork": False,
    },
    "logging": {"print_every": 1},
}

# Keys left out of the config recorded with a run: where it is stored and how long it runs.
RUNTIME_KEYS = ("backend", "checkpointing", "logging")


def load_config(config_file: str | Path | None, overrides: Sequence[str]) -> DictConfig:
    """Defaults, then the YAML file, then ``dotted.key=value`` overrides (unknown keys: error)."""
    cfg = OmegaConf.create(DEFAULTS)
    OmegaConf.set_struct(cfg, True)
    layers = []
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise SystemExit(f"error: config file {path} does not exist")
        layers.append(OmegaConf.load(path))
    for item in overrides:
        if "=" not in item:
            raise SystemExit(f"error: override {item!r} is not of the form dotted.key=value")
    if overrides:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        for layer in layers:
            cfg = OmegaConf.merge(cfg, layer)
    except Exception as exc:  # omegaconf's errors name the key; keep them to one line
        message = str(exc).splitlines()[0]
        if "is not in struct" in message:
            message += " (unknown config key; trainer/config.py lists every key)"
        raise SystemExit(f"error: bad configuration: {message}") from None
    check_config(cfg)
    return cfg


def check_config(cfg: DictConfig) -> None:
    problems = []
    if cfg.backend not in ("ray", "local"):
        problems.append(f"backend={cfg.backend!r} must be 'ray' or 'local'")
    for key in ("grpo.num_prompts_per_step", "grpo.num_generations_per_prompt"):
        if int(OmegaConf.select(cfg, key)) < 1:
            problems.append(f"{key} must be at least 1")
    if cfg.grpo.num_generations_per_prompt < 2:
        problems.append("grpo.num_generations_per_prompt must be >= 2 (GRPO compares samples)")
    if cfg.async_rl.max_buffered_rollouts < cfg.grpo.num_prompts_per_step:
        problems.append(
            "async_rl.max_buffered_rollouts must be >= grpo.num_prompts_per_step "
            "(a train step needs that many groups buffered at once)"
        )
    if cfg.checkpointing.save_period < 1:
        problems.append("checkpointing.save_period must be at least 1")
    if problems:
        raise SystemExit("error: " + "; ".join(problems))


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return out


def training_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config without RUNTIME_KEYS: what a resumed run must share with the saved one."""
    out = json.loads(json.dumps(cfg))
    for dotted in RUNTIME_KEYS:
        *parents, last = dotted.split(".")
        node = out
        for part in parents:
            node = node.get(part, {})
        node.pop(last, None)
    return out


def model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """What defines the model and its reference: a resumed run must not change it (fork instead)."""
    return {
        "task": cfg.get("task"),
        "policy": {k: v for k, v in (cfg.get("policy") or {}).items() if k != "lr"},
        "warmup": cfg.get("warmup"),
        "seed": cfg.get("seed"),
    }


def fingerprint(value: Any) -> str:
    """A short, stable name part for a config (the first 12 hex digits of ckptstore's)."""
    return config_fingerprint(value)[:12]


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [
            k for key in keys for k in changed_keys(old.get(key), new.get(key), f"{prefix}{key}.")
        ]
    return [] if old == new else [prefix.rstrip(".")]


def parse_deadline(value: str | None, process_start: float) -> float | None:
    """``checkpoint_must_save_by`` as a time budget in seconds counted from process start.

    Accepts a duration ("DD:HH:MM:SS", or e.g. "90m") or an absolute ISO-8601 time;
    ``process_start`` is the wall-clock time (``time.time()``) at which the process started.
    """
    if value is None or value == "":
        return None
    text = str(value).strip()
    if "-" not in text and "T" not in text:
        try:
            return parse_duration(text, what="checkpointing.checkpoint_must_save_by")
        except ConfigError as exc:
            raise SystemExit(f"error: {exc}") from None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise SystemExit(
            f"error: checkpointing.checkpoint_must_save_by={text!r} is neither a duration "
            "(DD:HH:MM:SS, 90m) nor an ISO-8601 time such as 2026-12-01T06:00:00Z"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp() - process_start
