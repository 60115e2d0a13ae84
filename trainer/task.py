"""The task: reverse a string of digits. The reward is verifiable, per position.

A prompt is ``BOS d1 .. dn SEP``; the policy answers with n digits; the reward is the fraction of
positions that match the reversed prompt. A small transformer learns it on CPU in minutes, and a
partially trained one leaves GRPO plenty of reward to gain.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.utils.data import Dataset

NUM_DIGITS_VOCAB = 10
BOS = 10
SEP = 11
VOCAB_SIZE = 12


def prompt_tokens(digits: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` digits -> ``[B, n + 2]`` prompt tokens."""
    batch = digits.shape[0]
    bos = torch.full((batch, 1), BOS, dtype=torch.int64)
    sep = torch.full((batch, 1), SEP, dtype=torch.int64)
    return torch.cat([bos, digits.to(torch.int64), sep], dim=1)


def target(digits: torch.Tensor) -> torch.Tensor:
    return digits.to(torch.int64).flip(-1)


def reward(digits: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """Per-sample reward in [0, 1]: the fraction of positions answered correctly."""
    return (completion == target(digits)).to(torch.float32).mean(dim=-1)


class PromptDataset(Dataset[dict[str, Any]]):
    """``num_prompts`` digit strings, a deterministic function of (name, seed); items carry ids."""

    def __init__(self, name: str, num_prompts: int, num_digits: int, seed: int) -> None:
        self.name = name
        key = hashlib.sha256(f"{name}/{seed}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
        self.digits = torch.randint(
            0, NUM_DIGITS_VOCAB, (num_prompts, num_digits), generator=generator
        )

    def __len__(self) -> int:
        return int(self.digits.shape[0])

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"prompt_id": index, "digits": self.digits[index]}
