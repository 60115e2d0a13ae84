"""The replay buffer (DESIGN.md §9.3): groups of G samples of one prompt, payloads in a data plane.

A group's life: ``reserve()`` appends an unready slot when its prompt is dispatched; the rollout's
``commit()`` stores the payload, stamps ``end_weight`` and marks it ready (or rolls everything
back and raises); the sampler later selects it for training or evicts it, which removes it. Only
ready groups are checkpointed; ``load_state_dict()`` validates everything before touching the
buffer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

GROUP_KEYS = (
    "group_id",
    "prompt_id",
    "dispatch_index",
    "sample_ids",
    "seq_lens",
    "weight_versions",
    "start_weight",
    "end_weight",
    "target_step",
)


class ReplayBufferError(ValueError):
    """A group or a saved buffer that breaks the buffer's rules; nothing was changed."""


@dataclass
class Group:
    group_id: int
    prompt_id: int
    dispatch_index: int
    start_weight: int
    target_step: int | None = None
    end_weight: int = -1
    ready: bool = False
    sample_ids: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)

    def meta(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in GROUP_KEYS}


class DataPlane:
    """Sample payloads keyed by sample id (one TensorDict row per sample)."""

    def __init__(self) -> None:
        self._rows: dict[int, TensorDict] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._rows

    def put(self, sample_ids: list[int], payload: TensorDict) -> None:
        for i, sample_id in enumerate(sample_ids):
            self._rows[sample_id] = payload[i]

    def get(self, sample_ids: Iterable[int]) -> TensorDict:
        return torch.stack([self._rows[i] for i in sample_ids])  # type: ignore[return-value]

    def drop(self, sample_ids: Iterable[int]) -> None:
        for sample_id in sample_ids:
            self._rows.pop(sample_id, None)


class ReplayBuffer:
    def __init__(self, capacity: int, group_size: int) -> None:
        if capacity < 1 or group_size < 1:
            raise ValueError("a replay buffer needs capacity >= 1 and group_size >= 1")
        self.capacity = capacity
        self.group_size = group_size
        self.groups: list[Group] = []
        self.data = DataPlane()

    def __len__(self) -> int:
        return len(self.groups)

    def ready_groups(self) -> list[Group]:
        return [g for g in self.groups if g.ready]

    def find(self, group_id: int) -> Group:
        for group in self.groups:
            if group.group_id == group_id:
                return group
        raise KeyError(f"no group {group_id} in the replay buffer")

    # -- the reserve -> commit path --------------------------------------------------------

    def reserve(
        self,
        group_id: int,
        *,
        prompt_id: int,
        dispatch_index: int,
        start_weight: int,
        target_step: int | None = None,
    ) -> Group:
        if len(self.groups) >= self.capacity:
            raise ReplayBufferError(
                f"replay buffer is full ({self.capacity} groups): a capacity permit must be "
                "held for every reserved group"
            )
        if any(g.group_id == group_id for g in self.groups):
            raise ReplayBufferError(f"group {group_id} is already in the replay buffer")
        group = Group(group_id, prompt_id, dispatch_index, start_weight, target_step)
        self.groups.append(group)
        return group

    def commit(
        self,
        group_id: int,
        *,
        sample_ids: list[int],
        seq_lens: list[int],
        weight_versions: list[int],
        payload: TensorDict,
        end_weight: int,
    ) -> Group:
        """Store the rollout of a reserved group and mark it ready; on any error, change nothing."""
        group = self.find(group_id)
        if group.ready:
            raise ReplayBufferError(f"group {group_id} is already committed")
        stored: list[int] = []
        try:
            self._check_rows(group_id, sample_ids, seq_lens, weight_versions, payload)
            stored = list(sample_ids)
            self.data.put(stored, payload)
            group.sample_ids = list(sample_ids)
            group.seq_lens = [int(n) for n in seq_lens]
            group.weight_versions = [int(v) for v in weight_versions]
            group.end_weight = int(end_weight)
            group.ready = True
        except BaseException:
            self.data.drop(stored)
            group.sample_ids, group.seq_lens, group.weight_versions = [], [], []
            group.end_weight, group.ready = -1, False
            raise
        return group

    def rollback(self, group_id: int) -> Group:
        """Remove a group (unready or not), e.g. when its rollout failed or was cancelled."""
        group = self.find(group_id)
        self.groups.remove(group)
        self.data.drop(group.sample_ids)
        return group

    def take(self, groups: Iterable[Group]) -> list[tuple[Group, TensorDict]]:
        """Remove ``groups`` (selected or evicted) and return them with their payloads."""
        out = []
        for group in list(groups):
            payload = self.data.get(group.sample_ids)
            self.rollback(group.group_id)
            out.append((group, payload))
        return out

    def _check_rows(
        self,
        group_id: int,
        sample_ids: list[int],
        seq_lens: list[int],
        weight_versions: list[int],
        payload: TensorDict,
    ) -> None:
        size = self.group_size
        if not (len(sample_ids) == len(seq_lens) == len(weight_versions) == size):
            raise ReplayBufferError(
                f"group {group_id} needs exactly {size} sample ids, lengths and weight versions; "
                f"got {len(sample_ids)}, {len(seq_lens)}, {len(weight_versions)}"
            )
        if len(set(sample_ids)) != size:
            raise ReplayBufferError(f"group {group_id} repeats a sample id: {sample_ids}")
        clash = [i for i in sample_ids if i in self.data]
        if clash:
            raise ReplayBufferError(f"group {group_id}: sample ids {clash} are already buffered")
        if not isinstance(payload, TensorDict):
            raise ReplayBufferError(
                f"group {group_id}: the payload must be a TensorDict, not {type(payload).__name__}"
            )
        if tuple(payload.batch_size[:1]) != (size,):
            raise ReplayBufferError(
                f"group {group_id}: payload batch size {tuple(payload.batch_size)} "
                f"is not ({size}, ...)"
            )

    # -- checkpointing ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Ready groups only, in buffer order; unready slots are skipped, neighbours unchanged."""
        ready = self.ready_groups()
        return {
            "group_size": self.group_size,
            "groups": [g.meta() for g in ready],
            # One TensorDict per group: an unchanged group stores the same blobs next time.
            "payloads": {str(g.group_id): self.data.get(g.sample_ids) for g in ready},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> list[Group]:
        """Replace the buffer's contents with ``state``; validates everything first.

        More groups than the capacity keep the freshest (by start_weight), unless a group has a
        target_step: the sampler promised it to a train step, so dropping it would be silent.
        """
        groups, payloads = self._validate(state)
        if len(groups) > self.capacity:
            stamped = [g.group_id for g in groups if g.target_step is not None]
            if stamped:
                raise ReplayBufferError(
                    f"the saved replay buffer holds {len(groups)} groups but the capacity "
                    f"(async_rl.max_buffered_rollouts) is {self.capacity}, and groups {stamped} "
                    "carry a target_step, so none may be dropped: raise the capacity to at "
                    f"least {len(groups)}"
                )
            keep = sorted(groups, key=lambda g: g.start_weight, reverse=True)[: self.capacity]
            kept = {id(g) for g in keep}
            groups = [g for g in groups if id(g) in kept]
        self.groups = []
        self.data = DataPlane()
        for group in groups:
            self.groups.append(group)
            self.data.put(group.sample_ids, payloads[group.group_id])
        return list(self.groups)

    def _validate(self, state: Mapping[str, Any]) -> tuple[list[Group], dict[int, TensorDict]]:
        missing = [key for key in ("group_size", "groups", "payloads") if key not in state]
        if missing:
            raise ReplayBufferError(f"saved replay buffer lacks {missing}")
        if int(state["group_size"]) != self.group_size:
            raise ReplayBufferError(
                f"saved replay buffer has groups of {state['group_size']} samples, this run "
                f"uses {self.group_size} (grpo.num_generations_per_prompt)"
            )
        raw_payloads = state["payloads"]
        groups: list[Group] = []
        seen_ids: set[int] = set()
        seen_groups: set[int] = set()
        for meta in state["groups"]:
            lacking = [key for key in GROUP_KEYS if key not in meta]
            if lacking:
                raise ReplayBufferError(f"saved group {meta.get('group_id')} lacks {lacking}")
            group = Group(
                group_id=int(meta["group_id"]),
                prompt_id=int(meta["prompt_id"]),
                dispatch_index=int(meta["dispatch_index"]),
                start_weight=int(meta["start_weight"]),
                target_step=None if meta["target_step"] is None else int(meta["target_step"]),
                end_weight=int(meta["end_weight"]),
                ready=True,
                sample_ids=[int(i) for i in meta["sample_ids"]],
                seq_lens=[int(n) for n in meta["seq_lens"]],
                weight_versions=[int(v) for v in meta["weight_versions"]],
            )
            if group.group_id in seen_groups:
                raise ReplayBufferError(f"saved replay buffer repeats group {group.group_id}")
            seen_groups.add(group.group_id)
            n = self.group_size
            if not (
                len(group.sample_ids) == len(group.seq_lens) == len(group.weight_versions) == n
            ):
                raise ReplayBufferError(
                    f"saved group {group.group_id} needs exactly {n} sample ids, lengths and "
                    f"weight versions; has {len(group.sample_ids)}, {len(group.seq_lens)}, "
                    f"{len(group.weight_versions)}"
                )
            duplicates = seen_ids.intersection(group.sample_ids)
            if duplicates or len(set(group.sample_ids)) != n:
                raise ReplayBufferError(
                    f"saved group {group.group_id} repeats sample ids "
                    f"{sorted(duplicates) or group.sample_ids}"
                )
            seen_ids.update(group.sample_ids)
            groups.append(group)
        # The payloads must partition exactly into the groups: one per group, none extra.
        keys = {str(k) for k in raw_payloads}
        wanted = {str(g.group_id) for g in groups}
        if keys != wanted:
            raise ReplayBufferError(
                f"saved replay buffer payloads do not match its groups: missing "
                f"{sorted(wanted - keys)}, extra {sorted(keys - wanted)}"
            )
        payloads: dict[int, TensorDict] = {}
        for group in groups:
            payload = raw_payloads[str(group.group_id)]
            if not isinstance(payload, TensorDict) or tuple(payload.batch_size[:1]) != (
                self.group_size,
            ):
                raise ReplayBufferError(
                    f"saved payload of group {group.group_id} is not a TensorDict of "
                    f"{self.group_size} rows"
                )
            payloads[group.group_id] = payload
        return groups, payloads
