"""A custom sampler that fails with a plain Python error once step 3 is trained: an
unexpected failure (not a TrainerError or ckptstore error) for test_trainer_failures."""

from __future__ import annotations

from trainer.replay import Group
from trainer.samplers import WindowedSampler


class FailAfterTwoSaves(WindowedSampler):
    """The windowed sampler, until it is asked for the groups of step 4."""

    name = "fail-after-two-saves"

    def select(self, ready: list[Group], trainer_version: int, count: int) -> list[Group]:
        """Raise at version 3 (step 4 would follow)."""
        if trainer_version >= 3:
            raise RuntimeError("sampler bug at version 3\nsecond line of the message")
        return super().select(ready, trainer_version, count)
