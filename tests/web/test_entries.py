"""State-dict names read from component indexes without torch: plain components (ranks from
their names), Megatron's layout, malformed indexes, the cache, and a store that lost an index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.cas.digest import blob_key
from ckptstore.checkpointer import open_run
from ckptstore.checkpointer.shards import ShardWriter
from ckptstore.errors import SerializationError
from ckptstore.integrations._common.megatron_layout import (
    META,
    Layout,
    ObjectShard,
    TensorShard,
    meta_state,
)
from ckptstore.manifest.records import CheckpointInfo
from ckptstore.manifest.serving import open_readonly
from ckptstore.objectstore import LocalStore
from ckptstore.web.data import Site, tensor_table
from ckptstore.web.entries import IndexCache, parse_index, tensor_rows


class CountingStore(LocalStore):
    """A real LocalStore that counts whole-object reads."""

    reads = 0

    def get_view(self, key: str) -> memoryview:
        self.reads += 1
        return super().get_view(key)


def index_doc(**fields: Any) -> bytes:
    entry = {
        "path": "w",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [2],
        "nbytes": 8,
        "segments": [["b3:" + "0" * 64, 0, 8]],
    }
    return json.dumps(
        {"format": "ckptstore/index", "version": 1, "tree": None, "entries": [entry | fields]}
    ).encode()


def test_parse_index_reads_an_entry() -> None:
    index = parse_index(index_doc(), "here")
    entry = index.by_path["w"]
    assert (entry.dtype, entry.shape, entry.nbytes, entry.segments[0].length) == (
        "float32",
        (2,),
        8,
        8,
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        json.dumps({"format": "other"}).encode(),
        json.dumps({"format": "ckptstore/index", "entries": {}}).encode(),
        index_doc(shape="2"),
        index_doc(shape=[-1]),
        index_doc(nbytes=True),
        index_doc(segments=[["b3:x", 0]]),
        index_doc(kind=3),
        json.dumps({"format": "ckptstore/index", "entries": [{"kind": "json"}]}).encode(),
    ],
)
def test_parse_index_refuses_malformed_documents(raw: bytes) -> None:
    with pytest.raises(SerializationError, match="here"):
        parse_index(raw, "here")


def save_ranked(db: str, store: LocalStore) -> CheckpointInfo:
    """Two ranks' components and a Megatron-shaped layout over them (the real layout classes),
    committed by the coordinator as ``megatron.save`` commits them."""
    shards = (
        TensorShard("w", "megatron/rank0", "t0", "float32", (4, 6), (0, 0), (4, 3)),
        TensorShard("w", "megatron/rank1", "t0", "float32", (4, 6), (0, 3), (4, 3)),
        TensorShard("b", "megatron/rank0", "t1", "bfloat16", (6,), (0,), (6,)),
    )
    objects = (ObjectShard("rng", "megatron/rank1", "o0", (2,), (1,)),)
    with ShardWriter(store) as writer:
        receipts = [
            writer.write(
                "megatron/rank0",
                {"t0": torch.ones(4, 3), "t1": torch.zeros(6, dtype=torch.bfloat16)},
            ),
            writer.write(
                "megatron/rank1",
                {"t0": torch.full((4, 3), 2.0), "o0": {"seed": 7, "ids": torch.arange(3)}},
            ),
            writer.write("policy/rank3", {"x": torch.ones(2)}),
        ]
    meta = meta_state(Layout(shards, objects), 2, {"sharded_backend": "ckptstore"})
    with open_run("mcore", db=db, store=store, async_save=False) as run:
        return run.save(1, {META: meta}, receipts=receipts).wait()


def test_megatron_rows_are_keys_with_their_shards_and_ranks(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "store")
    info = save_ranked(str(tmp_path / "m.db"), store)
    cache = IndexCache(lambda: store)
    rows = {
        (r.component, r.name): r
        for r in tensor_rows(info.components, lambda c: cache.get(c.index_digest, c.name))
    }
    w = rows["megatron", "w"]
    assert (w.dtype, w.shape, w.nbytes, w.ranks) == ("float32", (4, 6), 96, (0, 1))
    assert [p.at for p in w.pieces] == [(0, 0), (0, 3)]
    assert rows["megatron", "b"].ranks == (0,)
    rng = rows["megatron", "rng"]
    assert (rng.kind, rng.ranks) == ("object", (1,))
    assert rows["policy/rank3", "x"].ranks == (3,)  # a plain component's rank, from its name
    assert not any(name.startswith("megatron/") for name, _ in rows)
    reads = store.reads
    tensor_rows(info.components, lambda c: cache.get(c.index_digest, c.name))
    assert store.reads == reads  # indexes are read once


def test_a_lost_index_is_reported_and_the_page_still_renders(tmp_path: Path) -> None:
    db, store = str(tmp_path / "m.db"), LocalStore(tmp_path / "store")
    with open_run("r", db=db, store=store, async_save=False) as run:
        info = run.save(1, {"model": {"w": torch.ones(2)}}).wait()
    (store.root / blob_key(info.components[0].index_digest)).unlink()
    site = Site(open_readonly(db), str(store.root), db_label=db)
    try:
        rows, error = tensor_table(site, info)
        assert rows == []
        assert error is not None
        assert "component 'model'" in error
    finally:
        site.close()
