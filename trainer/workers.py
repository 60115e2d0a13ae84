"""The workers: rollout workers sample answers; the policy worker trains and saves its shards.

Both are plain classes. ``trainer.actors`` runs them as Ray actors (or in-process for the local
backend); the controller calls them the same way either way: ``await worker.method.remote(...)``.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer import ShardReceipt, ShardWriter
from trainer.policy import (
    Policy,
    PolicyConfig,
    answer_logprobs,
    generate,
    group_advantages,
    grpo_loss,
)
from trainer.task import reward


def policy_config(cfg: dict[str, Any]) -> PolicyConfig:
    p = cfg["policy"]
    return PolicyConfig(
        num_digits=int(cfg["task"]["num_digits"]),
        d_model=int(p["d_model"]),
        n_layers=int(p["n_layers"]),
        n_heads=int(p["n_heads"]),
    )


class RolloutWorker:
    """Generates ``num_generations_per_prompt`` answers per prompt with a given weight version."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        torch.set_num_threads(1)
        self.cfg = cfg
        self.model = Policy(policy_config(cfg)).eval()
        self.version = -1

    def set_weights(self, version: int, weights: dict[str, torch.Tensor]) -> int:
        self.model.load_state_dict(weights)
        self.version = version
        return version

    def generate(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One result per request ``{group_id, digits}``; sampling is seeded by the group id."""
        group_size = int(self.cfg["grpo"]["num_generations_per_prompt"])
        temperature = float(self.cfg["grpo"]["temperature"])
        results = []
        for request in requests:
            group_id = int(request["group_id"])
            digits = torch.tensor([request["digits"]], dtype=torch.int64)
            generator = torch.Generator().manual_seed(int(self.cfg["seed"]) * 1_000_003 + group_id)
            tokens, logprobs = generate(
                self.model, digits, samples=group_size, temperature=temperature, generator=generator
            )
            n = digits.shape[1]
            rewards = reward(digits.expand(group_size, -1), tokens[:, -n:])
            payload = TensorDict(
                {
                    "tokens": tokens,
                    "logprobs": logprobs,
                    "rewards": rewards,
                    "weight_version": torch.full((group_size,), self.version, dtype=torch.int64),
                },
                batch_size=[group_size],
            )
            results.append(
                {
                    "group_id": group_id,
                    "sample_ids": [group_id * group_size + i for i in range(group_size)],
                    "seq_lens": [int(tokens.shape[1])] * group_size,
                    "weight_versions": [self.version] * group_size,
                    "payload": payload,
                }
            )
        return results


class PolicyWorker:
    """Owns the model, the optimizer and the frozen reference; trains; uploads its own shards."""

    def __init__(
        self, cfg: dict[str, Any], base_weights: dict[str, torch.Tensor], store: str | None
    ) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(int(cfg["seed"]))
        self.cfg = cfg
        config = policy_config(cfg)
        self.model = Policy(config)
        self.model.load_state_dict(base_weights)
        self.reference = Policy(config).eval().requires_grad_(False)
        self.reference.load_state_dict(base_weights)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=float(cfg["policy"]["lr"]))
        # Small writes, no packs for the optimizer moments: each tensor dedups on its own.
        self.shards = ShardWriter(store, options=WriterOptions()) if store is not None else None

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def train_step(self, batch: TensorDict) -> dict[str, float]:
        g = int(self.cfg["grpo"]["num_generations_per_prompt"])
        n = int(self.cfg["task"]["num_digits"])
        tokens = batch["tokens"]
        advantages = group_advantages(batch["rewards"], g)
        with torch.no_grad():
            ref = answer_logprobs(self.reference, tokens, n)
        self.model.train()
        logprobs = answer_logprobs(self.model, tokens, n)
        loss, stats = grpo_loss(
            logprobs,
            batch["logprobs"],
            ref,
            advantages,
            clip_eps=float(self.cfg["grpo"]["clip_eps"]),
            kl_coef=float(self.cfg["grpo"]["kl_coef"]),
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return {
            "loss": loss.item(),
            "grad_norm": float(grad_norm),
            "tokens": int(tokens.shape[0] * n),
            **stats,
        }

    def save_shards(self, save_optimizer: bool) -> list[ShardReceipt]:
        """Upload this worker's checkpoint shards; the controller commits the receipts."""
        if self.shards is None:
            raise RuntimeError("this policy worker was started without a checkpoint store")
        receipts = [self.shards.write("policy", self.model.state_dict(), kind="policy")]
        if save_optimizer:
            receipts.append(
                self.shards.write("optimizer", self.optimizer.state_dict(), kind="optimizer")
            )
        return receipts

    def load(self, policy: dict[str, torch.Tensor], optimizer: dict[str, Any] | None) -> bool:
        """Restore saved weights (and optimizer); False, changing nothing, if shapes differ."""
        own = self.model.state_dict()
        if set(policy) != set(own) or any(policy[k].shape != own[k].shape for k in own):
            return False
        self.model.load_state_dict(policy)
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
        return True

    def close(self) -> None:
        if self.shards is not None:
            self.shards.close()
