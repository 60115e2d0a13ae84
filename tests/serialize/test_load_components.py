"""Several components loaded as one stream (``ckptstore.serialize.reader.load_components``,
what ``Run.load`` does): one pool and one read-ahead over every component's blobs, each plan's
value as its own load would give it; every ``into`` checked before anything is read; after a
damaged blob, the blobs not started yet are not read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from component_helpers import RecordingStore, save

from ckptstore.cas import blob_key
from ckptstore.errors import ConfigError, IntegrityError
from ckptstore.objectstore import LocalStore
from ckptstore.serialize import ComponentReader
from ckptstore.serialize.compare import first_difference
from ckptstore.serialize.reader import load_components

MiB = 1 << 20


def component(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * MiB // 4, generator=g),  # three 1 MiB chunks
        "layers": [torch.randn(128, 129, generator=g) for _ in range(4)],
        "step": seed,
    }


def saved(store: LocalStore, seeds: list[int]) -> list[ComponentReader]:
    return [
        ComponentReader(store, save(store, component(seed), chunk_bytes=MiB).index_digest)
        for seed in seeds
    ]


def test_every_plan_loads_as_its_own_load_would(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path / "store")
    readers = saved(store, [1, 2, 3])
    into = {"big": torch.empty(3 * MiB // 4), "layers": [torch.empty(128, 129) for _ in range(4)]}
    plans = [
        readers[0].plan(),
        readers[1].plan(into=into),
        readers[2].plan(["layers/1", "step"]),
    ]
    whole, filled, some = load_components(store, plans, max_workers=2)
    assert first_difference(component(1), whole) is None
    assert first_difference(component(2), filled) is None
    assert filled["big"] is into["big"]
    assert filled["layers"][3] is into["layers"][3]
    assert list(some) == ["layers/1", "step"]
    assert torch.equal(some["layers/1"], component(3)["layers"][1])
    assert some["step"] == 3
    # One read-ahead over all of them: every blob asked for, once.
    wanted = [*readers[0].digests, *readers[1].digests]
    wanted += [readers[2].entry(p).segments[0].digest for p in ("layers/1",)]
    assert sorted(store.prefetched) == sorted({blob_key(d) for d in wanted})


def test_a_blob_two_components_share_is_read_for_each(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path / "store")
    first, second = saved(store, [7, 7])  # equal states: the same blobs, the same index
    a, b = load_components(store, [first.plan(), second.plan()], max_workers=2)
    assert first_difference(component(7), a) is None
    assert first_difference(component(7), b) is None
    assert a["big"].data_ptr() != b["big"].data_ptr()  # two values, never one memory
    assert len(store.prefetched) == len(set(store.prefetched))  # read ahead once


def test_a_mismatched_target_of_a_later_component_is_refused_before_any_read(
    tmp_path: Path,
) -> None:
    store = RecordingStore(tmp_path / "store")
    first, second = saved(store, [1, 2])
    plan = first.plan()
    store.opened.clear()
    with pytest.raises(ConfigError, match=r"layers/2.*\[128, 129\].*\[128, 128\]"):
        second.plan(into={"layers": [torch.empty(128, 129)] * 2 + [torch.empty(128, 128)]})
    assert plan.load.by_blob  # planned (its index read), and no data blob read
    assert store.opened == []


def test_after_a_damaged_blob_the_blobs_not_started_are_not_read(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path / "store")
    readers = saved(store, [1, 2, 3, 4])
    digest = readers[0].entry("big").segments[0].digest  # the first blob of the load
    path = store.root / blob_key(digest)
    damaged = bytearray(path.read_bytes())
    damaged[-10] ^= 0x01
    path.write_bytes(bytes(damaged))
    plans = [reader.plan() for reader in readers]
    store.opened.clear()
    with pytest.raises(IntegrityError, match="corrupt") as caught:
        load_components(store, plans, max_workers=1)
    assert caught.value.digest == digest
    # One worker: the damaged blob, and the few it started before the error was seen.
    total = sum(len(plan.load.by_blob) for plan in plans)
    assert store.opened[0] == blob_key(digest)
    assert len(store.opened) < total // 2
