"""The trainer's errors: one root, so ``grpo.main`` maps them to exit codes in one place.

Library code raises these; only ``trainer.grpo.main`` turns them into a message and an exit code
(2 for what the user must change, 1 for a failure at run time).
"""

from __future__ import annotations


class TrainerError(RuntimeError):
    """A trainer problem; the message says what happened and how to fix it."""

    exit_code = 1


class ConfigurationError(TrainerError):
    """A bad configuration value; the message names the dotted key."""

    exit_code = 2


class ResumeError(TrainerError):
    """A saved run cannot be resumed with this configuration (or its checkpoint lacks state)."""

    exit_code = 2


class RolloutError(TrainerError):
    """Rollouts kept failing, so training stopped."""
