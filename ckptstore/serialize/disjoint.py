"""That a load's target tensors (``into``) share no byte of memory with each other.

Two targets that overlap (two views of one buffer, the same tensor given for two entries)
cannot both be filled: whichever is written last wins, and the other holds bytes that are not
its entry's. The load refuses them before anything is read, naming both entries.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ckptstore.errors import ConfigError

#: Up to this many elements per tensor, interleaved views (columns of one matrix) are told
#: apart element by element; beyond it, two targets whose spans cross are refused.
EXACT_LIMIT = 1 << 22


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The first and one past the last byte address ``tensor``'s elements reach."""
    last = sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride(), strict=True))
    start = tensor.data_ptr()
    return start, start + (last + 1) * tensor.element_size()


def _byte_addresses(tensor: torch.Tensor) -> np.ndarray:
    """Every byte address of ``tensor``'s elements, sorted."""
    offsets = np.zeros(1, dtype=np.int64)
    for n, stride in zip(tensor.shape, tensor.stride(), strict=True):
        steps = np.arange(n, dtype=np.int64) * stride
        offsets = (offsets[:, None] + steps[None, :]).reshape(-1)
    size = tensor.element_size()
    starts = tensor.data_ptr() + offsets * size
    return np.sort((starts[:, None] + np.arange(size, dtype=np.int64)[None, :]).reshape(-1))


def _share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose spans cross have a byte in common (conservatively True for
    large non-contiguous ones)."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    if a.numel() > EXACT_LIMIT or b.numel() > EXACT_LIMIT:
        return True
    return bool(np.intersect1d(_byte_addresses(a), _byte_addresses(b)).size)


def check_disjoint(targets: Iterable[tuple[str, str, torch.Tensor]]) -> None:
    """Refuse (``ConfigError``) two of ``targets`` -- (where, entry path, tensor) -- that share
    memory; tensors on the meta device and empty ones hold no memory and are skipped."""
    spans = sorted(
        (
            (str(t.device), *_span(t), where, path, t)
            for where, path, t in targets
            if t.device.type != "meta" and t.numel() > 0
        ),
        key=lambda span: (span[0], span[1]),
    )
    for i, (device, _, end, where, path, tensor) in enumerate(spans):
        for other_device, start, _, other_where, other_path, other in spans[i + 1 :]:
            if other_device != device or start >= end:
                break
            if _share_bytes(tensor, other):
                place = "" if other_where == where else f" ({where})"
                raise ConfigError(
                    f"{other_where}: cannot load entry {other_path!r} into the given tensor: "
                    f"it shares memory with the target of entry {path!r}{place}, so one "
                    "would overwrite the other; pass tensors that do not overlap (e.g. "
                    ".clone() one), or leave one out of into="
                )


def cannot_hold(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot take a value element by element, or None: it lives on the meta
    device (no memory), or its elements may overlap in memory (an expanded, stride-0 view, or
    strides that reach one address twice; the check is conservative: each stride must pass
    the extent of the smaller ones, as a view of one tensor's memory does): writing it would
    lose elements, and torch refuses only once the other targets are written."""
    if tensor.device.type == "meta":
        return "it is on the meta device (it has no memory to load into)"
    extent = 0  # the furthest element offset the smaller strides reach
    for size, stride in sorted(
        ((size, abs(stride)) for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
         if size > 1),
        key=lambda pair: pair[1],
    ):  # fmt: skip
        if stride <= extent:
            return (
                f"its elements overlap in memory (strides {list(tensor.stride())}, e.g. an "
                "expanded view)"
            )
        extent += (size - 1) * stride
    return None


def check_targets(where: str, targets: dict[str, torch.Tensor]) -> None:
    """Refuse (``ConfigError``, naming the entry) a target that cannot take its elements --
    on the meta device, or its elements overlapping in memory (an expanded view) -- or two
    that share memory: for loads whose writes a library other than this one plans (DCP's)."""
    for path, tensor in targets.items():
        unfit = cannot_hold(tensor)
        if unfit:
            raise ConfigError(
                f"{where}: cannot load entry {path!r} into the given tensor: {unfit}; pass a "
                "tensor that owns its elements (e.g. .clone()), or leave it out of the state"
            )
    check_disjoint((where, path, tensor) for path, tensor in targets.items())
