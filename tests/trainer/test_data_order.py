"""The prompt order (issue #12): a pure function of (seed, epoch), and a resume from a state saved
after any batch -- mid-epoch, exactly at an epoch end, after the very last batch, or after a
round trip through ckptstore -- continues the identical sequence."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import open_run
from ckptstore.serialize.save import flatten_state
from trainer.data import EpochSampler, PromptStream

ITEMS, BATCH, EPOCHS, SEED = 16, 2, 3, 1234


class Prompts(torch.utils.data.Dataset[dict[str, Any]]):
    """Items shaped like the trainer's PromptDataset: dicts carrying their ``prompt_id``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"prompt_id": index, "digits": torch.full((3,), index)}


def stream(
    items: int = ITEMS, seed: int = SEED, epochs: int = EPOCHS, batch: int = BATCH
) -> PromptStream:
    return PromptStream(Prompts(items), batch_size=batch, seed=seed, max_epochs=epochs)


def take(s: PromptStream, count: int | None = None) -> list[list[int]]:
    """``count`` batches (all remaining if None) as lists of prompt ids."""
    out: list[list[int]] = []
    while count is None or len(out) < count:
        batch = s.next_batch()
        if batch is None:
            assert count is None, "the stream ended early"
            break
        assert batch.dtype == torch.int64
        out.append(batch.tolist())
    return out


def resumed(state: Any, **kwargs: Any) -> PromptStream:
    s = stream(**kwargs)
    s.load_state_dict(state)
    return s


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return take(stream())


def test_uninterrupted_sequence_has_every_epoch(reference: list[list[int]]) -> None:
    per_epoch = ITEMS // BATCH
    assert len(reference) == EPOCHS * per_epoch
    epochs = [reference[e * per_epoch : (e + 1) * per_epoch] for e in range(EPOCHS)]
    for epoch in epochs:
        assert sorted(i for b in epoch for i in b) == list(range(ITEMS))
    assert len({json.dumps(e) for e in epochs}) == EPOCHS


@pytest.mark.parametrize("cut", range(ITEMS // BATCH * EPOCHS + 1))
def test_resume_after_any_batch_continues_identically(reference: list[list[int]], cut: int) -> None:
    s = stream()
    head = take(s, cut)
    assert s.epoch == max(cut - 1, 0) // (ITEMS // BATCH)  # an epoch ends on the next call
    state = s.state_dict()
    t = resumed(state)
    assert t.epoch == s.epoch
    assert t.state_dict() == state  # loading then saving changes nothing
    assert head + take(t) == reference
    assert t.next_batch() is None
    assert t.epoch == EPOCHS


@pytest.mark.parametrize("cut", [0, 3, ITEMS // BATCH + 1])
def test_a_state_of_the_earlier_layout_resumes_identically(
    reference: list[list[int]], cut: int
) -> None:
    """Checkpoints written before the epoch lived in the sampler alone still resume."""
    s = stream()
    head = take(s, cut)
    earlier = {"epoch": s.epoch, "dataloader": s.state_dict()}
    t = resumed(earlier)
    assert t.state_dict() == s.state_dict()
    assert head + take(t) == reference
    with pytest.raises(ValueError, match="inconsistent"):
        resumed({"epoch": s.epoch + 1, "dataloader": s.state_dict()})


def test_state_after_the_last_batch_stays_finished(reference: list[list[int]]) -> None:
    s = stream()
    assert take(s) == reference
    assert s.next_batch() is None
    assert s.epoch == EPOCHS
    again = resumed(s.state_dict())
    assert again.next_batch() is None
    assert again.epoch == EPOCHS


def test_finished_state_continues_with_more_epochs() -> None:
    longer = take(stream(epochs=EPOCHS + 1))
    s = stream()
    done = take(s)
    assert done + take(resumed(s.state_dict(), epochs=EPOCHS + 1)) == longer


def test_repeated_resumes_and_a_partial_last_batch() -> None:
    """15 items in batches of 4: each epoch drops one index; resuming every batch is exact."""
    kwargs = {"items": 15, "batch": 4, "epochs": 3}
    reference = take(stream(**kwargs))
    assert len(reference) == 9
    s, out = stream(**kwargs), []
    while (batch := s.next_batch()) is not None:
        out.append(batch.tolist())
        s = resumed(json.loads(json.dumps(s.state_dict())), **kwargs)
    assert out == reference
    for e in range(3):
        seen = [i for b in reference[e * 3 : e * 3 + 3] for i in b]
        assert len(set(seen)) == 12
        assert set(seen) <= set(range(15))


def test_state_is_plain_json_and_storable_by_ckptstore() -> None:
    s = stream()
    take(s, 11)
    state = s.state_dict()
    flat = flatten_state(state)  # raises SerializationError on anything ckptstore cannot store
    assert all(leaf.kind == "json" for leaf in flat.leaves)
    assert json.loads(json.dumps(state)) == state


def test_resume_from_a_real_ckptstore_checkpoint(
    tmp_path: Path, reference: list[list[int]]
) -> None:
    cuts = (0, 5, 8, 13, 24)
    with open_run(
        "data-order", db=str(tmp_path / "m.db"), store=str(tmp_path / "s"), async_save=False
    ) as run:
        s = stream()
        done = 0
        for cut in cuts:
            take(s, cut - done)
            done = cut
            run.save(cut, {"dataloader": s.state_dict()})
    with open_run(
        "data-order", db=str(tmp_path / "m.db"), store=str(tmp_path / "s"), writable=False
    ) as run:
        for cut in cuts:
            state = run.load(cut).state["dataloader"]
            assert reference[:cut] + take(resumed(state)) == reference


def test_same_seed_same_order_other_seed_other_order(reference: list[list[int]]) -> None:
    assert take(stream()) == reference
    other = take(stream(seed=SEED + 1))
    assert other != reference
    assert Counter(i for b in other for i in b) == Counter(i for b in reference for i in b)


def test_sampler_order_is_a_function_of_seed_and_epoch() -> None:
    data = list(range(50))
    a, b = EpochSampler(data, seed=7), EpochSampler(data, seed=7)
    b.set_epoch(3)
    list(b)  # history does not matter
    orders = []
    for epoch in range(4):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        order = list(a)
        assert order == list(b)
        assert sorted(order) == data
        orders.append(order)
    assert len({tuple(o) for o in orders}) == 4
    assert list(a) == orders[3]  # iterating again repeats the epoch


def test_sampler_resumes_mid_epoch() -> None:
    data = list(range(20))
    a = EpochSampler(data, seed=1, epoch=2)
    full = list(a)
    it = iter(a)
    head = [next(it) for _ in range(7)]
    state = a.state_dict()
    assert state == {"seed": 1, "num_items": 20, "epoch": 2, "yielded": 7}
    b = EpochSampler(data, seed=1)
    b.load_state_dict(state)
    iter(b)  # an iterator never started does not use up the resume position
    assert head + list(b) == full
    assert list(b) == full  # the next iteration starts the epoch over


def good_state() -> dict[str, Any]:
    s = stream()
    take(s, 3)
    return s.state_dict()


def sampler_state(state: dict[str, Any]) -> dict[str, Any]:
    return state["_sampler_iter_state"]["sampler_state"]


def _loader(key: str, value: Any = ...) -> Any:
    def edit(state: dict[str, Any]) -> None:
        if value is ...:
            del state[key]
        else:
            state[key] = value

    return edit


def _sampler(key: str, value: Any = ...) -> Any:
    def edit(state: dict[str, Any]) -> None:
        if value is ...:
            del sampler_state(state)[key]
        else:
            sampler_state(state)[key] = value

    return edit


def _no_sampler_state(state: dict[str, Any]) -> None:
    del state["_sampler_iter_state"]["sampler_state"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_loader("_num_yielded"), r"missing \['_num_yielded'\]"),
        (_loader("_num_yielded", "3"), r"'_num_yielded' must be an int"),
        (_loader("_iterator_finished", "no"), r"'_iterator_finished' must be a bool"),
        (_loader("_sampler_iter_state", None), r"'_sampler_iter_state' must be a dict"),
        (_no_sampler_state, r"no 'sampler_state'.*without an EpochSampler"),
        (_sampler("yielded"), r"'yielded' must be an int, got missing"),
        (_sampler("epoch", True), r"'epoch' must be an int"),
        (_sampler("epoch", -1), r"'epoch' must be >= 0"),
        (_sampler("yielded", 17), r"more than the 16 items"),
        (_sampler("seed", 99), r"saved with seed 99, but this sampler's seed is 1234"),
        (_sampler("num_items", 32), r"saved over 32 items, but the dataset has 16"),
    ],
)
def test_malformed_state_raises_value_error(edit: Any, message: str) -> None:
    state = good_state()
    edit(state)
    s = stream()
    with pytest.raises(ValueError, match=message):
        s.load_state_dict(state)
    # A refused state leaves the stream untouched.
    assert take(s, 2) == take(stream(), 2)


@pytest.mark.parametrize("state", [None, [], "state", {}])
def test_non_dict_or_empty_state_raises_value_error(state: Any) -> None:
    with pytest.raises(ValueError, match="data state"):
        stream().load_state_dict(state)


def test_state_of_a_shuffling_loader_is_refused() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(
        Prompts(ITEMS), batch_size=BATCH, shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(SEED),
    )  # fmt: skip
    with pytest.raises(ValueError, match="without an EpochSampler"):
        stream().load_state_dict(loader.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch": 0}, "batch_size must be a positive int"),
        ({"epochs": -1}, "max_epochs must be an int >= 0"),
        ({"items": 1}, "fewer than one batch"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stream(**kwargs)
