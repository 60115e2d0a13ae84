"""The policy's state in the two forms a checkpoint holds it, for one worker or N sharded ones.

* **Whole** (``policy`` and ``optimizer`` components; what one unsharded worker saves): the
  model's ``state_dict()`` and the optimizer's, keyed by parameter index as torch keys it.
* **Sharded** (``dcp/metadata`` + ``dcp/rank<r>``; what N FSDP2 ranks save through
  ``ckptstore.integrations.dcp``): ``{"model": ..., "optim": ...}`` keyed by parameter name,
  the tensors DTensors on a sharded policy. DCP reshards it to whatever layout loads it.

Either form loads into either layout: a resume may change ``policy.num_workers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ckptstore import CheckpointInfo
from ckptstore.extending import TierConfig, nearest_copies, open_store
from ckptstore.integrations import dcp as ckpt_dcp
from trainer.store_reads import CountedReads

#: The component every sharded policy checkpoint has (DCP's metadata document).
SHARDED_MARKER = ckpt_dcp.METADATA_COMPONENT
#: training_info key recording how a sharded policy was saved: {"workers": N, "optimizer": b}.
SHARDED_INFO = "policy_sharding"


def is_sharded(info: CheckpointInfo) -> bool:
    """Whether ``info`` holds its policy in the sharded (DCP) form."""
    return any(component.name == SHARDED_MARKER for component in info.components)


def sharded_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool
) -> dict[str, Any]:
    """The model's (and optimizer's) state keyed by name, as DCP saves and loads it. For a
    load, the optimizer's state is created first (zeros) so DCP has tensors to fill."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if with_optimizer:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def apply_sharded_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Put a loaded :func:`sharded_state` into the model and optimizer."""
    set_model_state_dict(model, state["model"])
    if "optim" in state:
        set_optimizer_state_dict(model, optimizer, state["optim"])


@dataclass(frozen=True)
class TierSources:
    """Where a checkpoint's blobs are, as the controller found it for the ranks: digest ->
    (the store holds it, the nodes whose tiers hold a copy), and the nodes reachable now."""

    copies: dict[str, tuple[bool, tuple[str, ...]]]
    reachable: tuple[str, ...]


def load_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: ckpt_dcp.LoadPlan,
    with_optimizer: bool,
    store: str,
    tiers: TierConfig | None = None,
    sources: TierSources | None = None,
    *,
    share: bool | None = None,
) -> dict[str, int]:
    """Load a sharded checkpoint (``plan``, resolved by the controller) into this rank's part
    of the policy, from the store (with ``tiers`` and ``sources``: each blob from its nearest
    copy on the node-local tiers). Returns the bytes this rank read from the store
    (``"store"``) and from each node's tier. A worker never opens the manifest database.

    ``share`` (``ckpt_dcp.load``'s read-once; None: on for a remote store): True where the
    ranks of several data-parallel replicas load the same shards, so that each blob is read
    from the store by one rank and sent to the others. Raises ckptstore's ``IntegrityError``
    on every rank when the stored data is damaged (the controller marks the checkpoint
    corrupt and picks the previous one)."""
    state = sharded_state(model, optimizer, with_optimizer)
    with open_store(store, create=False) as remote:
        if tiers is None or sources is None:
            counted = CountedReads(remote)
            ckpt_dcp.load(state, plan, store=counted, fallback=False, share=share)
            read = {"store": counted.read_bytes}
        else:
            nearest = nearest_copies(tiers, sources.copies, sources.reachable, remote)
            ckpt_dcp.load(state, plan, store=nearest, fallback=False, share=share)
            read = {node or "store": n for node, n in nearest.read_from.items()}
    apply_sharded_state(model, optimizer, state)
    return read


def whole_fits(model: torch.nn.Module, policy: dict[str, torch.Tensor]) -> bool:
    """Whether a whole saved policy has this model's names and (global) shapes."""
    own = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    return set(policy) == set(own) and all(tuple(policy[k].shape) == own[k] for k in own)


def apply_whole_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
) -> None:
    """Put a whole saved policy (and its index-keyed optimizer state) into a sharded model:
    every rank holds the whole state and keeps its own shard of it."""
    options = StateDictOptions(full_state_dict=True)
    whole: dict[str, Any] = dict(policy)
    set_model_state_dict(model, whole, options=options)
    if optimizer_state is not None:
        named = by_name(model, optimizer_state)
        set_optimizer_state_dict(model, optimizer, named, options=options)


def by_name(model: torch.nn.Module, optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict()`` keyed by parameter index, keyed by parameter name (the
    order of ``model.named_parameters()``, which is the order the optimizer was built with)."""
    names = [name for name, _ in model.named_parameters()]
    groups = optimizer_state["param_groups"]
    return {
        "state": {names[index]: value for index, value in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]} for group in groups
        ],
    }
