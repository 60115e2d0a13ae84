"""The codec of a blob is chosen by what a sample of it compresses to: the float codec keeps
floats unless byte-grouped or plain zstd does clearly better (issue 26: rollout leaves)."""

from __future__ import annotations

import torch

from ckptstore.cas.codec import BGZSTD, FPHUFF, MIN_GAIN, SWITCH_GAIN, ZSTD, encode


def as_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy())


def rollout_logprobs(rows: int, seq_len: int) -> torch.Tensor:
    """fp32 log-probabilities of sampled tokens, a row per sequence: exact zeros where a token
    was sampled at p ~ 1 and over each row's padding (one run at its end), a long negative tail
    elsewhere."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(seq_len // 4, seq_len + 1, (rows,), generator=gen)
    padding = torch.arange(seq_len).unsqueeze(0) >= lengths.unsqueeze(1)
    nll = torch.empty(rows, seq_len).exponential_(3.0, generator=gen)
    nll *= torch.rand(rows, seq_len, generator=gen) < 0.7
    return (-nll).masked_fill(padding, 0.0)


def stored(tensor: torch.Tensor, codec_name: str) -> int:
    for codec in (FPHUFF, BGZSTD, ZSTD):
        if codec.name == codec_name:
            raw = as_view(tensor)
            encoded = codec.encode(
                raw, itemsize=tensor.element_size(), float_like=True, threshold=0
            )
            assert encoded is not None
            return encoded.stored_len
    raise AssertionError(codec_name)


def test_float_leaf_full_of_zeros_goes_where_it_is_smallest() -> None:
    logprobs = rollout_logprobs(512, 2048)
    chosen = encode(as_view(logprobs), itemsize=4, float_like=True, threshold=MIN_GAIN)
    assert chosen.codec is BGZSTD
    # ... and only because it is clearly smaller than the float codec's output
    assert stored(logprobs, "bgzstd") <= stored(logprobs, "fphuff") * (1 - SWITCH_GAIN)
    assert bytes(
        chosen.codec.decode(
            memoryview(b"".join(bytes(p) for p in chosen.payload)),
            logprobs.numel() * 4,
            itemsize=chosen.itemsize,
            params=chosen.params,
            where="test",
        )
    ) == bytes(as_view(logprobs))


def test_float_leaf_of_few_values_goes_to_plain_zstd() -> None:
    gen = torch.Generator().manual_seed(1)
    # group-normalised advantages of 0/1 rewards: a handful of distinct fp32 values
    advantages = torch.tensor([-1.2247, -0.8165, 0.0, 0.8165, 1.2247])[
        torch.randint(0, 5, (1 << 19,), generator=gen)
    ]
    assert encode(as_view(advantages), itemsize=4, float_like=True).codec is ZSTD


def test_weights_stay_with_the_float_codec() -> None:
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        weights = (torch.randn(1 << 20, generator=gen) * 0.02).to(dtype)
        chosen = encode(as_view(weights), itemsize=weights.element_size(), float_like=True)
        assert chosen.codec is FPHUFF, dtype


def test_small_blob_is_encoded_once_by_the_chosen_codec() -> None:
    logprobs = rollout_logprobs(16, 1250)  # 80 KB: the sample is the whole blob
    chosen = encode(as_view(logprobs), itemsize=4, float_like=True)
    assert chosen.codec is BGZSTD
    assert chosen.stored_len == stored(logprobs, "bgzstd")
