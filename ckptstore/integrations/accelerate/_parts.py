"""What an :class:`accelerate.Accelerator` checkpoint holds, as ckptstore components, and how a
loaded checkpoint is put back.

Shared components (the same on every process under DDP; stored once, by the main process):
``model``, ``optimizer``, ``scheduler`` (``model/1``, ... for the second prepared object on),
``scaler`` and ``custom/<i>`` for each object given to ``register_for_checkpointing``.
Each process stores its own ``process/<rank>``: ``accelerator.step``, its random number
generators (:mod:`._rng`) and the position of each prepared dataloader.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.errors import ConfigError, SerializationError
from ckptstore.extending import check_savable
from ckptstore.integrations.accelerate import _rng

#: Distributed types whose model and optimizer state live whole on every process.
_REPLICATED = {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU"}
_REPLICATED |= {"MULTI_SDAA", "MULTI_MUSA", "MULTI_NEURON"}
#: The counts a checkpoint records and a load compares.
COUNTS = ("models", "optimizers", "schedulers", "custom_objects", "dataloaders")
INFO_KEY = "accelerate"


def name(kind: str, index: int) -> str:
    """The component of the ``index``-th prepared object of ``kind`` (``model``, ``model/1``)."""
    return kind if index == 0 else f"{kind}/{index}"


def process_component(rank: int) -> str:
    """The component holding process ``rank``'s own state."""
    return f"process/{rank}"


def check_supported(accelerator: Any) -> None:
    """Refuse setups whose state is sharded across processes (their checkpoints are DCP's)."""
    kind = accelerator.distributed_type.name
    if kind not in _REPLICATED:
        raise ConfigError(
            f"ckptstore's Accelerate integration saves replicated (DDP or single-process) "
            f"state; this Accelerator uses {kind}, whose model and optimizer are sharded: save "
            "them with ckptstore.integrations.dcp (torch.distributed.checkpoint) instead"
        )


def counts(accelerator: Any) -> dict[str, Any]:
    """What a checkpoint records about the objects it holds (compared again at load)."""
    return {
        "processes": accelerator.num_processes,
        "models": len(accelerator._models),
        "optimizers": len(accelerator._optimizers),
        "schedulers": len(accelerator._schedulers),
        "custom_objects": len(accelerator._custom_objects),
        "dataloaders": len(accelerator._dataloaders),
        "scaler": accelerator.scaler is not None,
    }


def shared_state(accelerator: Any) -> dict[str, Any]:
    """The main process's components: models, optimizers, schedulers, scaler, custom objects.
    Each is checked storable first; an error names the component and the fix."""
    parts: dict[str, Any] = {}
    for i, model in enumerate(accelerator._models):
        parts[name("model", i)] = accelerator.unwrap_model(model).state_dict()
    for i, optimizer in enumerate(accelerator._optimizers):
        parts[name("optimizer", i)] = optimizer.state_dict()
    for i, scheduler in enumerate(accelerator._schedulers):
        parts[name("scheduler", i)] = scheduler.state_dict()
    if accelerator.scaler is not None:
        parts["scaler"] = accelerator.scaler.state_dict()
    for i, obj in enumerate(accelerator._custom_objects):
        parts[f"custom/{i}"] = obj.state_dict()
    for component, state in parts.items():
        checked(component, state)
    return parts


def checked(component: str, state: Any) -> Any:
    """``state`` if ckptstore can store it; else a SerializationError naming the component,
    the value's path in it and what to store instead."""
    try:
        check_savable(state)
    except SerializationError as exc:
        raise SerializationError(
            f"component {component!r}: {exc}. Its state_dict() must hold only tensors, numpy "
            "arrays, dicts/lists/tuples and str/int/float/bool/None (ckptstore never pickles): "
            "convert that value to one of these in state_dict() and back in load_state_dict()"
        ) from None
    return state


def process_state(accelerator: Any) -> dict[str, Any]:
    """This process's own component: ``accelerator.step``, its RNGs, its dataloaders' places."""
    state = {
        "step": int(accelerator.step),
        "rng": _rng.capture(),
        "dataloaders": [_dataloader_state(dl, i) for i, dl in enumerate(accelerator._dataloaders)],
    }
    checked(process_component(accelerator.process_index), state)
    return state


def _sampler(dataloader: Any) -> Any:
    from accelerate.data_loader import get_sampler  # type: ignore[import-untyped,import-not-found,unused-ignore]

    return get_sampler(dataloader)


def _dataloader_state(dataloader: Any, index: int) -> dict[str, Any]:
    """Where a prepared dataloader stands, in values a load can set back exactly.

    A save inside the loop over its last batch is a save between epochs (the next batch comes
    from the next epoch), though Accelerate counts the epoch only once the loop ends.
    """
    from accelerate.data_loader import SeedableRandomSampler  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from accelerate.state import GradientState  # type: ignore[import-untyped,import-not-found,unused-ignore]

    sampler = _sampler(dataloader)
    iterating = any(ref is dataloader for ref in GradientState().dataloader_references)
    stateful = bool(getattr(dataloader, "use_stateful_dataloader", False))
    position = copy.deepcopy(dataloader.state_dict()) if stateful else None
    if position is not None:
        started = position.get("_num_yielded", 0) > 0
        finished = bool(position.get("_iterator_finished", False))
    else:
        started, finished = iterating, bool(getattr(dataloader, "end_of_dataloader", False))
    iteration = int(getattr(dataloader, "iteration", 0))
    if finished or not started:
        if iterating and finished:
            iteration += 1
        position = None
    else:
        _check_reproducible(index, sampler, position)
    state: dict[str, Any] = {"iteration": iteration, "position": position}
    if isinstance(sampler, SeedableRandomSampler):
        state["seed"] = int(sampler.initial_seed)
    synchronized = getattr(dataloader, "synchronized_generator", None)
    if synchronized is not None:
        state["synchronized_generator"] = synchronized.get_state()
    generator = getattr(sampler, "generator", None)
    if generator is not None and generator is not synchronized:
        state["sampler_generator"] = generator.get_state()
    return state


def _check_reproducible(index: int, sampler: Any, position: Any) -> None:
    """A save in the middle of an epoch needs the position within it and an order that can be
    drawn again; refuse, naming the fix, when either is missing."""
    from accelerate.data_loader import SeedableRandomSampler  # type: ignore[import-untyped,import-not-found,unused-ignore]

    fix = (
        "prepare it under Accelerator(dataloader_config=DataLoaderConfiguration("
        "use_stateful_dataloader=True, use_seedable_sampler=True)), or save between epochs"
    )
    if position is None:
        raise ConfigError(
            f"dataloader {index} is in the middle of an epoch and Accelerate does not track "
            f"how far it got: {fix}"
        )
    if isinstance(sampler, torch.utils.data.RandomSampler) and not isinstance(
        sampler, SeedableRandomSampler
    ):
        raise ConfigError(
            f"dataloader {index} is in the middle of an epoch whose shuffled order was drawn "
            f"from a generator state that is gone, so a resume could not replay it: {fix}"
        )


def check_counts(accelerator: Any, saved: Any, where: str, rng: bool) -> None:
    """The checkpoint holds exactly the objects this Accelerator has prepared/registered."""
    if not isinstance(saved, dict):
        raise ConfigError(
            f"{where} was not saved by ckptstore.integrations.accelerate (no "
            f"training_info[{INFO_KEY!r}]); load it with Run.load"
        )
    now = counts(accelerator)
    differ = [f"{k}: saved {saved.get(k)}, now {now[k]}" for k in COUNTS if saved.get(k) != now[k]]
    if differ:
        raise ConfigError(
            f"{where} does not match this Accelerator ({'; '.join(differ)}): prepare and "
            "register_for_checkpointing the same objects, in the same order, as the job that "
            "saved it"
        )
    if rng and saved.get("processes") != now["processes"]:
        raise ConfigError(
            f"{where} was saved by {saved.get('processes')} processes and this job has "
            f"{now['processes']}: each process resumes its own generators and data position, "
            "so resume with the same number, or pass rng=False to load the model, optimizer, "
            "schedulers and registered objects alone"
        )


def check_shared(accelerator: Any, parts: dict[str, Any], where: str) -> None:
    """Every shared component this Accelerator puts back is a state dict."""
    names = [
        name(k, i)
        for k in ("model", "optimizer", "scheduler")
        for i in range(_count(accelerator, k))
    ]
    names += ["scaler"] if accelerator.scaler is not None else []
    for component in names:
        _mapping(parts, component, where)


def _count(accelerator: Any, kind: str) -> int:
    return len(
        {
            "model": accelerator._models,
            "optimizer": accelerator._optimizers,
            "scheduler": accelerator._schedulers,
        }[kind]
    )


def apply_shared(accelerator: Any, parts: dict[str, Any]) -> None:
    """Put the shared components (checked by :func:`check_shared`) back into the prepared
    and registered objects."""
    for i, model in enumerate(accelerator._models):
        accelerator.unwrap_model(model).load_state_dict(parts[name("model", i)])
    for i, optimizer in enumerate(accelerator._optimizers):
        optimizer.load_state_dict(parts[name("optimizer", i)])
    for i, scheduler in enumerate(accelerator._schedulers):
        scheduler.load_state_dict(parts[name("scheduler", i)])
    if accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(parts["scaler"])
    for i, obj in enumerate(accelerator._custom_objects):
        obj.load_state_dict(parts[f"custom/{i}"])


def _mapping(parts: dict[str, Any], component: str, where: str) -> dict[str, Any]:
    state = parts.get(component)
    if not isinstance(state, dict):
        raise SerializationError(
            f"{where} component {component!r}: expected a state dict, found "
            f"{type(state).__name__} (corrupt or crafted); load another checkpoint"
        )
    return state


@dataclass(frozen=True, slots=True)
class ProcessState:
    """A process's own component, checked: ready to put back."""

    step: int
    rng: _rng.Checked | None
    dataloaders: list[dict[str, Any]]


def check_process(accelerator: Any, state: Any, where: str, rng: bool) -> ProcessState:
    """A process component's every field checked (``rng``: its generators too)."""
    if not isinstance(state, dict) or set(state) != {"step", "rng", "dataloaders"}:
        raise SerializationError(f"{where}: not a process state (corrupt or crafted)")
    loaders = state["dataloaders"]
    if not isinstance(loaders, list) or len(loaders) != len(accelerator._dataloaders):
        raise SerializationError(f"{where}/dataloaders: not a list of positions (corrupt)")
    checked_loaders = [
        _checked_loader(s, f"{where}/dataloaders/{i}") for i, s in enumerate(loaders)
    ]
    if not isinstance(state["step"], int) or isinstance(state["step"], bool):
        raise SerializationError(f"{where}/step: not an int (corrupt or crafted)")
    generators = _rng.check(state["rng"], f"{where}/rng") if rng else None
    return ProcessState(state["step"], generators, checked_loaders)


def apply_process(accelerator: Any, state: ProcessState) -> None:
    """Put this process's own state back: step, generators, dataloader positions."""
    accelerator.step = state.step
    for dataloader, saved in zip(accelerator._dataloaders, state.dataloaders, strict=True):
        _restore_dataloader(dataloader, saved)
    # Last: restoring a dataloader's position draws from the generators (see below).
    if state.rng is not None:
        _rng.restore(state.rng)


def _checked_loader(saved: Any, path: str) -> dict[str, Any]:
    allowed = {"iteration", "seed", "synchronized_generator", "sampler_generator", "position"}
    if not isinstance(saved, dict) or not {"iteration", "position"} <= set(saved) <= allowed:
        raise SerializationError(f"{path}: not a dataloader position (corrupt or crafted)")
    for key in ("synchronized_generator", "sampler_generator"):
        value = saved.get(key)
        if value is not None and not (
            isinstance(value, torch.Tensor) and value.dtype == torch.uint8
        ):
            raise SerializationError(f"{path}/{key}: not a generator state (corrupt or crafted)")
    if not isinstance(saved["iteration"], int) or not (
        saved["position"] is None or isinstance(saved["position"], dict)
    ):
        raise SerializationError(f"{path}: not a dataloader position (corrupt or crafted)")
    return saved


def _restore_dataloader(dataloader: Any, saved: dict[str, Any]) -> None:
    from accelerate.data_loader import SeedableRandomSampler  # type: ignore[import-untyped,import-not-found,unused-ignore]

    dataloader.set_epoch(saved["iteration"])
    sampler = _sampler(dataloader)
    if "seed" in saved and isinstance(sampler, SeedableRandomSampler):
        sampler.initial_seed = saved["seed"]
    if "synchronized_generator" in saved and dataloader.synchronized_generator is not None:
        dataloader.synchronized_generator.set_state(saved["synchronized_generator"])
    generator = getattr(sampler, "generator", None)
    if "sampler_generator" in saved and generator is not None:
        generator.set_state(saved["sampler_generator"])
    position = saved["position"]
    if position is None and getattr(dataloader, "use_stateful_dataloader", False):
        # Drop the iterator Accelerate made when it prepared the dataloader: the next epoch
        # makes its own, drawing its seed then, as in the job that saved.
        dataloader.base_dataloader.load_state_dict({})
    if position is not None:
        if not getattr(dataloader, "use_stateful_dataloader", False):
            raise ConfigError(
                "the checkpoint holds a stateful dataloader's position and this dataloader is "
                "not stateful: prepare it with DataLoaderConfiguration(use_stateful_dataloader="
                "True), as the job that saved it did"
            )
        dataloader.load_state_dict(position)
        # What state_dict() answers until the next batch updates it.
        dataloader.dl_state_dict = copy.deepcopy(position)
        # Make the iterator the next loop over it will use, now: creating one draws a seed
        # from torch's generator, which the job that saved did at the epoch's start, before
        # the state saved. The generators are restored after this draw.
        dataloader.base_dataloader.state_dict()
