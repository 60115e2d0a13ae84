"""The typed trainer config (trainer/config.py): defaults, then a YAML file, then dotted
overrides; every key documented; every refusal one line that names the dotted key."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from trainer import samplers
from trainer.config import (
    RUNTIME_KEYS,
    SAMPLERS,
    TrainerConfig,
    load_config,
    model_config,
    training_config,
)
from trainer.errors import ConfigurationError


def _sections(cls: type = TrainerConfig, prefix: str = "") -> list[tuple[type, str]]:
    out = [(cls, prefix)]
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, type) else None
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if kind is None and dataclasses.is_dataclass(default):
            kind = type(default)
        if kind is not None and dataclasses.is_dataclass(kind):
            out += _sections(kind, f"{prefix}{f.name}.")
    return out


def test_every_key_has_a_docstring() -> None:
    undocumented = []
    for cls, prefix in _sections():
        source = inspect.getsource(cls).splitlines()
        for f in dataclasses.fields(cls):
            at = next(i for i, line in enumerate(source) if re.match(rf"\s+{f.name}:", line))
            nested = f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(
                f.default_factory()
            )
            if not nested and not source[at - 1].strip().startswith("#:"):
                undocumented.append(prefix + f.name)
    assert undocumented == []


def test_yaml_then_overrides_then_typed_values(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "grpo:\n  max_num_steps: 7\n  num_prompts_per_step: 2\n"
        "checkpointing:\n  save_period: 3\n  keep_top_k: null\n"
    )
    cfg = load_config(path, ["grpo.max_num_steps=9", "logger.prompt_trace=/tmp/t.jsonl"])
    assert isinstance(cfg, TrainerConfig)
    assert cfg.grpo.max_num_steps == 9  # the override wins over the file
    assert cfg.grpo.num_prompts_per_step == 2
    assert cfg.checkpointing.save_period == 3
    assert cfg.checkpointing.keep_top_k is None
    assert cfg.logger.prompt_trace == "/tmp/t.jsonl"
    assert cfg.async_rl.sampler.name == "windowed"  # a default
    assert cfg.min_groups == 2


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["grpo.max_num_step=3"], r"max_num_step.*unknown config key"),
        (["grpo.max_num_steps=lots"], r"grpo\.max_num_steps"),
        (["async_rl.sampler.class=a:B"], r"now called 'async_rl\.sampler\.custom_class'"),
        (["logging.print_every=2"], r"now called 'logger'"),
        (["grpo.num_generations_per_prompt=1"], r"grpo\.num_generations_per_prompt=1 must be"),
        (["checkpointing.save_period=0"], r"checkpointing\.save_period=0 must be at least 1"),
        (["checkpointing.keep_every_n_steps=0"], r"checkpointing\.keep_every_n_steps=0"),
        (["checkpointing.fork_init=copy"], r"checkpointing\.fork_init='copy' must be one of"),
        (["async_rl.sampler.name=fifo"], r"async_rl\.sampler\.name='fifo' is unknown"),
        (["async_rl.sampler.name=custom"], r"needs async_rl\.sampler\.custom_class=module:Class"),
        (["async_rl.sampler.gate_window=0"], r"async_rl\.sampler\.gate_window=0"),
        (
            ["async_rl.sampler.max_staleness_versions=-1"],
            r"async_rl\.sampler\.max_staleness_versions=-1 must be at least 0",
        ),
        (["policy.d_model=30", "policy.n_heads=4"], r"policy\.n_heads=4 must divide"),
        (["backend=slurm"], r"backend='slurm' must be one of"),
        (["async_rl.max_buffered_rollouts=2"], r"max_buffered_rollouts=2 must be >= grpo"),
        (["grpo.max_num_steps"], r"not of the form dotted\.key=value"),
    ],
)
def test_bad_values_are_refused_in_one_line_naming_the_key(
    overrides: list[str], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match) as info:
        load_config(None, overrides)
    assert "\n" not in str(info.value)
    assert info.value.exit_code == 2


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"config file .*nope\.yaml does not exist"):
        load_config(tmp_path / "nope.yaml", [])


def test_the_sampler_names_are_the_samplers_module_s() -> None:
    assert set(SAMPLERS) == {*samplers.BUILTIN, "custom"}


def test_recorded_and_model_configs_leave_out_what_may_change(tmp_path: Path) -> None:
    cfg = load_config(None, ["checkpointing.save_period=3", "policy.lr=0.5"])
    recorded: dict[str, Any] = training_config(cfg)
    assert not set(RUNTIME_KEYS) & set(recorded)
    assert recorded["grpo"]["max_num_steps"] == 200
    model = model_config(cfg)
    assert "lr" not in model["policy"]  # the learning rate may change between runs
    assert model_config(load_config(None, ["policy.lr=0.1"])) == model
    assert model_config(load_config(None, ["policy.d_model=32"])) != model


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["policy.replicas=0"], r"policy\.replicas=0 must be at least 1"),
        (
            ["policy.num_workers=6", "policy.replicas=4"],
            r"policy\.replicas=4 must divide policy\.num_workers=6 .*a multiple of",
        ),
        (["policy.replicas=2"], r"policy\.replicas=2 must divide policy\.num_workers=1"),
    ],
)
def test_replicas_must_divide_the_workers(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match) as info:
        load_config(None, ["backend=ray", *overrides])
    assert "\n" not in str(info.value)


def test_replicas_are_a_layout_not_the_model_s_identity() -> None:
    """A resume onto another replica count reshards (DCP), as onto another num_workers."""
    layouts = [(4, 2), (4, 1), (6, 3), (1, 1)]
    configs = [
        load_config(None, ["backend=ray", f"policy.num_workers={n}", f"policy.replicas={r}"])
        for n, r in layouts
    ]
    assert [(c.policy.num_workers, c.policy.replicas) for c in configs] == layouts
    assert len({str(model_config(c)) for c in configs}) == 1
