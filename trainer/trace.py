"""The prompt trace (``logger.prompt_trace=PATH``): what a run trained on, and what it dropped.

JSON lines, appended across resumes and flushed line by line:

- ``{"event": "train", "step": N, "prompt_ids": [...], "group_ids": [...], "start_weights": [...]}``
  written before step N's update (so a run killed during the update still shows it);
- ``{"event": "drop", "step": N, "group_id": g, "prompt_id": p, "reason": R}`` for every prompt
  dropped, with R one of ``evicted`` (stale for the sampler), ``aborted`` (its rollout finished
  after the sampler gave it up), ``failed`` (its rollout failed; it is dispatched again) or
  ``skipped`` (a resume did not carry it over: the sampler or the data changed);
- ``{"event": "resume", "step": N}`` when a run resumes from step N.

A step that a killed run trained and the resumed run trained again appears twice; the later
line is what the resumed run trained on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

DROP_REASONS = ("evicted", "aborted", "failed", "skipped")


class PromptTrace:
    """Appends trace lines to a file, or does nothing when no path is configured."""

    def __init__(self, path: str | None) -> None:
        self._file: IO[str] | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def train(
        self,
        step: int,
        prompt_ids: Sequence[int],
        group_ids: Sequence[int],
        start_weights: Sequence[int],
    ) -> None:
        """The prompts step ``step`` trains on (call before the update)."""
        self._write(
            event="train",
            step=step,
            prompt_ids=list(prompt_ids),
            group_ids=list(group_ids),
            start_weights=list(start_weights),
        )

    def drop(self, step: int, group_id: int, prompt_id: int, reason: str) -> None:
        """A prompt left without being trained on."""
        assert reason in DROP_REASONS, reason
        self._write(event="drop", step=step, group_id=group_id, prompt_id=prompt_id, reason=reason)

    def resume(self, step: int) -> None:
        """The run resumed from ``step``."""
        self._write(event="resume", step=step)

    def _write(self, **line: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Every line of a trace file."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def trained_prompts(path: str | Path) -> dict[int, list[int]]:
    """Step -> the prompt ids it trained on (the last line per step wins, as after a resume)."""
    steps: dict[int, list[int]] = {}
    for line in read_trace(path):
        if line["event"] == "train":
            steps[int(line["step"])] = [int(p) for p in line["prompt_ids"]]
    return dict(sorted(steps.items()))
