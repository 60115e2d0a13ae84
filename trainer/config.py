"""Configuration (DESIGN.md §9.1): typed sections, a YAML file and dotted command-line overrides.

Every key is a dataclass field with its default and a docstring; OmegaConf merges the YAML file
and the overrides onto the defaults (an unknown key or a value of the wrong type is refused with
its dotted name), and each section checks its own ranges, naming the key.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ckptstore.errors import ConfigError
from ckptstore.extending import TierConfig, config_fingerprint, parse_duration
from trainer.errors import ConfigurationError

BACKENDS = ("ray", "local")
FORK_INITS = ("parent", "fresh")
#: trainer.samplers.BUILTIN and "custom" (the samplers module is not imported here).
SAMPLERS = ("windowed", "weight_fifo", "in_order", "ready_first", "custom")
#: What each train step measures (its printed line shows reward, buffer, staleness and kl);
#: every one is stored with each checkpoint as ``train:<key>`` and may be the metric_name.
TRAIN_METRICS = ("reward", "kl", "loss", "grad_norm", "clip_frac", "staleness", "buffer")


def _at_least(value: int, floor: int, key: str, why: str = "") -> None:
    if value < floor:
        raise ConfigurationError(f"{key}={value} must be at least {floor}{why}")


@dataclass
class TaskConfig:
    #: Length of the digit strings to reverse.
    num_digits: int = 5

    def __post_init__(self) -> None:
        _at_least(self.num_digits, 1, "task.num_digits")


@dataclass
class PolicySection:
    #: Width of the transformer.
    d_model: int = 64
    #: Number of transformer blocks.
    n_layers: int = 2
    #: Attention heads per block (must divide d_model).
    n_heads: int = 4
    #: AdamW learning rate of the GRPO updates.
    lr: float = 1.0e-3
    #: Policy workers (Ray actors) forming one torch.distributed group over which the model and
    #: the optimizer are sharded with FSDP2; each saves its own shards through
    #: ckptstore.integrations.dcp. 1: one unsharded worker. A resume may use another number
    #: (the policy reshards on load). More than 1 needs backend=ray.
    num_workers: int = 1
    #: Data-parallel replicas the num_workers ranks form (HSDP; must divide num_workers): each
    #: replica holds the policy as num_workers // replicas FSDP2 shards and trains on its part
    #: of each batch. A save stores one copy; a load reads each blob from the store once and
    #: sends it to the other replicas' ranks. A resume may use another number.
    replicas: int = 1
    #: Ray resources each policy worker asks for, e.g. {policy_slot: 1} with one such slot per
    #: node puts every rank on its own node. Empty: placed anywhere.
    worker_resources: dict[str, float] = field(default_factory=dict)
    #: Seconds a collective of the policy group waits for a missing rank before it fails (a
    #: lost node fails the run instead of hanging it).
    collective_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for key in ("d_model", "n_layers", "n_heads", "num_workers", "replicas"):
            _at_least(getattr(self, key), 1, f"policy.{key}")
        if self.num_workers % self.replicas:
            raise ConfigurationError(
                f"policy.replicas={self.replicas} must divide policy.num_workers="
                f"{self.num_workers} (each replica is the same number of shards): set "
                "policy.num_workers to a multiple of policy.replicas"
            )
        if not self.collective_timeout_s > 0:
            raise ConfigurationError(
                f"policy.collective_timeout_s={self.collective_timeout_s} must be > 0"
            )
        if self.d_model % self.n_heads:
            raise ConfigurationError(
                f"policy.n_heads={self.n_heads} must divide policy.d_model={self.d_model}"
            )


@dataclass
class WarmupConfig:
    """The supervised warm-up that makes the base (reference) model, stored as its own run."""

    #: Supervised steps.
    steps: int = 14
    #: Prompts per supervised step.
    batch_size: int = 64
    #: Learning rate of the warm-up.
    lr: float = 3.0e-3

    def __post_init__(self) -> None:
        _at_least(self.steps, 0, "warmup.steps")
        _at_least(self.batch_size, 1, "warmup.batch_size")


@dataclass
class GrpoConfig:
    #: Train steps of the whole run (a resumed run stops at this step, not this many more).
    max_num_steps: int = 200
    #: Passes over the prompt data at most.
    max_num_epochs: int = 100
    #: Prompt groups per train step.
    num_prompts_per_step: int = 8
    #: Samples per prompt (the group size G); GRPO compares them.
    num_generations_per_prompt: int = 8
    #: PPO-style ratio clipping.
    clip_eps: float = 0.2
    #: Weight of the k3 KL penalty to the reference.
    kl_coef: float = 0.02
    #: Sampling temperature of the rollouts.
    temperature: float = 1.0

    def __post_init__(self) -> None:
        _at_least(self.max_num_steps, 0, "grpo.max_num_steps")
        _at_least(self.max_num_epochs, 1, "grpo.max_num_epochs")
        _at_least(self.num_prompts_per_step, 1, "grpo.num_prompts_per_step")
        _at_least(
            self.num_generations_per_prompt,
            2,
            "grpo.num_generations_per_prompt",
            " (GRPO compares the samples of a group)",
        )


@dataclass
class TrainDataConfig:
    #: Name of the prompt set; the prompts are a pure function of (name, seed).
    dataset_name: str = "reverse-digits"
    #: Prompts in the set.
    num_prompts: int = 2048

    def __post_init__(self) -> None:
        _at_least(self.num_prompts, 1, "data.train.num_prompts")


@dataclass
class DataConfig:
    #: The training prompts.
    train: TrainDataConfig = field(default_factory=TrainDataConfig)


@dataclass
class SamplerConfig:
    #: windowed, weight_fifo, in_order, ready_first or custom.
    name: str = "windowed"
    #: Oldest weight version (behind the trainer's) a group may have been generated with.
    max_staleness_versions: int = 2
    #: How many batches a gated sampler may admit ahead of the trainer.
    gate_window: int = 2
    #: "module:Class" of a PromptGroupSampler subclass, for name=custom.
    custom_class: str | None = None

    def __post_init__(self) -> None:
        if self.name not in SAMPLERS:
            raise ConfigurationError(
                f"async_rl.sampler.name={self.name!r} is unknown: use one of {list(SAMPLERS)}"
            )
        if self.name == "custom" and ":" not in (self.custom_class or ""):
            raise ConfigurationError(
                "async_rl.sampler.name=custom needs async_rl.sampler.custom_class=module:Class "
                "(a PromptGroupSampler subclass)"
            )
        _at_least(self.max_staleness_versions, 0, "async_rl.sampler.max_staleness_versions")
        _at_least(self.gate_window, 1, "async_rl.sampler.gate_window")


@dataclass
class AsyncRLConfig:
    #: Rollout actors.
    num_rollout_workers: int = 1
    #: Prompts whose rollouts may run at once.
    max_inflight_prompts: int = 8
    #: Capacity permits: groups buffered or in flight at most.
    max_buffered_rollouts: int = 16
    #: Ready groups a train step waits for (None: grpo.num_prompts_per_step).
    min_groups_for_streaming_train: int | None = None
    #: The prompt-group sampler and its options.
    sampler: SamplerConfig = field(default_factory=SamplerConfig)

    def __post_init__(self) -> None:
        _at_least(self.num_rollout_workers, 1, "async_rl.num_rollout_workers")
        _at_least(self.max_inflight_prompts, 1, "async_rl.max_inflight_prompts")
        if self.min_groups_for_streaming_train is not None:
            _at_least(
                self.min_groups_for_streaming_train, 1, "async_rl.min_groups_for_streaming_train"
            )


@dataclass
class CheckpointingConfig:
    #: Save and resume through ckptstore at all.
    enabled: bool = True
    #: Object store (None: $CKPTSTORE_STORE or ./.ckptstore/store).
    store: str | None = None
    #: Manifest database (None: $CKPTSTORE_DB or ./.ckptstore/manifest.db).
    db: str | None = None
    #: The run; re-running with the same name resumes it.
    run_name: str = "grpo-demo"
    #: Save every this many train steps (these saves compete for keep_top_k).
    save_period: int = 5
    #: Periodic checkpoints kept by metric (None: keep every checkpoint).
    keep_top_k: int | None = 3
    #: The newest checkpoints kept whatever their metric or trigger.
    keep_latest_k: int = 2
    #: Steps that are multiples of this are kept permanently (None: no such rule).
    keep_every_n_steps: int | None = None
    #: The metric keep_top_k ranks by: "train:<key>", key one of TRAIN_METRICS.
    metric_name: str = "train:reward"
    #: Whether a larger metric is better.
    higher_is_better: bool = True
    #: Save the optimizer state too.
    save_optimizer: bool = True
    #: Upload and commit in the background (training waits only for the snapshot).
    async_save: bool = True
    #: "DD:HH:MM:SS" after process start, or an absolute ISO-8601 time ("2026-12-01T06:00Z"):
    #: save and stop before the next step would overrun it.
    checkpoint_must_save_by: str | None = None
    #: Train at most this many steps per start, then save and stop (exit 0); the next start
    #: resumes. Unlike checkpoint_must_save_by, start-up time does not count. None: no limit.
    stop_after_steps: int | None = None
    #: Resuming with a different model config (task, architecture, warm-up, seed) is refused
    #: unless fork=true, which starts run "<run_name>-fork-<hash>" from the newest checkpoint.
    fork: bool = False
    #: How a fork whose architecture changed starts: "parent" refuses (the weights do not fit),
    #: "fresh" starts from the warm-up model and records that in the run's config.
    fork_init: str = "parent"
    #: When the run has checkpoints but none of them loads (all corrupt), start it over from
    #: step 0 instead of refusing; the corrupt checkpoints stay in the run's history. A run
    #: with a loadable checkpoint resumes from it whatever this says.
    start_fresh: bool = False
    #: Node-local tiers (a RAM disk such as /dev/shm, or an NVMe; may contain {node}, the
    #: node's name): every save goes there, fsynced on local_replicas nodes, and the saves at
    #: save_period steps (and the last) are drained to the store in the background. None: every
    #: save goes to the store.
    local_dir: str | None = None
    #: With local_dir: a local save every this many train steps.
    local_period: int = 1
    #: With local_dir: on how many nodes' tiers every blob is before a local save commits
    #: (0: 2 where the job spans two nodes or more, else 1).
    local_replicas: int = 0
    #: With local_dir: how many of the newest checkpoints each tier keeps, besides every local
    #: checkpoint not yet drained to the store.
    local_keep_last: int = 2

    def __post_init__(self) -> None:
        _at_least(self.save_period, 1, "checkpointing.save_period")
        _at_least(self.keep_latest_k, 0, "checkpointing.keep_latest_k")
        if self.keep_top_k is not None:
            _at_least(self.keep_top_k, 0, "checkpointing.keep_top_k")
        if self.keep_every_n_steps is not None:
            _at_least(self.keep_every_n_steps, 1, "checkpointing.keep_every_n_steps")
        if self.fork_init not in FORK_INITS:
            raise ConfigurationError(
                f"checkpointing.fork_init={self.fork_init!r} must be one of {list(FORK_INITS)}"
            )
        if self.stop_after_steps is not None:
            _at_least(self.stop_after_steps, 1, "checkpointing.stop_after_steps")
        _at_least(self.local_period, 1, "checkpointing.local_period")
        _at_least(self.local_replicas, 0, "checkpointing.local_replicas")
        _at_least(self.local_keep_last, 1, "checkpointing.local_keep_last")
        if self.local_dir is not None:
            try:
                TierConfig(local_dir=self.local_dir)
            except ConfigError as exc:
                raise ConfigurationError(f"checkpointing.local_dir: {exc}") from None
        prefix, _, key = self.metric_name.partition(":")
        if prefix != "train" or key not in TRAIN_METRICS:
            raise ConfigurationError(
                f"checkpointing.metric_name={self.metric_name!r} is not a metric this trainer "
                f"records: use one of {', '.join('train:' + k for k in TRAIN_METRICS)}"
            )


@dataclass
class WatchdogConfig:
    """Stops a run whose pumps wait on each other (a hang burns a whole allocation)."""

    #: No train step for this many times the median time between steps: print what each pump
    #: waits for and stop with an error (exit 1). 0 turns the watchdog off.
    factor: float = 20.0
    #: ...and never sooner than this many seconds without a step, so the first steps, a
    #: resume's re-dispatch or a slow save do not trip it.
    min_seconds: float = 300.0

    def __post_init__(self) -> None:
        if not self.factor >= 0:
            raise ConfigurationError(f"watchdog.factor={self.factor} must be >= 0 (0: off)")
        if not self.min_seconds > 0:
            raise ConfigurationError(f"watchdog.min_seconds={self.min_seconds} must be > 0")


@dataclass
class LoggerConfig:
    #: Print a line every this many steps.
    print_every: int = 1
    #: A JSON-lines file recording each step's prompts (written before the update) and every
    #: dropped prompt with the reason; appended to across resumes. None: no trace.
    prompt_trace: str | None = None

    def __post_init__(self) -> None:
        _at_least(self.print_every, 1, "logger.print_every")


@dataclass
class TrainerConfig:
    """The whole configuration (DESIGN.md §9.1)."""

    #: Seeds the warm-up, the data order and the rollouts.
    seed: int = 0
    #: "ray": controller, rollout workers and policy worker are Ray actors; "local": the same
    #: classes in this process (tests, debugging).
    backend: str = "ray"
    #: The Ray cluster to join (an address such as 127.0.0.1:6379); None starts a local one.
    ray_address: str | None = None
    task: TaskConfig = field(default_factory=TaskConfig)
    policy: PolicySection = field(default_factory=PolicySection)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigurationError(f"backend={self.backend!r} must be one of {list(BACKENDS)}")
        if self.policy.num_workers > 1 and self.backend != "ray":
            raise ConfigurationError(
                f"policy.num_workers={self.policy.num_workers} shards the policy over Ray "
                "actors: set backend=ray (or policy.num_workers=1 for backend=local)"
            )
        if self.async_rl.max_buffered_rollouts < self.grpo.num_prompts_per_step:
            raise ConfigurationError(
                f"async_rl.max_buffered_rollouts={self.async_rl.max_buffered_rollouts} must be "
                f">= grpo.num_prompts_per_step={self.grpo.num_prompts_per_step} (a train step "
                "needs that many groups buffered at once)"
            )

    @property
    def min_groups(self) -> int:
        """Ready groups a train step waits for."""
        return self.async_rl.min_groups_for_streaming_train or self.grpo.num_prompts_per_step

    def to_dict(self) -> dict[str, Any]:
        """Plain values, as YAML would hold them."""
        return dataclasses.asdict(self)


# Sections left out of the config recorded with a run: where it is stored, how it is logged and
# run. A resumed run may change them.
RUNTIME_KEYS = ("backend", "ray_address", "checkpointing", "logger", "watchdog")
#: Policy keys that are not part of the model's identity: the optimizer's learning rate, and
#: how the policy is spread over workers (a resume may reshard it).
POLICY_NOT_IDENTITY = (
    "lr",
    "num_workers",
    "replicas",
    "worker_resources",
    "collective_timeout_s",
)


def load_config(config_file: str | Path | None, overrides: Sequence[str]) -> TrainerConfig:
    """Defaults, then the YAML file, then ``dotted.key=value`` overrides."""
    layers = []
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigurationError(f"config file {path} does not exist")
        layers.append(path)
    for item in overrides:
        if "=" not in item:
            raise ConfigurationError(f"override {item!r} is not of the form dotted.key=value")
    try:
        cfg = OmegaConf.structured(TrainerConfig)
        for layer in layers:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(layer))
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        built = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:  # omegaconf names the key; keep it to one line
        raise ConfigurationError(f"bad configuration: {_one_line(exc)}") from None
    assert isinstance(built, TrainerConfig)
    return built


#: Keys of earlier versions -> their names now (an old YAML file gets told what to write).
RENAMED = {
    "logging": "logger",
    "async_rl.sampler.class": "async_rl.sampler.custom_class",
}


def _one_line(exc: OmegaConfBaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    message = lines[0] if lines else type(exc).__name__
    key = next((line for line in lines if line.startswith("full_key:")), None)
    full_key = key.split(":", 1)[1].strip() if key is not None else ""
    if key is not None and full_key not in message:
        message += f" ({key})"
    renamed = [
        (old, new)
        for old, new in RENAMED.items()
        if full_key == old or full_key.startswith(old + ".")
    ]
    if renamed:
        message += f"; {renamed[0][0]!r} is now called {renamed[0][1]!r}"
    elif message.startswith("Key ") and " not in " in message:
        message += ": an unknown config key; trainer/config.py lists every key"
    return message


def training_config(cfg: TrainerConfig) -> dict[str, Any]:
    """The config without RUNTIME_KEYS: what a run records (its identity is
    :func:`model_config`, the part a resume must not change)."""
    out: dict[str, Any] = json.loads(json.dumps(cfg.to_dict()))
    for key in RUNTIME_KEYS:
        out.pop(key, None)
    return out


def model_config(cfg: TrainerConfig | dict[str, Any]) -> dict[str, Any]:
    """What defines the model and its reference: a resumed run must not change it (fork instead)."""
    plain = cfg.to_dict() if isinstance(cfg, TrainerConfig) else cfg
    return {
        "task": plain.get("task"),
        "policy": {
            k: v for k, v in (plain.get("policy") or {}).items() if k not in POLICY_NOT_IDENTITY
        },
        "warmup": plain.get("warmup"),
        "seed": plain.get("seed"),
    }


def architecture_changed(changed: Sequence[str]) -> bool:
    """Whether changed model-config keys change the weights' shapes (task or policy keys)."""
    return any(key.split(".")[0] in ("task", "policy") for key in changed)


def fingerprint(value: Any) -> str:
    """A short, stable name part for a config (the first 12 hex digits of ckptstore's)."""
    return config_fingerprint(value)[:12]


def parse_deadline(value: str | None, process_start: float) -> float | None:
    """``checkpoint_must_save_by`` as a time budget in seconds counted from process start.

    Accepts a duration ("DD:HH:MM:SS", or e.g. "90m") or an absolute ISO-8601 time;
    ``process_start`` is the wall-clock time (``time.time()``) at which the process started.
    """
    if value is None or value == "":
        return None
    key = "checkpointing.checkpoint_must_save_by"
    text = str(value).strip()
    if "-" not in text and "T" not in text:
        try:
            return parse_duration(text, what=key)
        except ConfigError as exc:
            raise ConfigurationError(str(exc)) from None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigurationError(
            f"{key}={text!r} is neither a duration (DD:HH:MM:SS, 90m) nor an ISO-8601 time "
            "such as 2026-12-01T06:00:00Z"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp() - process_start
