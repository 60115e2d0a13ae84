"""The quick probe before the codec trials (ckptstore/cas/codec.py): on a local disk, where a
blob must shrink by half to be worth compressing, weights are stored raw after a probe a
quarter the size of the full sample, and data that does shrink that much still gets its codec."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckptstore.cas import codec, codecs
from ckptstore.objectstore import LocalStore

LOCAL_DISK = codec.min_gain(codec.Compression.AUTO, LocalStore.write_bandwidth_hint)


class Recording:
    """A registered codec that records the size of everything it is offered."""

    def __init__(self, inner: codecs.Codec, offered: list[tuple[str, int]]) -> None:
        self.inner, self.offered = inner, offered
        self.id, self.name = inner.id, inner.name

    def encode(self, raw: memoryview, **kwargs: Any) -> codecs.Encoded | None:
        self.offered.append((self.name, raw.nbytes))
        return self.inner.encode(raw, **kwargs)


@pytest.fixture
def offered(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    sizes: list[tuple[str, int]] = []
    wrapped = [c if c is codec.RAW else Recording(c, sizes) for c in codecs.registered()]
    monkeypatch.setattr(codecs, "registered", lambda: wrapped)
    return sizes


def as_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy())


def test_weights_on_a_local_disk_are_stored_raw_after_the_quick_probe_alone(
    offered: list[tuple[str, int]],
) -> None:
    assert LOCAL_DISK > codec.QUICK_MARGIN
    weights = (torch.randn(1 << 22) * 0.02).bfloat16()  # 8 MiB
    chosen = codec.encode(as_view(weights), itemsize=2, float_like=True, threshold=LOCAL_DISK)
    assert chosen.codec is codec.RAW
    quick = 3 * (16 << 10)
    assert offered
    assert all(size == quick for _, size in offered)  # never the full sample, never the blob


def test_data_that_shrinks_enough_is_still_compressed_on_a_local_disk(
    offered: list[tuple[str, int]],
) -> None:
    gen = torch.Generator().manual_seed(1)
    advantages = torch.tensor([-1.2247, -0.8165, 0.0, 0.8165, 1.2247])[
        torch.randint(0, 5, (1 << 21,), generator=gen)
    ]
    raw = as_view(advantages)
    chosen = codec.encode(raw, itemsize=4, float_like=True, threshold=LOCAL_DISK)
    assert chosen.codec is codec.ZSTD
    assert chosen.stored_len <= raw.nbytes * (1 - LOCAL_DISK)
    assert max(size for _, size in offered) == raw.nbytes  # the chosen codec took the whole


def test_a_low_threshold_goes_straight_to_the_full_trials(
    offered: list[tuple[str, int]],
) -> None:
    weights = (torch.randn(1 << 22) * 0.02).bfloat16()
    chosen = codec.encode(as_view(weights), itemsize=2, float_like=True, threshold=codec.MIN_GAIN)
    assert chosen.codec is codec.FPHUFF
    assert min(size for _, size in offered) == 3 * (64 << 10)
