"""Prompt batches in an order that is a pure function of (seed, epoch), resumable at any point.

torchdata's ``StatefulDataLoader(shuffle=True, generator=g)`` cannot give that (issue #12): one
generator feeds both its ``RandomSampler`` (a ``randperm`` each time a sampler iterator is built,
including the throw-away ones built while a state is loaded) and every ``DataLoader`` iterator's
base seed, while the saved state only holds the generator state from the start of the current
epoch. A restored loader therefore reaches the next epoch with a different generator state and
draws a different permutation.

Here the loader gets an :class:`EpochSampler` instead: epoch ``e``'s order is ``randperm`` under a
generator seeded from a hash of ``f"{seed}/{e}"``, and the sampler's state (seed, dataset size,
epoch, position) rides in the loader's own ``state_dict`` (torchdata's batch-sampler iterator
saves a sampler's state when the sampler has ``state_dict``/``load_state_dict``, and then restores
it instead of fast-forwarding). :class:`PromptStream` turns the loader into the trainer's source
of batches: it moves to the next epoch itself (the sampler's epoch is the stream's: one number,
saved once) and its state, the loader's, is plain JSON values, which ckptstore stores as they are.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

#: Where ``StatefulDataLoader.state_dict()`` keeps the batch-sampler iterator's state, and where
#: that keeps the index sampler's (torchdata 0.11, single-process loader).
_LOADER_SAMPLER_ITER = "_sampler_iter_state"
_BATCH_SAMPLER_STATE = "sampler_state"
_LOADER_FINISHED = "_iterator_finished"


@functools.cache
def _loader_state_keys() -> frozenset[str]:
    """The keys of a single-process ``StatefulDataLoader`` state in this torchdata version."""
    loader = StatefulDataLoader([0], batch_size=1, generator=torch.Generator())
    return frozenset(loader.state_dict())


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of ``epoch``'s permutation: a stable hash of ``f"{seed}/{epoch}"``."""
    digest = hashlib.sha256(f"{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def epoch_permutation(num_items: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch ``epoch`` visits indices ``0..num_items-1``."""
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_items, generator=generator).tolist()


# A malformed checkpoint state is a bad *value* for the caller: ValueError throughout (TRY004).
def _int_field(state: Mapping[str, Any], key: str, where: str, low: int = 0) -> int:
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        shown = "missing" if key not in state else f"{value!r} ({type(value).__name__})"
        raise ValueError(f"{where}: {key!r} must be an int, got {shown}")  # noqa: TRY004
    if value < low:
        raise ValueError(f"{where}: {key!r} must be >= {low}, got {value}")
    return value


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        shown = "None" if value is None else type(value).__name__
        raise ValueError(f"{where} must be a dict, got {shown}")  # noqa: TRY004
    return value


class EpochSampler(Sampler[int]):
    """Indices of a map-style dataset in an order that is a pure function of (seed, epoch).

    Stateful: ``state_dict()`` is the seed, the dataset size, the epoch and how many indices of
    that epoch were yielded; after ``load_state_dict`` the next iteration continues from there.
    Any other iteration starts the epoch from its beginning. ``set_epoch`` picks the epoch.
    """

    def __init__(self, data_source: Sized, seed: int, epoch: int = 0) -> None:
        self.data_source = data_source
        self.seed = int(seed)
        self.epoch = int(epoch)
        #: Indices of the current epoch yielded so far (or to skip, after a load).
        self.yielded = 0
        self._resume = False

    def __len__(self) -> int:
        return len(self.data_source)

    def __iter__(self) -> Iterator[int]:
        # A generator: nothing runs until the first next(), so the iterators torchdata builds
        # and throws away while it loads a state never consume the pending resume position.
        start = self.yielded if self._resume else 0
        self._resume = False
        self.yielded = start
        for index in epoch_permutation(len(self), self.seed, self.epoch)[start:]:
            self.yielded += 1
            yield index

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration visit ``epoch``'s permutation from its beginning."""
        self.epoch = int(epoch)
        self.yielded = 0
        self._resume = False

    def state_dict(self) -> dict[str, int]:
        """Seed, dataset size, epoch and position in the epoch (plain ints)."""
        return {
            "seed": self.seed,
            "num_items": len(self),
            "epoch": self.epoch,
            "yielded": self.yielded,
        }

    def check_state(self, state: Any, where: str = "sampler state") -> dict[str, int]:
        """``state`` as plain ints if this sampler can resume from it, else ``ValueError``."""
        state = _mapping(state, where)
        checked = {
            "seed": _int_field(state, "seed", where, low=-(2**63)),
            "num_items": _int_field(state, "num_items", where),
            "epoch": _int_field(state, "epoch", where),
            "yielded": _int_field(state, "yielded", where),
        }
        if checked["seed"] != self.seed:
            raise ValueError(
                f"{where}: saved with seed {checked['seed']}, but this sampler's seed is "
                f"{self.seed}; the rest of that epoch would not be a permutation"
            )
        if checked["num_items"] != len(self):
            raise ValueError(
                f"{where}: saved over {checked['num_items']} items, but the dataset has "
                f"{len(self)}; the data changed, so start the data order fresh"
            )
        if checked["yielded"] > checked["num_items"]:
            raise ValueError(
                f"{where}: 'yielded' is {checked['yielded']}, more than the "
                f"{checked['num_items']} items of an epoch"
            )
        return checked

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from a ``state_dict()``: same epoch, the next not-yet-yielded index."""
        checked = self.check_state(state_dict)
        self.epoch = checked["epoch"]
        self.yielded = checked["yielded"]
        self._resume = True


class PromptStream:
    """The trainer's source of prompt batches: epochs, a (seed, epoch)-determined order, and a
    state that resumes the identical sequence."""

    def __init__(
        self, dataset: Dataset[Mapping[str, Any]], batch_size: int, seed: int, max_epochs: int
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(max_epochs, bool) or not isinstance(max_epochs, int) or max_epochs < 0:
            raise ValueError(f"max_epochs must be an int >= 0, got {max_epochs!r}")
        if not isinstance(dataset, Sized):
            raise TypeError("the dataset must be map-style, with a length")
        if len(dataset) < batch_size:
            raise ValueError(
                f"the dataset has {len(dataset)} items, fewer than one batch of {batch_size} "
                "(the last partial batch of an epoch is dropped, so no batch would ever come)"
            )
        self.batch_size = batch_size
        self.seed = int(seed)
        self.max_epochs = max_epochs
        self.sampler = EpochSampler(dataset, self.seed)
        # The loader's own generator only seeds DataLoader iterators (worker seeds, unused with
        # no workers); a private one keeps iter(loader) from drawing on torch's global RNG.
        self.loader = StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=True,
            num_workers=0,
            generator=torch.Generator().manual_seed(self.seed),
        )
        self._iter: Iterator[Any] | None = None

    @property
    def epoch(self) -> int:
        """Completed passes over the data (0 during the first): the sampler's epoch."""
        return self.sampler.epoch

    def next_batch(self) -> torch.Tensor | None:
        """The next batch's prompt ids (int64), or None once ``max_epochs`` passes are done."""
        while self.epoch < self.max_epochs:
            if self._iter is None:
                self._iter = iter(self.loader)
            try:
                batch = next(self._iter)
            except StopIteration:
                self._iter = None
                # Also after the last epoch, so a saved state always names the epoch to run
                # next; then resuming with a larger max_epochs just carries on.
                self.sampler.set_epoch(self.epoch + 1)
                continue
            return torch.as_tensor(batch["prompt_id"], dtype=torch.int64)
        return None

    def state_dict(self) -> dict[str, Any]:
        """The loader's state, the sampler's (seed, epoch, position) inside: JSON values only
        (ckptstore stores it as is)."""
        state: dict[str, Any] = self.loader.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` left off; ValueError if malformed or of another seed/dataset.
        A state of the earlier layout (``{"epoch", "dataloader"}``: the stream's epoch saved
        beside the sampler's own) is read too, once its two epochs are found to agree."""
        self.loader.load_state_dict(self._check_loader_state(_current_layout(state)))
        # Apply it now (torchdata would on the next iter()), so the sampler holds the position
        # and the epoch.
        self._iter = iter(self.loader)

    def _check_loader_state(self, value: Any) -> dict[str, Any]:
        where = "data state"
        loader_state = dict(_mapping(value, where))
        expected = _loader_state_keys()
        missing = expected - set(loader_state)
        if missing:
            raise ValueError(
                f"{where}: missing {sorted(missing)}; not a single-process StatefulDataLoader "
                "state of this torchdata version"
            )
        if not isinstance(loader_state[_LOADER_FINISHED], bool):
            raise ValueError(f"{where}: {_LOADER_FINISHED!r} must be a bool")  # noqa: TRY004
        for key in ("_num_yielded", "_sampler_iter_yielded"):
            _int_field(loader_state, key, where)
        sampler_iter = _mapping(
            loader_state[_LOADER_SAMPLER_ITER], f"{where} {_LOADER_SAMPLER_ITER!r}"
        )
        if _BATCH_SAMPLER_STATE not in sampler_iter:
            raise ValueError(
                f"{where}: no {_BATCH_SAMPLER_STATE!r} under {_LOADER_SAMPLER_ITER!r}; it was "
                "saved by a loader without an EpochSampler (shuffle=True?), whose order cannot "
                "be continued"
            )
        _int_field(sampler_iter, "samples_yielded", f"{where} {_LOADER_SAMPLER_ITER!r}")
        self.sampler.check_state(sampler_iter[_BATCH_SAMPLER_STATE], f"{where} sampler state")
        return loader_state


def _current_layout(state: Any) -> Any:
    """``state`` in this version's layout: the loader's state alone. The earlier layout kept the
    stream's epoch beside it (always equal to the sampler's epoch inside; a checkpoint whose two
    epochs disagree is refused)."""
    if not isinstance(state, Mapping) or set(state) != {"epoch", "dataloader"}:
        return state
    loader = _mapping(state["dataloader"], "data state 'dataloader'")
    sampler = _sampler_epoch(loader)
    if sampler is not None and sampler != state["epoch"]:
        raise ValueError(
            f"data state: epoch {state['epoch']!r} beside a sampler at epoch {sampler}; the "
            "checkpoint is inconsistent"
        )
    return loader


def _sampler_epoch(loader_state: Mapping[str, Any]) -> Any:
    """The epoch the loader state's ``EpochSampler`` records, wherever torchdata nests it."""
    for value in loader_state.values():
        if isinstance(value, Mapping):
            if "epoch" in value and "seed" in value:
                return value["epoch"]
            found = _sampler_epoch(value)
            if found is not None:
                return found
    return None
