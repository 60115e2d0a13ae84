"""Prompt-group samplers (DESIGN.md §9.4): what to dispatch, what to train on, what to drop.

The dispatch index counts admitted prompt batches from -1; ``set_dispatch_index(s)`` sets it to
``s - 1`` when a run resumes at step ``s``. ``trainer_version`` is the number of train steps
taken (the version of the weights the rollout workers have). A sampler takes its options from
``async_rl.sampler`` (:class:`~trainer.config.SamplerConfig`, which checks the name and ranges).
"""

from __future__ import annotations

import importlib

from trainer.config import SamplerConfig
from trainer.replay import Group


class PromptGroupSampler:
    """Base class: never gated, selects nothing, evicts nothing. Subclasses set ``name``."""

    name = "base"
    gated = False

    def __init__(self, config: SamplerConfig | None = None) -> None:
        """``config``: ``async_rl.sampler`` (its defaults if None)."""
        config = config or SamplerConfig()
        self.max_staleness_versions = config.max_staleness_versions
        self.gate_window = config.gate_window
        self.dispatch_index = -1

    # -- dispatch -------------------------------------------------------------------------

    def can_admit(self, trainer_version: int) -> bool:
        """False while a gated sampler is ``gate_window`` batches ahead of the trainer."""
        return not self.gated or self.dispatch_index < trainer_version + self.gate_window

    def admit(self, trainer_version: int) -> int | None:
        """Count an admitted prompt batch; return the target_step to stamp on its groups."""
        self.dispatch_index += 1
        return None

    def set_dispatch_index(self, step: int) -> None:
        self.dispatch_index = step - 1

    # -- training -------------------------------------------------------------------------

    def select(self, ready: list[Group], trainer_version: int, count: int) -> list[Group]:
        return []

    def evict(self, groups: list[Group], trainer_version: int) -> list[Group]:
        return []

    def should_abort_inflight(self, group: Group, trainer_version: int) -> bool:
        return False

    @property
    def is_on_policy(self) -> bool:
        return False

    def required_buffer_capacity(self, prompts_per_step: int) -> int:
        return prompts_per_step

    def in_window(self, group: Group, trainer_version: int) -> bool:
        return (
            trainer_version - self.max_staleness_versions <= group.start_weight <= trainer_version
        )


class WindowedSampler(PromptGroupSampler):
    """Never gated; trains on groups started within ``max_staleness_versions`` of the trainer."""

    name = "windowed"

    def select(self, ready: list[Group], trainer_version: int, count: int) -> list[Group]:
        """Oldest weights first (then dispatch order), within the window."""
        fresh = [g for g in ready if self.in_window(g, trainer_version)]
        return sorted(fresh, key=lambda g: (g.start_weight, g.dispatch_index))[:count]

    def evict(self, groups: list[Group], trainer_version: int) -> list[Group]:
        floor = trainer_version - self.max_staleness_versions
        return [g for g in groups if g.ready and g.start_weight < floor]

    def should_abort_inflight(self, group: Group, trainer_version: int) -> bool:
        return group.start_weight < trainer_version - self.max_staleness_versions

    @property
    def is_on_policy(self) -> bool:
        return self.max_staleness_versions == 0


class WeightFifoSampler(WindowedSampler):
    """Gated; oldest in-window groups first. Out-of-window groups are dropped (they hold
    permits), and rollouts that would land out of the window are aborted."""

    name = "weight_fifo"
    gated = True

    def required_buffer_capacity(self, prompts_per_step: int) -> int:
        return prompts_per_step * self.gate_window


class InOrderSampler(PromptGroupSampler):
    """Gated; batch k is stamped target_step=k and trained at exactly trainer version k."""

    name = "in_order"
    gated = True

    def admit(self, trainer_version: int) -> int | None:
        self.dispatch_index += 1
        return self.dispatch_index

    def select(self, ready: list[Group], trainer_version: int, count: int) -> list[Group]:
        due = [g for g in ready if g.target_step == trainer_version]
        return sorted(due, key=lambda g: g.group_id)[:count]

    def evict(self, groups: list[Group], trainer_version: int) -> list[Group]:
        return [g for g in groups if g.target_step is not None and g.target_step < trainer_version]

    def should_abort_inflight(self, group: Group, trainer_version: int) -> bool:
        return group.target_step is not None and group.target_step < trainer_version

    def required_buffer_capacity(self, prompts_per_step: int) -> int:
        return prompts_per_step * self.gate_window


class ReadyFirstSampler(PromptGroupSampler):
    """Gated; any ready group started at or before the trainer's version; never evicts."""

    name = "ready_first"
    gated = True

    def select(self, ready: list[Group], trainer_version: int, count: int) -> list[Group]:
        usable = [g for g in ready if g.start_weight <= trainer_version]
        return sorted(usable, key=lambda g: g.dispatch_index)[:count]

    def required_buffer_capacity(self, prompts_per_step: int) -> int:
        return prompts_per_step * self.gate_window


BUILTIN: dict[str, type[PromptGroupSampler]] = {
    cls.name: cls for cls in (WindowedSampler, WeightFifoSampler, InOrderSampler, ReadyFirstSampler)
}


def make_sampler(config: SamplerConfig) -> PromptGroupSampler:
    """The sampler ``async_rl.sampler.name``; ``custom`` loads ``async_rl.sampler.custom_class``
    (``module:Class``, a PromptGroupSampler subclass)."""
    if config.name != "custom":
        return BUILTIN[config.name](config)
    target = str(config.custom_class)
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        raise ValueError(f"cannot load custom sampler {target!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, PromptGroupSampler)):
        raise TypeError(f"custom sampler {target!r} is not a PromptGroupSampler subclass")
    sampler = cls(config)
    if sampler.name in (*BUILTIN, "base"):
        sampler.name = f"custom:{target}"
    return sampler
