"""The replay buffer (DESIGN.md §9.3): groups of G samples of one prompt, payloads in a data plane.

A group's life: ``reserve()`` appends an unready slot when its prompt is dispatched; the rollout's
``commit()`` stores the :class:`Rollout` a worker generated (checked when it was made), stamps
``end_weight`` and marks it ready (or rolls everything back and raises); the sampler later
selects it for training or evicts it, which removes it. Only ready groups are checkpointed;
``load_state_dict()`` validates everything before touching the buffer.

A group's payload is kept as the rollout made it (one TensorDict of G rows): ``state_dict()``
hands it to the checkpoint as it is, so the save's snapshot is its only copy.
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


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """One prompt's group as a rollout worker generated it: G samples, one payload row each."""

    group_id: int
    sample_ids: list[int]
    #: Sequence length of each sample.
    seq_lens: list[int]
    #: The weight version each sample was generated with.
    weight_versions: list[int]
    #: One row per sample, in ``sample_ids`` order.
    payload: TensorDict

    def __post_init__(self) -> None:
        n = len(self.sample_ids)
        if not len(self.seq_lens) == len(self.weight_versions) == n:
            raise ReplayBufferError(
                f"group {self.group_id} has {n} sample ids but {len(self.seq_lens)} lengths and "
                f"{len(self.weight_versions)} weight versions"
            )
        if len(set(self.sample_ids)) != n:
            raise ReplayBufferError(f"group {self.group_id} repeats a sample id: {self.sample_ids}")
        if not isinstance(self.payload, TensorDict):
            raise ReplayBufferError(
                f"group {self.group_id}: the payload must be a TensorDict, not "
                f"{type(self.payload).__name__}"
            )
        if tuple(self.payload.batch_size[:1]) != (n,):
            raise ReplayBufferError(
                f"group {self.group_id}: payload batch size {tuple(self.payload.batch_size)} "
                f"is not ({n}, ...)"
            )


@dataclass
class Group:
    """A replay-buffer slot: one prompt's group, unready until its rollout is committed."""

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
        """The group's fields as a checkpoint stores them (no payload)."""
        return {key: getattr(self, key) for key in GROUP_KEYS}


class DataPlane:
    """Sample payloads keyed by sample id. A ``put``'s TensorDict is kept whole: ``get`` of
    exactly its ids, in order, returns it without a copy; any other selection is stacked."""

    def __init__(self) -> None:
        #: sample id -> (the TensorDict holding its row, the row).
        self._rows: dict[int, tuple[TensorDict, int]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._rows

    def put(self, sample_ids: list[int], payload: TensorDict) -> None:
        """Store ``payload``'s rows under ``sample_ids`` (nobody changes ``payload`` after)."""
        for i, sample_id in enumerate(sample_ids):
            self._rows[sample_id] = (payload, i)

    def get(self, sample_ids: Iterable[int]) -> TensorDict:
        """The rows of ``sample_ids`` in that order: the stored TensorDict itself when they are
        all of one ``put``'s rows in its order, else a new stacked one."""
        rows = [self._rows[i] for i in sample_ids]
        whole = rows[0][0] if rows else None
        if (
            whole is not None
            and len(rows) == whole.batch_size[0]
            and all(p is whole and r == i for i, (p, r) in enumerate(rows))
        ):
            return whole
        return torch.stack([p[r] for p, r in rows])  # type: ignore[return-value]

    def drop(self, sample_ids: Iterable[int]) -> None:
        """Forget these rows (ids not stored are ignored)."""
        for sample_id in sample_ids:
            self._rows.pop(sample_id, None)


class ReplayBuffer:
    """Groups in dispatch order, at most ``capacity``, each of ``group_size`` samples."""

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

    def commit(self, rollout: Rollout, *, end_weight: int) -> Group:
        """Store the rollout of a reserved group and mark it ready; on any error, change nothing."""
        group = self.find(rollout.group_id)
        if group.ready:
            raise ReplayBufferError(f"group {rollout.group_id} is already committed")
        stored: list[int] = []
        try:
            self._check_fits(rollout)
            stored = list(rollout.sample_ids)
            self.data.put(stored, rollout.payload)
            group.sample_ids = stored
            group.seq_lens = list(rollout.seq_lens)
            group.weight_versions = list(rollout.weight_versions)
            group.end_weight = end_weight
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

    def _check_fits(self, rollout: Rollout) -> None:
        """What a rollout checked itself cannot know: this buffer's group size, and the sample
        ids it holds already."""
        if len(rollout.sample_ids) != self.group_size:
            raise ReplayBufferError(
                f"group {rollout.group_id} needs exactly {self.group_size} samples "
                f"(grpo.num_generations_per_prompt); the rollout has {len(rollout.sample_ids)}"
            )
        clash = [i for i in rollout.sample_ids if i in self.data]
        if clash:
            raise ReplayBufferError(
                f"group {rollout.group_id}: sample ids {clash} are already buffered"
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
