"""The policy: a small causal transformer, sampling, log-probabilities and the GRPO loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.task import NUM_DIGITS_VOCAB, VOCAB_SIZE, prompt_tokens, target


@dataclass(frozen=True)
class PolicyConfig:
    num_digits: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4

    @property
    def max_len(self) -> int:
        return 2 * self.num_digits + 2


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        hq, hk, hv = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(hq, hk, hv, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, length, width))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class Policy(nn.Module):
    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(VOCAB_SIZE, config.d_model)
        self.pos = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(
            Block(config.d_model, config.n_heads) for _ in range(config.n_layers)
        )
        self.ln = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, VOCAB_SIZE)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def _digit_logprobs(logits: torch.Tensor) -> torch.Tensor:
    # Answers are digits only: the distribution is over the ten digit tokens.
    return F.log_softmax(logits[..., :NUM_DIGITS_VOCAB].float(), dim=-1)


@torch.no_grad()
def generate(
    model: Policy,
    digits: torch.Tensor,
    *,
    samples: int,
    temperature: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` answers per prompt: tokens ``[B*samples, 2n+2]``, their log-probs ``[.., n]``."""
    prompts = prompt_tokens(digits).repeat_interleave(samples, dim=0)
    n = digits.shape[1]
    tokens = prompts
    logprobs = []
    for _ in range(n):
        logp = _digit_logprobs(model(tokens)[:, -1] / temperature)
        choice = torch.multinomial(logp.exp(), 1, generator=generator)
        logprobs.append(logp.gather(-1, choice))
        tokens = torch.cat([tokens, choice], dim=1)
    return tokens, torch.cat(logprobs, dim=1)


def answer_logprobs(model: Policy, tokens: torch.Tensor, num_digits: int) -> torch.Tensor:
    """Log-probs ``[B, n]`` of the answer part of ``tokens`` under ``model``."""
    logits = model(tokens[:, :-1])[:, -num_digits:]
    answer = tokens[:, -num_digits:]
    return _digit_logprobs(logits).gather(-1, answer.unsqueeze(-1)).squeeze(-1)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float,
    kl_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with a k3 KL penalty to the reference, per answer token."""
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(-1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    log_ref_ratio = ref_logprobs - logprobs
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
    loss = (-surrogate + kl_coef * kl).mean()
    clipped = ((ratio - 1).abs() > clip_eps).float().mean()
    return loss, {"kl": kl.mean().item(), "clip_frac": clipped.item()}


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group-normalised advantages: (r - mean) / (std + eps) within each prompt's samples."""
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)
    return ((grouped - mean) / (std + 1e-4)).reshape(-1)


def supervised_warmup(
    model: Policy, *, steps: int, batch_size: int, lr: float, seed: int
) -> list[float]:
    """Teacher-forced training on the task (the base model GRPO starts from); returns losses."""
    generator = torch.Generator().manual_seed(seed + 7919)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    n = model.config.num_digits
    losses = []
    for _ in range(steps):
        digits = torch.randint(0, NUM_DIGITS_VOCAB, (batch_size, n), generator=generator)
        tokens = torch.cat([prompt_tokens(digits), target(digits)], dim=1)
        logits = model(tokens[:, :-1])[:, -n:]
        loss = F.cross_entropy(
            logits[..., :NUM_DIGITS_VOCAB].reshape(-1, NUM_DIGITS_VOCAB), tokens[:, -n:].reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses
