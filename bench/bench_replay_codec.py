"""Replay-buffer compression: a TensorDict of RL rollouts through ckptstore's codec choice, against
plain per-leaf zstd-1 and per-leaf byte-grouped zstd, on one thread.

The rollout TensorDict (``--groups`` groups of ``--group-size`` sequences, ``--seq-len`` tokens)
holds what a GRPO replay buffer keeps: token ids (int64, drawn by Zipf's law with exponent 1.2
from a 151,936-token vocabulary, padded after each sequence's end), the sampling and the
reference policy's log-probabilities of those tokens (fp32: mostly near 0 with a long negative
tail, 0 at padding), the loss mask (bool), per-sequence rewards (fp32, 0/1) and advantages
(fp32, group-normalised), and the weight version each sequence was sampled with (int64).

For each leaf: ckptstore's ``codec.encode`` (the codec the writer would pick, at the threshold of
``Compression.ALWAYS``), zstd-1 of the leaf's bytes and byte-grouped zstd-1. Reported: the ratio
(logical bytes / stored bytes) and the encode speed (logical MB/s, one thread) over the whole
TensorDict, and per leaf which codec ckptstore picked. Every encoding is decoded and compared
byte for byte. Goal (issue 26): ckptstore >= 3.5x at >= 500 MB/s, and its ratio >= plain
zstd-1's.

Run: ``.venv/bin/python bench/bench_replay_codec.py [--groups 512] [--reps 3] [--json PATH]``
(``--json`` writes ``make bench``'s rows: the ratio and the speed against plain zstd-1 per leaf,
and byte-grouped zstd's ratio as an "info" row).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptstore.cas import codec
from ckptstore.cas.codecs import Encoded
from ckptstore.serialize.dtypes import byte_view, is_float_like

VOCAB = 151_936
GOAL_RATIO = 3.5
GOAL_MBPS = 500.0


def rollouts(groups: int, group_size: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The leaves of a GRPO rollout TensorDict (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    batch = groups * group_size
    # Zipf's law, as natural-language token frequencies follow (exponent ~1); ids by frequency
    # rank, as BPE vocabularies roughly are
    ranks = np.random.default_rng(seed).zipf(1.2, size=(batch, seq_len))
    tokens = torch.from_numpy(np.minimum(ranks - 1, VOCAB - 1).astype(np.int64))
    lengths = torch.randint(seq_len // 4, seq_len + 1, (batch,), generator=gen)
    mask = torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)
    tokens[~mask] = 151_643  # the pad id
    nll = torch.empty(batch, seq_len).exponential_(3.0, generator=gen)
    nll *= torch.rand(batch, seq_len, generator=gen) < 0.7  # many tokens sampled at p ~ 1
    logprobs = (-nll).masked_fill(~mask, 0.0)
    drift = torch.randn(batch, seq_len, generator=gen) * 0.02
    ref_logprobs = (logprobs + drift).clamp(max=0.0).masked_fill(~mask, 0.0)
    rewards = (torch.rand(batch, generator=gen) < 0.4).to(torch.float32)
    grouped = rewards.view(groups, group_size)
    advantages = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "ref_logprobs": ref_logprobs,
        "loss_mask": mask,
        "rewards": rewards,
        "advantages": advantages.reshape(batch),
        "weight_version": torch.full((batch,), 41, dtype=torch.int64)
        + (torch.rand(batch, generator=gen) < 0.3),
    }


def _zstd(raw: memoryview) -> int:
    return len(zstandard.ZstdCompressor(level=1).compress(raw))


def _bgzstd(raw: memoryview, itemsize: int) -> int:
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(-1, itemsize)
    compressor = zstandard.ZstdCompressor(level=1)
    return sum(len(compressor.compress(planes[:, i].tobytes())) for i in range(itemsize))


def _ckptstore(raw: memoryview, itemsize: int, float_like: bool) -> Encoded:
    threshold = codec.min_gain(codec.Compression.ALWAYS, 0.0)
    return codec.encode(raw, itemsize=itemsize, float_like=float_like, threshold=threshold)


def _round_trips(raw: memoryview, encoded: Encoded) -> bool:
    payload = memoryview(b"".join(bytes(part) for part in encoded.payload))
    decoded = encoded.codec.decode(
        payload, raw.nbytes, itemsize=encoded.itemsize, params=encoded.params, where="bench"
    )
    return bytes(decoded) == bytes(raw)


def _timed(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    samples, result = [], None
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), result


def measure(leaves: dict[str, torch.Tensor], reps: int) -> dict[str, Any]:
    """Each contender's stored bytes and encode seconds over every leaf, and ckptstore's picks."""
    views = {
        name: (memoryview(byte_view(t).numpy()), t.element_size(), is_float_like(t.dtype))
        for name, t in leaves.items()
    }
    logical = sum(view.nbytes for view, _, _ in views.values())
    contenders: dict[str, Callable[[], Any]] = {
        "ckptstore": lambda: {n: _ckptstore(v, i, f) for n, (v, i, f) in views.items()},
        "zstd-1 per leaf": lambda: {n: (_zstd(v), "zstd") for n, (v, _, _) in views.items()},
        "bgzstd-1 per leaf": lambda: {
            n: (_bgzstd(v, i), "bgzstd") for n, (v, i, _) in views.items()
        },
    }
    rows = {}
    for label, fn in contenders.items():
        seconds, per_leaf = _timed(fn, reps)
        if label == "ckptstore":
            for name, encoded in per_leaf.items():
                if not _round_trips(views[name][0], encoded):
                    raise SystemExit(f"ckptstore's encoding of {name} does not round-trip")
            per_leaf = {
                n: (e.stored_len + len(e.params), e.codec.name) for n, e in per_leaf.items()
            }
        stored = sum(size for size, _ in per_leaf.values())
        rows[label] = {
            "ratio": logical / stored,
            "mbps": logical / seconds / 1e6,
            "seconds": seconds,
            "picks": {n: name for n, (_, name) in per_leaf.items()},
            "leaf_ratio": {n: views[n][0].nbytes / size for n, (size, _) in per_leaf.items()},
        }
    return {"logical_bytes": logical, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write make bench's rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    leaves = rollouts(args.groups, args.group_size, args.seq_len)
    result = measure(leaves, args.reps)
    print(f"rollout TensorDict: {result['logical_bytes'] / 1e6:.0f} MB, one thread")
    print(f"{'contender':20} {'ratio':>7} {'MB/s':>8}  per leaf (codec: ratio)")
    for label, row in result["rows"].items():
        picks = ", ".join(f"{n} {row['picks'][n]}:{row['leaf_ratio'][n]:.2f}" for n in leaves)
        print(f"{label:20} {row['ratio']:7.2f} {row['mbps']:8.0f}  {picks}")
    ours = result["rows"]["ckptstore"]
    met = ours["ratio"] >= GOAL_RATIO and ours["mbps"] >= GOAL_MBPS
    print(
        f"goal >= {GOAL_RATIO}x at >= {GOAL_MBPS:.0f} MB/s: "
        f"{ours['ratio']:.2f}x at {ours['mbps']:.0f} MB/s -> {'met' if met else 'NOT met'}"
    )
    if args.json:
        args.json.write_text(json.dumps(suite_rows(result), indent=2) + "\n")
    return 0


def suite_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """``make bench``'s rows (see ``bench/suite.py``)."""
    ours, zstd, bgzstd = (
        result["rows"][k] for k in ("ckptstore", "zstd-1 per leaf", "bgzstd-1 per leaf")
    )
    common = {"peer": "zstd-1 per leaf"}
    return [
        common
        | {
            "work": "rollout TensorDict compression ratio (1 thread)",
            "ours": ours["ratio"],
            "peer_value": zstd["ratio"],
            "unit": "x",
            "ratio": ours["ratio"] / zstd["ratio"],
            "goal": f">= {GOAL_RATIO}x, >= peer",
            "met": ours["ratio"] >= max(GOAL_RATIO, zstd["ratio"]),
        },
        common
        | {
            "work": "rollout TensorDict encode speed (1 thread)",
            "ours": ours["mbps"],
            "peer_value": zstd["mbps"],
            "unit": "MB/s",
            "ratio": ours["mbps"] / zstd["mbps"],
            "goal": f">= {GOAL_MBPS:.0f} MB/s",
            "met": ours["mbps"] >= GOAL_MBPS,
        },
        {
            "work": "rollout TensorDict ratio, bgzstd-1 on every leaf",
            "ours": ours["ratio"],
            "peer": "bgzstd-1 per leaf",
            "peer_value": bgzstd["ratio"],
            "unit": "x",
            "ratio": ours["ratio"] / bgzstd["ratio"],
            "goal": "info",
            "met": None,
        },
    ]


if __name__ == "__main__":
    sys.exit(main())
