"""The workers: rollout workers sample answers; the policy worker trains and saves its shards.

Both are plain classes. ``trainer.actors`` runs them as Ray actors (or in-process for the local
backend); the controller calls them the same way either way: ``await worker.method.remote(...)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from ckptstore import ShardReceipt, ShardSave, ShardWriter, WriterOptions
from ckptstore.extending import ObjectStore, TierConfig, writer_store
from ckptstore.integrations import dcp as ckpt_dcp
from trainer.config import TrainerConfig
from trainer.policy import (
    Policy,
    PolicyConfig,
    answer_logprobs,
    generate,
    group_advantages,
    grpo_loss,
)
from trainer.policy_state import TierSources, by_name, load_sharded, whole_fits
from trainer.replay import Rollout
from trainer.task import reward
from trainer.tiering import check_nonce, on_this_node, tier_node


@dataclass(frozen=True, kw_only=True)
class RolloutRequest:
    """A prompt to generate a group for."""

    group_id: int
    digits: list[int]


@dataclass(frozen=True, kw_only=True)
class TrainStats:
    """What one train step reports."""

    loss: float
    grad_norm: float
    #: Answer tokens trained on.
    tokens: int
    #: Mean k3 KL to the reference, per answer token.
    kl: float
    #: Fraction of answer tokens whose ratio was clipped.
    clip_frac: float


def grpo_objective(
    cfg: TrainerConfig, model: Policy, reference: Policy, batch: TensorDict
) -> tuple[torch.Tensor, TrainStats]:
    """The GRPO loss of ``batch`` (whole groups, in order) and its stats (grad_norm still 0)."""
    g = cfg.grpo.num_generations_per_prompt
    n = cfg.task.num_digits
    tokens = batch["tokens"]
    advantages = group_advantages(batch["rewards"], g)
    with torch.no_grad():
        ref = answer_logprobs(reference, tokens, n)
    logprobs = answer_logprobs(model, tokens, n)
    loss, stats = grpo_loss(
        logprobs,
        batch["logprobs"],
        ref,
        advantages,
        clip_eps=cfg.grpo.clip_eps,
        kl_coef=cfg.grpo.kl_coef,
    )
    summary = TrainStats(
        loss=loss.item(),
        grad_norm=0.0,
        tokens=int(tokens.shape[0] * n),
        kl=stats["kl"],
        clip_frac=stats["clip_frac"],
    )
    return loss, summary


def policy_config(cfg: TrainerConfig) -> PolicyConfig:
    """The model's shape from the config."""
    return PolicyConfig(
        num_digits=cfg.task.num_digits,
        d_model=cfg.policy.d_model,
        n_layers=cfg.policy.n_layers,
        n_heads=cfg.policy.n_heads,
    )


class RolloutWorker:
    """Generates ``num_generations_per_prompt`` answers per prompt with a given weight version."""

    def __init__(self, cfg: TrainerConfig) -> None:
        torch.set_num_threads(1)
        self.cfg = cfg
        self.model = Policy(policy_config(cfg)).eval()
        self.version = -1

    def set_weights(self, version: int, weights: dict[str, torch.Tensor]) -> int:
        self.model.load_state_dict(weights)
        self.version = version
        return version

    def generate(self, requests: list[RolloutRequest]) -> list[Rollout]:
        """One group per request; sampling is seeded by the group id."""
        group_size = self.cfg.grpo.num_generations_per_prompt
        temperature = self.cfg.grpo.temperature
        results = []
        for request in requests:
            group_id = request.group_id
            digits = torch.tensor([request.digits], dtype=torch.int64)
            generator = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + group_id)
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
                Rollout(
                    group_id=group_id,
                    sample_ids=[group_id * group_size + i for i in range(group_size)],
                    seq_lens=[int(tokens.shape[1])] * group_size,
                    weight_versions=[self.version] * group_size,
                    payload=payload,
                )
            )
        return results


class PolicyWorker:
    """Owns the model, the optimizer and the frozen reference; trains; uploads its own shards."""

    def __init__(
        self, cfg: TrainerConfig, base_weights: dict[str, torch.Tensor], store: str | None
    ) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        config = policy_config(cfg)
        self.model = Policy(config)
        self.model.load_state_dict(base_weights)
        self.reference = Policy(config).eval().requires_grad_(False)
        self.reference.load_state_dict(base_weights)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.policy.lr)
        self.store = store
        self.shards = ShardWriter(store, options=WriterOptions()) if store is not None else None
        self._save: ShardSave | None = None
        #: The node-local tiers saves go through (use_tiers), else the store.
        self.tiers: TierConfig | None = None
        self._tier_store: ObjectStore | None = None

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def whole_state(self) -> dict[str, Any]:
        """The model and optimizer state keyed by name (as a sharded policy's ``whole_state``)."""
        return {
            "model": self.model.state_dict(),
            "optim": by_name(self.model, self.optimizer.state_dict()),
        }

    def train_step(self, batch: TensorDict) -> TrainStats:
        """One GRPO step on ``batch`` (whole groups, in order)."""
        self.model.train()
        loss, stats = grpo_objective(self.cfg, self.model, self.reference, batch)
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return dataclasses.replace(stats, grad_norm=float(grad_norm))

    def snapshot_shards(self, save_optimizer: bool) -> None:
        """Snapshot the policy (and optimizer) shards and start uploading them in the
        background. Training goes on meanwhile; the controller collects the receipts (which
        carry the snapshot's and the upload's seconds) with :meth:`shard_receipts`."""
        if self.shards is None:
            raise RuntimeError("this policy worker was started without a checkpoint store")
        components: dict[str, Any] = {"policy": self.model.state_dict()}
        kinds = {"policy": "policy"}
        if save_optimizer:
            components["optimizer"] = self.optimizer.state_dict()
            kinds["optimizer"] = "optimizer"
        # One save in flight: a previous upload that was never collected is waited for here.
        self._save = self.shards.save(components, kinds=kinds)

    def shard_receipts(self, wait: bool) -> list[ShardReceipt] | None:
        """The receipts of the last snapshot's uploads (None if ``wait`` is false and they are
        still uploading); raises the upload's error."""
        save = self._save
        if save is None:
            raise RuntimeError("shard_receipts() without a snapshot_shards() first")
        if not wait and not save.done():
            return None
        self._save = None
        return save.receipts()

    def tier_node(self) -> tuple[str, str | None]:
        """This worker's node: its tier name, and its Ray node id (None off Ray)."""
        return tier_node()

    def use_tiers(self, tiers: TierConfig) -> None:
        """Save through the node-local tiers from now on (this worker's node, its peers)."""
        if self.shards is not None:
            self.shards.close()
        self.tiers = on_this_node(tiers)
        self._tier_store = writer_store(self.tiers)
        self.shards = ShardWriter(self._tier_store, options=WriterOptions())

    def check_store(self, key: str, nonce: str) -> None:
        """The controller's nonce is in the store as this worker sees it (a shared store)."""
        assert self.store is not None
        check_nonce(self.store, key, nonce)

    def load(self, policy: dict[str, torch.Tensor], optimizer: dict[str, Any] | None) -> bool:
        """Restore saved weights (and optimizer); False, changing nothing, if shapes differ."""
        if not whole_fits(self.model, policy):
            return False
        self.model.load_state_dict(policy)
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
        return True

    def load_sharded(
        self, plan: ckpt_dcp.LoadPlan, with_optimizer: bool, sources: TierSources | None = None
    ) -> dict[str, int]:
        """Restore a policy saved sharded by N workers (``policy.num_workers`` > 1), gathered
        into this one worker by DCP (with ``sources``: from the nearest tier copies)."""
        assert self.store is not None
        tiers = on_this_node(self.tiers) if self.tiers is not None else None
        return load_sharded(
            self.model, self.optimizer, plan, with_optimizer, self.store, tiers, sources
        )

    def close(self) -> None:
        if self.shards is not None:
            self.shards.close()
        if self._tier_store is not None:
            self._tier_store.close()
