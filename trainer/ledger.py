"""The prompt ledger: every prompt admitted and not yet trained on or dropped (exactly-once).

A prompt is admitted in a batch (the unit the sampler's dispatch index counts), dispatched to a
rollout worker at some weight version (its start weight), becomes ready when its group is
committed to the replay buffer, and leaves the ledger when it is trained on or dropped. A prompt
whose rollout failed goes back to the re-dispatch queue (and starts at the weights of its next
dispatch). The ledger's state (the rollout state in a checkpoint) lists the outstanding prompts
in dispatch order with their start weights and the sampler's dispatch index, so a resumed run
dispatches exactly the prompts, batches and indices the uninterrupted run would have, and its
sampler sees the same start weights: a prompt in flight at the save is not made younger by
its re-dispatch, so it is evicted, aborted and ordered as it would have been (DESIGN.md
§9.5-§9.6).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainer.errors import ResumeError


@dataclass(eq=False)
class Prompt:
    """One admitted prompt: its group id, its dataset id, where it is and, once dispatched, the
    weight version its rollout started at."""

    group_id: int
    prompt_id: int
    state: str = "waiting"  # waiting -> inflight -> ready; removed once trained or dropped
    start_weight: int | None = None


@dataclass(eq=False)
class Batch:
    """One admitted prompt batch (the unit the dispatch index counts)."""

    dispatch_index: int
    target_step: int | None
    prompts: list[Prompt] = field(default_factory=list)


Entry = tuple[Batch, Prompt]


class PromptLedger:
    """Outstanding prompts by group id, the re-dispatch queue and the in-flight count."""

    def __init__(self) -> None:
        self.outstanding: dict[int, Entry] = {}
        self.redispatch: deque[Entry] = deque()
        self.inflight = 0
        self.aborted: set[int] = set()
        self.next_group_id = 0

    def admit(
        self, dispatch_index: int, target_step: int | None, prompt_ids: Iterable[int]
    ) -> Batch:
        """Record a new batch; each prompt gets the next group id."""
        batch = Batch(dispatch_index, target_step)
        for prompt_id in prompt_ids:
            self._register(batch, Prompt(self.next_group_id, int(prompt_id)))
            self.next_group_id += 1
        return batch

    def take_redispatch(self) -> list[Entry]:
        """The prompts waiting to be dispatched again, in order; the queue empties."""
        todo = list(self.redispatch)
        self.redispatch.clear()
        return todo

    def dispatched(self, prompt: Prompt, start_weight: int) -> None:
        """The prompt's rollout started, at weight version ``start_weight``."""
        prompt.state = "inflight"
        prompt.start_weight = start_weight
        self.inflight += 1

    def ready(self, prompt: Prompt) -> None:
        """The prompt's rollout finished and its group is in the buffer."""
        if prompt.state == "inflight":
            self.inflight -= 1
        prompt.state = "ready"

    def entry(self, group_id: int) -> Entry:
        """The batch and prompt of an outstanding group."""
        return self.outstanding[group_id]

    def forget(self, group_id: int) -> Entry | None:
        """Remove a group's prompt (trained on or dropped); None if it was not outstanding."""
        entry = self.outstanding.pop(group_id, None)
        if entry is None:
            return None
        batch, prompt = entry
        if prompt.state == "inflight":
            self.inflight -= 1
        batch.prompts.remove(prompt)
        self.aborted.discard(group_id)
        return entry

    def requeue(self, entries: Iterable[Entry]) -> None:
        """Prompts whose rollout failed: outstanding again, dispatched again first."""
        for batch, prompt in entries:
            prompt.state = "waiting"
            prompt.start_weight = None
            self._register(batch, prompt)
            self.redispatch.append((batch, prompt))

    def state_dict(self, dispatch_index: int) -> dict[str, Any]:
        """The rollout state: outstanding prompts in dispatch order as ``[group id, prompt id,
        start weight or None]``, and the dispatch index."""
        unique = {id(batch): batch for batch, _ in self.outstanding.values()}
        order = sorted(unique.values(), key=lambda b: (b.dispatch_index, b.prompts[0].group_id))
        return {
            "next_group_id": self.next_group_id,
            "dispatch_index": dispatch_index,
            "batches": [
                {
                    "dispatch_index": batch.dispatch_index,
                    "target_step": batch.target_step,
                    "prompts": [[p.group_id, p.prompt_id, p.start_weight] for p in batch.prompts],
                }
                for batch in order
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any], ready: set[int], where: str) -> None:
        """Restore outstanding prompts; those in ``ready`` (restored groups) need no rollout,
        the others are queued for re-dispatch in their saved order, keeping their start weights
        (a rollout state saved before start weights were recorded has none: such prompts start
        at the weights of their re-dispatch)."""
        try:
            batches = [
                (
                    int(saved["dispatch_index"]),
                    _optional_int(saved["target_step"]),
                    [_saved_prompt(entry) for entry in saved["prompts"]],
                )
                for saved in state.get("batches", [])
            ]
            next_group_id = int(state.get("next_group_id", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ResumeError(
                f"{where}: the rollout state is malformed ({type(exc).__name__}: {exc}); load "
                "an older checkpoint or start a new run (checkpointing.run_name)"
            ) from None
        self.next_group_id = max(self.next_group_id, next_group_id)
        for dispatch_index, target_step, prompts in batches:
            batch = Batch(dispatch_index, target_step)
            for prompt in prompts:
                self._register(batch, prompt)
                if prompt.group_id in ready:
                    prompt.state = "ready"
                else:
                    self.redispatch.append((batch, prompt))

    def adopt(self, group_id: int, prompt_id: int, dispatch_index: int, target: int | None) -> None:
        """A restored ready group whose prompt the rollout state does not list (other data)."""
        if group_id not in self.outstanding:
            self._register(Batch(dispatch_index, target), Prompt(group_id, prompt_id, "ready"))

    def _register(self, batch: Batch, prompt: Prompt) -> None:
        batch.prompts.append(prompt)
        self.outstanding[prompt.group_id] = (batch, prompt)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _saved_prompt(entry: Any) -> Prompt:
    """``[group id, prompt id]`` or ``[group id, prompt id, start weight or None]``."""
    if len(entry) not in (2, 3):
        raise ValueError(f"a saved prompt is [group, prompt, start weight], not {entry!r}")
    start_weight = _optional_int(entry[2]) if len(entry) == 3 else None
    return Prompt(int(entry[0]), int(entry[1]), start_weight=start_weight)
