"""The streaming export under ``ckptstore export``: safetensors files written tensor by tensor,
whole tensors put together from stored pieces with every blob fetched once, and Hugging Face
shards cut, converted and renamed as planned -- checked with the ``safetensors`` package and
against a real directory store.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from counting_store import CountingStore
from safetensors import safe_open
from safetensors.torch import load_file

import ckptstore
from ckptstore.cas.writer import WriterOptions
from ckptstore.errors import ConfigError, SerializationError
from ckptstore.maintenance.export_sources import Piece, PieceReader, SourceTensor, with_prefix
from ckptstore.maintenance.hfexport import (
    export_hf,
    export_single,
    load_map,
    parse_size,
)
from ckptstore.maintenance.hfnames import megatron_to_hf
from ckptstore.maintenance.safetensors_writer import SafetensorsFile, TensorSpec, save_tensors
from ckptstore.objectstore import LocalStore
from ckptstore.serialize.reader import ComponentReader

MiB = 1 << 20


def spec(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, t.dtype, tuple(t.shape))


# -- the writer ---------------------------------------------------------------------------------


def test_a_file_written_in_any_order_loads_with_safetensors(tmp_path: Path) -> None:
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(5, dtype=torch.uint8),
        "fp8": torch.randn(4).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(4, 6).t(),
    }
    path = tmp_path / "x.safetensors"
    with SafetensorsFile(path, [spec(n, t) for n, t in tensors.items()], {"a": "b"}) as out:
        for name in reversed(list(tensors)):
            out.write(name, tensors[name])
        out.commit()
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert loaded[name].shape == tensor.shape
        assert as_bytes(loaded[name]) == as_bytes(tensor)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"a": "b"}
    # Every tensor starts at a multiple of its element size (readers may map it in place).
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    assert length % 8 == 0
    header = json.loads(raw[8 : 8 + length])
    sizes = {"F64": 8, "I64": 8, "F32": 4, "F16": 2, "BF16": 2}
    for name, info in header.items():
        if name != "__metadata__":
            assert info["data_offsets"][0] % sizes.get(info["dtype"], 1) == 0, name
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 & ~current_umask()
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_file_left_unfinished_or_fed_the_wrong_tensor_leaves_nothing(tmp_path: Path) -> None:
    a, b = torch.zeros(2, 3), torch.ones(4)
    path = tmp_path / "x.safetensors"
    with SafetensorsFile(path, [spec("a", a), spec("b", b)], {}) as out:
        out.write("a", a)
        with pytest.raises(SerializationError, match=r"1 tensors .* were never written"):
            out.commit()
    wrong = pytest.raises(SerializationError, match=r"arrived as torch.float32\[3, 2\]")
    with SafetensorsFile(path, [spec("a", a)], {}) as out, wrong:
        out.write("a", a.t().contiguous())
    with pytest.raises(SerializationError, match="complex64, which safetensors cannot hold"):
        save_tensors(path, {"c": torch.zeros(2, dtype=torch.complex64)}, {})
    with pytest.raises(SerializationError, match="two tensors would be named 'a'"):
        SafetensorsFile(path, [spec("a", a), spec("a", b)], {})
    assert list(tmp_path.iterdir()) == []


# -- pieces -------------------------------------------------------------------------------------


def stored(store: LocalStore, state: dict[str, torch.Tensor]) -> ComponentReader:
    """``state`` stored as one component in 1 MiB chunks, small tensors packed together."""
    options = WriterOptions(chunk_bytes=MiB, pack_threshold=64 << 10, pack_bytes=MiB)
    with ckptstore.ShardWriter(store, options=options) as writer:
        receipt = writer.write("c", state)
    return ComponentReader(store, receipt.result.index_digest)


def whole_source(reader: ComponentReader, path: str, name: str | None = None) -> SourceTensor:
    entry = reader.entry(path)
    dtype = torch.empty(0, dtype=getattr(torch, entry.dtype)).dtype
    piece = Piece(reader, entry, (0,) * len(entry.shape))
    return SourceTensor(name or path, dtype, entry.shape, (piece,))


def test_pieces_are_assembled_and_every_blob_is_fetched_once(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "store")
    big = torch.randn(768, 1024)  # 3 MiB: three chunks
    smalls = {f"s{i}": torch.randn(16, 16) for i in range(6)}  # one pack
    reader = stored(store, {"top": big[:384].clone(), "bottom": big[384:].clone(), **smalls})
    top, bottom = reader.entry("top"), reader.entry("bottom")
    split = SourceTensor(
        "big",
        torch.float32,
        (768, 1024),
        (Piece(reader, bottom, (384, 0)), Piece(reader, top, (0, 0))),
    )
    sources = [split, *(whole_source(reader, name) for name in smalls)]
    store.reads.clear()
    pieces = PieceReader(store, sources, "test")
    assert torch.equal(pieces.assemble(split), big)
    for source in sources[1:]:
        assert torch.equal(pieces.assemble(source), smalls[source.name])
    assert store.reads
    assert set(store.reads.values()) == {1}
    assert len(store.reads) == len(reader.digests)


def test_with_prefix_keeps_and_renames_one_subtree(tmp_path: Path) -> None:
    reader = stored(LocalStore(tmp_path / "s", fsync=False), {"w": torch.zeros(2)})
    sources = [whole_source(reader, "w", "model.w"), whole_source(reader, "w", "optim.w")]
    assert [s.name for s in with_prefix(sources, "model")] == ["w"]
    with pytest.raises(ConfigError, match=r"no tensor is named nope\.<name>"):
        with_prefix(sources, "nope")


# -- Hugging Face shards -----------------------------------------------------------------------


def stacked_map(name: str, tensor: torch.Tensor) -> object:
    """A map for the test: one tensor per layer of 'stack', 'drop' left out, others prefixed."""
    if name == "drop":
        return None
    if name == "stack":
        return ((f"layers.{i}.w", tensor[i]) for i in range(tensor.shape[0]))
    return f"model.{name}"


def test_hf_shards_are_cut_converted_renamed_and_indexed(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "store")
    state = {
        "stack": torch.randn(3, 64, 64),  # 16 KiB per layer in fp32, 8 KiB in bf16
        "emb": torch.randn(128, 64),
        "drop": torch.randn(512, 512),
        "count": torch.arange(10),
    }
    reader = stored(store, state)
    sources = [whole_source(reader, name) for name in state]
    store.reads.clear()
    out = tmp_path / "hf"
    files = export_hf(
        store, sources, out, shard_size=20_000, dtype=torch.bfloat16, mapping=stacked_map
    )
    names = [f.name for f in files]
    assert names[-1] == "model.safetensors.index.json"
    count = len(names) - 1
    assert names[:-1] == [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
    index = json.loads(files[-1].read_text())
    loaded: dict[str, torch.Tensor] = {}
    for f in files[:-1]:
        part = load_file(str(f))
        assert f.stat().st_size <= 20_000 + 1024 or len(part) == 1
        assert all(index["weight_map"][k] == f.name for k in part)
        loaded |= part
    expected = {f"layers.{i}.w": state["stack"][i].bfloat16() for i in range(3)}
    expected |= {"model.emb": state["emb"].bfloat16(), "model.count": state["count"]}
    assert sorted(index["weight_map"]) == sorted(expected) == sorted(loaded)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in expected.values())
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name
    # 'drop' was never read; everything else once.
    drop_blobs = {s.digest for s in reader.entry("drop").segments}
    assert set(store.reads.values()) == {1}
    assert not drop_blobs & {k.rsplit("/", 1)[-1] for k in store.reads}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644 & ~current_umask()


def test_a_single_file_holds_every_tensor(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    state = {"a": torch.randn(300, 1024), "b": torch.tensor([1, 2, 3])}
    reader = stored(store, state)
    path = export_single(
        store, [whole_source(reader, n) for n in state], tmp_path / "o" / "c.safetensors"
    )
    loaded = load_file(str(path))
    assert torch.equal(loaded["a"], state["a"])
    assert torch.equal(loaded["b"], state["b"])


def test_map_and_size_options_are_checked() -> None:
    assert parse_size("5GB") == 5_000_000_000
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1000") == 1000
    assert parse_size("1.5MB") == 1_500_000
    for bad in ("", "GB", "-1", "0", "5XB", "abc", "infGB", "nan", "1e400"):
        with pytest.raises(ConfigError, match="--shard-size"):
            parse_size(bad)
    assert load_map("ckptstore.maintenance.hfnames:megatron_to_hf") is megatron_to_hf
    with pytest.raises(ConfigError, match="module:function"):
        load_map("ckptstore.maintenance.hfnames")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_x'"):
        load_map("no_such_module_x:f")
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        load_map("ckptstore.maintenance.hfnames:nope")


def test_a_map_that_names_two_tensors_alike_or_fails_is_a_config_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    reader = stored(store, {"a": torch.zeros(2), "b": torch.ones(2)})
    sources = [whole_source(reader, "a"), whole_source(reader, "b")]
    with pytest.raises(ConfigError, match="two tensors would be named 'same'"):
        export_hf(store, sources, tmp_path / "o", mapping=lambda n, t: "same")
    with pytest.raises(ConfigError, match="--map failed on tensor 'a': KeyError"):
        export_hf(store, sources, tmp_path / "o", mapping=lambda n, t: {}[n])
    with pytest.raises(ConfigError, match="no tensor is left"):
        export_hf(store, sources, tmp_path / "o", mapping=lambda n, t: None)
    assert not (tmp_path / "o").exists() or list((tmp_path / "o").iterdir()) == []


# -- the Megatron -> GPT-NeoX names ----------------------------------------------------------


def test_megatron_gpt_names_map_to_gpt_neox() -> None:
    stacked = torch.empty(2, 12, 4, device="meta")
    pairs = megatron_to_hf("decoder.layers.self_attention.linear_qkv.weight", stacked)
    assert not isinstance(pairs, str)
    assert pairs is not None
    assert [(n, tuple(t.shape)) for n, t in pairs] == [
        ("gpt_neox.layers.0.attention.query_key_value.weight", (12, 4)),
        ("gpt_neox.layers.1.attention.query_key_value.weight", (12, 4)),
    ]
    flat = torch.empty(4)
    assert megatron_to_hf("decoder.layers.3.mlp.linear_fc2.bias", flat) == (
        "gpt_neox.layers.3.mlp.dense_4h_to_h.bias"
    )
    assert megatron_to_hf("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", flat) == (
        "gpt_neox.layers.0.post_attention_layernorm.weight"
    )
    assert megatron_to_hf("embedding.word_embeddings.weight", flat) == "gpt_neox.embed_in.weight"
    assert megatron_to_hf("output_layer.weight", flat) == "embed_out.weight"
    assert megatron_to_hf("fc1.weight", flat) == "gpt_neox.layers.0.mlp.dense_h_to_4h.weight"
    assert megatron_to_hf("decoder.layers.self_attention.linear_qkv._extra_state", flat) is None
    with pytest.raises(KeyError, match=r"decoder\.layers\.0\.mystery\.weight"):
        megatron_to_hf("decoder.layers.0.mystery.weight", flat)
    with pytest.raises(KeyError, match=r"'rotary\.inv_freq' is not"):
        megatron_to_hf("rotary.inv_freq", flat)
