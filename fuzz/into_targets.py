"""``run.load(into=...)`` over generated targets: each case either fills every target exactly,
with every byte around them untouched, or refuses before any byte of any target is written.

One checkpoint of a component of tensors of several dtypes and shapes (a scalar and an empty
tensor among them) is saved once. Each case gives some of its entries a target, each a view
into one sentinel-filled arena (so that a write anywhere it should not go shows): contiguous
at some storage offset, transposed, sliced with steps, with random strides (some overlap,
some interleave without overlapping), expanded (stride 0), of the wrong dtype or shape, on the
meta device, overlapping another target, requiring grad, a conjugate view, or not a tensor.

The oracle works out from the views alone (every element's byte address, enumerated) whether
the targets can be filled: each of the stored dtype and shape, in memory, no element sharing
a byte with another element of any target. If not, the load must raise the library's error
naming a target that cannot be, with the arena unchanged. If they can, the load must fill each
exactly and change no other byte -- or refuse, naming a target, with the arena unchanged (the
overlap check may refuse strides that interleave; counted apart).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fuzz.surfaces import Finding

ARENA = 1 << 14
SENTINEL = 0xA5
#: The stored entries (name -> dtype, shape).
ENTRIES: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
    "a": (torch.float32, (4, 6)),
    "b": (torch.bfloat16, (3, 5, 2)),
    "c": (torch.int64, (7,)),
    "d": (torch.uint8, (5, 5)),
    "e": (torch.float64, (2, 3)),
    "f": (torch.complex64, (3, 3)),
    "s": (torch.float32, ()),
    "z": (torch.float32, (0, 4)),
    "h": (torch.float16, (16, 16)),
}
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float64, torch.int8)
KINDS = (
    ("contiguous", 14),
    ("transposed", 6),
    ("sliced", 6),
    ("strided", 10),
    ("expanded", 4),
    ("wrong-dtype", 4),
    ("wrong-shape", 4),
    ("meta", 3),
    ("overlaps-another", 8),
    ("requires-grad", 3),
    ("conj", 2),
    ("not-a-tensor", 2),
)


def _value(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=gen)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def byte_addresses(t: torch.Tensor) -> np.ndarray:
    """The address of every byte of every element of ``t`` (with repeats, if they overlap)."""
    size = t.element_size()
    offsets = np.zeros(1, dtype=np.int64)
    for n, stride in zip(t.shape, t.stride(), strict=True):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * stride).reshape(-1)
    if t.numel() == 0:
        return np.zeros(0, dtype=np.int64)
    starts = t.data_ptr() + offsets * size
    return (starts[:, None] + np.arange(size, dtype=np.int64)[None, :]).reshape(-1)


class IntoEngine:
    """The saved checkpoint, and each case's targets drawn from (seed, case)."""

    time_cap = 20.0

    def __init__(self, workdir: Path, seed: int) -> None:
        from ckptstore.checkpointer import open_run

        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self.saved = {k: _value(d, s, gen) for k, (d, s) in ENTRIES.items()}
        self.run = open_run(
            "into", db=f"sqlite:///{workdir / 'm.db'}", store=workdir / "store", async_save=False
        )
        self.run.save(1, {"m": self.saved})
        self.arena = torch.full((ARENA,), SENTINEL, dtype=torch.uint8)
        self.base = self.arena.data_ptr()
        self._kinds = [k for k, _ in KINDS]
        self._weights = [w for _, w in KINDS]
        self._last: dict[str, Any] = {}

    def close(self) -> None:
        """Close the run."""
        self.run.close()

    def reproducer(self, i: int) -> dict[str, Any]:
        """What case ``i`` gave (regenerated from the seed)."""
        return {"seed": self.seed, "targets": self._last}

    # -- targets -------------------------------------------------------------------------------

    def _view(self, rng: random.Random, dtype: torch.dtype, shape: tuple[int, ...],
              strides: tuple[int, ...] | None = None) -> torch.Tensor:  # fmt: skip
        size = dtype.itemsize
        if strides is None:
            strides = tuple(int(np.prod(shape[k + 1 :])) for k in range(len(shape)))
        span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if n)
        typed = self.arena.view(dtype) if ARENA % size == 0 else self.arena
        limit = typed.numel() - span
        offset = rng.randrange(0, max(1, limit))
        return typed.as_strided(shape, strides, offset)

    def _target(
        self, rng: random.Random, kind: str, name: str, chosen: dict[str, Any]
    ) -> tuple[Any, str]:
        dtype, shape = ENTRIES[name]
        if kind == "transposed" and len(shape) >= 2:
            t = self._view(rng, dtype, tuple(reversed(shape)))
            return t.permute(*reversed(range(len(shape)))), kind
        if kind == "sliced" and shape:
            steps = [rng.choice((1, 2, 3)) for _ in shape]
            big = tuple(n * s for n, s in zip(shape, steps, strict=True))
            t = self._view(rng, dtype, big)
            return t[tuple(slice(None, None, s) for s in steps)], kind
        if kind == "strided" and shape:
            strides = tuple(rng.choice((0, 1, 2, 3, 5, 7, 16, 40)) for _ in shape)
            return self._view(rng, dtype, shape, strides), kind
        if kind == "expanded" and shape:
            t = self._view(rng, dtype, (1, *shape[1:]))
            return t.expand(shape), kind
        if kind == "wrong-dtype":
            other = rng.choice([d for d in DTYPES if d != dtype])
            return self._view(rng, other, shape), kind
        if kind == "wrong-shape":
            other = tuple(max(0, n + rng.choice((-1, 1))) for n in shape) or (1,)
            if other == shape:
                other = (*shape, 1)
            return self._view(rng, dtype, other), kind
        if kind == "meta":
            return torch.empty(shape, dtype=dtype, device="meta"), kind
        if kind == "overlaps-another" and chosen:
            other_name, other = rng.choice(sorted(chosen.items()))
            if isinstance(other, torch.Tensor) and other.device.type == "cpu" and other.numel():
                start = (other.data_ptr() - self.base) // dtype.itemsize
                typed = self.arena.view(dtype)
                n = int(np.prod(shape))
                start = max(0, min(start + rng.randrange(-n, n + 1), typed.numel() - n))
                return typed[start : start + n].view(shape), f"overlaps {other_name}?"
        if kind == "requires-grad" and dtype.is_floating_point:
            t = self._view(rng, dtype, shape)
            return t.requires_grad_(), kind
        if kind == "conj" and dtype.is_complex:
            return self._view(rng, dtype, shape).conj(), kind
        if kind == "not-a-tensor":
            return np.zeros(shape, dtype=np.float32), kind
        return self._view(rng, dtype, shape), "contiguous"

    # -- the oracle ----------------------------------------------------------------------------

    def _unfit(self, name: str, t: Any, others: dict[str, np.ndarray]) -> str | None:
        """Why ``t`` cannot be filled as entry ``name``, or None; records its bytes."""
        dtype, shape = ENTRIES[name]
        if not isinstance(t, torch.Tensor):
            return None  # not a target: into= fills tensors only; the entry loads anew
        if t.dtype != dtype or tuple(t.shape) != shape:
            return "dtype or shape"
        if t.device.type == "meta":
            return "meta"
        addresses = byte_addresses(t)
        if len(np.unique(addresses)) != len(addresses):
            return "overlaps itself"
        for other, theirs in others.items():
            if np.intersect1d(addresses, theirs).size:
                return f"overlaps {other}"
        others[name] = addresses
        return None

    def case(self, i: int) -> str:
        """Load into one set of targets; check the outcome against the oracle."""
        from ckptstore.errors import CkptStoreError

        rng = random.Random(f"{self.seed}/{i}")
        self.arena.fill_(SENTINEL)
        names = rng.sample(sorted(ENTRIES), rng.randint(1, len(ENTRIES)))
        targets: dict[str, Any] = {}
        kinds: dict[str, str] = {}
        for name in names:
            (kind,) = rng.choices(self._kinds, weights=self._weights)
            targets[name], kinds[name] = self._target(rng, kind, name, targets)
        self._last = {
            n: (
                kinds[n],
                (str(t.dtype), list(t.shape), list(t.stride()), t.storage_offset())
                if isinstance(t, torch.Tensor) and t.device.type != "meta"
                else type(t).__name__,
            )
            for n, t in targets.items()
        }
        taken: dict[str, np.ndarray] = {}
        unfit = {n: why for n in names if (why := self._unfit(n, targets[n], taken)) is not None}
        before = self.arena.clone()
        try:
            loaded = self.run.load(1, into={"m": targets})
        except CkptStoreError as exc:
            message = str(exc)
            if not torch.equal(self.arena, before):
                changed = int((self.arena != before).sum())
                raise Finding(
                    "written-then-refused", f"{changed} bytes changed; {message}"
                ) from None
            named = [n for n in targets if repr(n) in message or f"'{n}'" in message]
            if not named:
                raise Finding("refusal-names-no-target", message) from None
            if unfit:
                reasons = {why.split()[0] for why in unfit.values()}
                return "refused: " + "+".join(sorted(reasons))
            return "refused (conservative overlap check)"
        if unfit:
            raise Finding("accepted-unfit", f"loaded although {unfit} ({kinds})")
        state = loaded.state["m"]
        for name, t in targets.items():
            if not isinstance(t, torch.Tensor):
                if not torch.equal(state[name], self.saved[name]) or t.any():
                    raise Finding("wrong-values", f"{name!r}: a non-tensor target changed")
                continue
            if state[name] is not t:
                raise Finding("not-in-place", f"{name!r}: the result is not the given tensor")
            if not torch.equal(t.detach().resolve_conj(), self.saved[name]):
                raise Finding("wrong-values", f"{name!r} ({kinds[name]}) differs from the saved")
        covered = np.concatenate([a - self.base for a in taken.values()] or [np.zeros(0, int)])
        outside = np.ones(ARENA, dtype=bool)
        outside[covered[(covered >= 0) & (covered < ARENA)]] = False
        if not torch.equal(
            self.arena[torch.from_numpy(outside)], before[torch.from_numpy(outside)]
        ):
            raise Finding("wrote-outside", f"bytes outside the targets changed ({kinds})")
        return "filled"


def engine(workdir: Path, seed: int) -> IntoEngine:
    """The family's engine (see :mod:`fuzz.surfaces`)."""
    return IntoEngine(workdir, seed)
