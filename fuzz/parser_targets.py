"""The Python parsers of stored bytes, each with real seed inputs and a mutation engine.

- ``header``: ``ckptstore.cas.header.decode_header`` on headers of every codec and kind, whole
  or as the prefix a ranged read fetches; damaged fields, truncations, and (most of the time)
  the CRC sealed again over the damage, so that the checks behind the CRC are reached.
- ``object``: ``ckptstore.cas.blobs.decode_object`` on real objects of each codec (raw, zstd,
  byte-grouped zstd, fphuff), with forged header fields (lengths, itemsize, codec id, params)
  resealed, and damaged payloads; a decode that succeeds must return the original bytes.
- ``index``: ``ckptstore.serialize.index.decode_index`` on the index blobs a real save of
  several states writes (tensors, arrays, bytes, JSON values, nested containers).
- ``dcp-metadata``: ``ckptstore.integrations.dcp._metadata.decode_metadata`` (and
  ``dcp._validate.expected_items`` on what it returns) on DCP metadata documents.

Each engine (built eagerly: seeds first) yields (reproducer, call): the call parses one
input; the reproducer is what a finding's file records to repeat it.
"""

from __future__ import annotations

import math
import random
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fuzz.jsonmut import JsonMutator

Call = Callable[[], Any]
Mutants = Iterator[tuple[dict[str, Any], Call]]
_CRC_AT, _FIXED = 60, 64
#: (offset, struct format) of the header's fields past the magic.
_HEADER_FIELDS = ((4, "B"), (5, "B"), (6, "B"), (7, "B"), (8, "Q"), (16, "Q"), (56, "I"))
_EXTREMES = (0, 1, 2, 3, 4, 7, 8, 9, 255, 256, 511, 512, 513, 1 << 30, 1 << 36, (1 << 36) + 1)


def reseal(obj: bytearray) -> None:
    """Recompute a header's CRC over whatever its fields now hold."""
    (params_len,) = struct.unpack_from("<I", obj, 56)
    params = bytes(obj[_FIXED : _FIXED + min(params_len, 4096)])
    crc = zlib.crc32(params, zlib.crc32(bytes(obj[:_CRC_AT]) + bytes(4)))
    struct.pack_into("<I", obj, _CRC_AT, crc)


def _damage(rng: random.Random, obj: bytearray, start: int = 0) -> None:
    """One byte-level hit at or after ``start``: flip, overwrite, truncate or extend."""
    if len(obj) <= start:
        obj += rng.randbytes(rng.randint(1, 64))
        return
    at = rng.randrange(start, len(obj))
    choice = rng.randrange(4)
    if choice == 0:
        obj[at] ^= 1 << rng.randrange(8)
    elif choice == 1:
        obj[at] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
    elif choice == 2:
        del obj[at:]
    else:
        obj += rng.randbytes(rng.randint(1, 64))


def _forge_field(rng: random.Random, obj: bytearray) -> None:
    """Set one header field to an extreme or random value."""
    offset, fmt = rng.choice(_HEADER_FIELDS)
    if len(obj) < offset + struct.calcsize(fmt):  # truncated by an earlier mutation
        return _damage(rng, obj)
    top = (1 << (8 * struct.calcsize(fmt))) - 1
    value = rng.choice((*_EXTREMES, top, top - 1, rng.randrange(top + 1)))
    struct.pack_into("<" + fmt, obj, offset, value & top)
    return None


# -- blob headers and whole objects -----------------------------------------------------------


def _objects() -> list[tuple[bytes, str, bytes]]:
    """(stored object, digest, raw bytes) of each codec, kind and a few shapes of data."""
    from ckptstore.cas.codec import BGZSTD, FPHUFF, RAW, ZSTD
    from ckptstore.cas.digest import digest_bytes, raw_digest
    from ckptstore.cas.header import Header, Kind

    rng = np.random.default_rng(0)
    weights = (rng.standard_normal(3000) * 0.02).astype(np.float16)
    tokens = rng.zipf(1.3, 5000).clip(0, 30000).astype(np.int32)
    cases = [
        (FPHUFF, weights.tobytes(), 2, True),
        (FPHUFF, weights.astype(np.float32).tobytes(), 4, True),
        (FPHUFF, weights.astype(np.float64)[:300].tobytes(), 8, True),
        (BGZSTD, weights.tobytes(), 2, True),
        (BGZSTD, weights.astype(np.float32).tobytes(), 4, True),
        (ZSTD, tokens.tobytes(), 1, False),
        (ZSTD, b'{"format": "x", "entries": []}' * 30, 1, False),
        (RAW, rng.bytes(777), 1, False),
        (RAW, b"", 1, False),
    ]
    out = []
    for i, (codec, raw, itemsize, float_like) in enumerate(cases):
        view = memoryview(raw)
        enc = codec.encode(view, itemsize=itemsize, float_like=float_like, threshold=-math.inf)
        assert enc is not None, f"{codec.name} declined {len(raw)} bytes with no threshold"
        digest = digest_bytes(raw)
        header = Header(
            kind=Kind(i % 3),
            codec=enc.codec,
            itemsize=enc.itemsize,
            raw_len=len(raw),
            stored_len=enc.stored_len,
            digest=raw_digest(digest),
            params=enc.params,
        )
        payload = b"".join(bytes(p) for p in enc.payload)
        out.append((header.encode() + payload, digest, raw))
    return out


def header_mutants(seed: int) -> Mutants:
    """Inputs of ``decode_header``: headers (with a few payload bytes) damaged and resealed."""
    from ckptstore.cas.header import MAX_HEADER, decode_header

    rng, seeds = random.Random(seed), [obj for obj, _, _ in _objects()]
    return _header_mutants(rng, seeds, decode_header, MAX_HEADER)


def _header_mutants(
    rng: random.Random, seeds: list[bytes], decode_header: Any, max_header: int
) -> Mutants:
    while True:
        obj = bytearray(rng.choice(seeds))
        for _ in range(rng.choice((1, 1, 2, 3))):
            if rng.random() < 0.5:
                _forge_field(rng, obj)
            else:
                _damage(rng, obj)
        if len(obj) >= _FIXED and rng.random() < 0.7:
            reseal(obj)
        size: int | None = None
        if rng.random() < 0.3:  # a ranged read: the prefix, and the object's size
            size = rng.choice((len(obj), len(obj) + rng.randint(-70, 70), rng.randrange(1 << 40)))
            obj = obj[:max_header]
        data = bytes(obj)
        yield (
            {"object_hex": data.hex(), "object_size": size},
            lambda data=data, size=size: decode_header(memoryview(data), "fuzz", object_size=size),
        )


def _forge_params(rng: random.Random, obj: bytearray) -> None:
    """Damage the codec parameters (the byte-grouping table, fphuff's format and block)."""
    (params_len,) = struct.unpack_from("<I", obj, 56)
    if not params_len or _FIXED + params_len > len(obj):  # none, or a forged length
        return _forge_field(rng, obj)
    at = _FIXED + rng.randrange(params_len)
    if params_len % 9 == 0 and rng.random() < 0.5:  # a plane's (codec u8, length u64)
        at = _FIXED + 9 * rng.randrange(params_len // 9)
        value = rng.choice((0, 1, 2, 1 << 33, (1 << 64) - 1, rng.randrange(1 << 20)))
        struct.pack_into("<BQ", obj, at, rng.choice((0, 1, 2, 255)), value)
    else:
        obj[at] = rng.choice((0, 1, 2, 7, 8, 24, 25, 255, rng.randrange(256)))
    return None


def object_mutants(seed: int) -> Mutants:
    """Inputs of ``decode_object``: forged headers (resealed) and damaged payloads."""
    from ckptstore.cas.blobs import decode_object
    from ckptstore.cas.header import MAX_RAW_LEN

    return _object_mutants(random.Random(seed), _objects(), decode_object, MAX_RAW_LEN)


def _object_mutants(
    rng: random.Random, seeds: list[tuple[bytes, str, bytes]], decode_object: Any, max_raw_len: int
) -> Mutants:
    while True:
        original, digest, raw = rng.choice(seeds)
        obj = bytearray(original)
        header_size = len(original) - struct.unpack_from("<Q", original, 16)[0]
        for _ in range(rng.choice((1, 1, 2))):
            choice = rng.randrange(3)
            if choice == 0:
                _forge_field(rng, obj)
            elif choice == 1:
                _forge_params(rng, obj)
            else:
                _damage(rng, obj, header_size)
                struct.pack_into("<Q", obj, 16, max(0, len(obj) - header_size))
        if rng.random() < 0.9:
            reseal(obj)
        bound = len(raw) if rng.random() < 0.7 else max_raw_len
        data = bytes(obj)

        def call(
            data: bytes = data, digest: str = digest, bound: int = bound, raw: bytes = raw
        ) -> None:
            _, out = decode_object(memoryview(data), digest, "fuzz", max_raw_len=bound)
            if bytes(out) != raw:  # the digest check must make this impossible
                raise AssertionError("decode_object returned bytes other than the blob's")

        declared = struct.unpack_from("<Q", data, 8)[0] if len(data) >= 16 else 0
        reproducer = {"object_hex": data.hex(), "digest": digest, "max_raw_len": bound}
        yield {**reproducer, "declared_raw_len": declared}, call


# -- stored JSON documents --------------------------------------------------------------------


def _states() -> list[Any]:
    import torch

    torch.manual_seed(0)  # the same documents in every process: a dead child's input is
    rng = np.random.default_rng(1)  # regenerated by its parent
    return [
        {"w": torch.randn(4, 6), "b": torch.zeros(6, dtype=torch.bfloat16), "step": 7},
        {
            "layers": [{"w": torch.ones(3, 3, dtype=torch.float16)} for _ in range(3)],
            "opt": {"lr": 0.001, "betas": [0.9, 0.999], "name": "adamw", "none": None},
            "arr": rng.standard_normal((5, 2)),
            "scalar": np.float32(2.5),
            "blob": b"\x00\x01raw",
            "buf": bytearray(b"xyz"),
            "dtype": torch.float64,
            "nan": float("nan"),
            "big": torch.arange(5000, dtype=torch.int64),
        },
        {"empty": torch.empty(0, 3), "bool": torch.tensor([True, False]), "u8": torch.arange(9)},
    ]


def index_seeds() -> list[str]:
    """The index documents a real save of :func:`_states` stores."""
    from ckptstore.cas import BlobWriter, WriterOptions, get_blob
    from ckptstore.objectstore import LocalStore
    from ckptstore.serialize import write_component

    texts = []
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp), fsync=False)
        for state in _states():
            with BlobWriter(store, WriterOptions(max_workers=1)) as writer:
                result = write_component(writer, state)
            texts.append(bytes(get_blob(store, result.index_digest)[1]).decode())
    return texts


def index_mutants(seed: int) -> Mutants:
    """Inputs of ``decode_index``: mutants of real index documents."""
    from ckptstore.serialize.index import decode_index

    mutate = JsonMutator(index_seeds(), seed)
    while True:
        data = mutate().encode("utf-8", "surrogatepass")
        yield (
            {"document": data.decode("utf-8", "surrogatepass")},
            lambda d=data: decode_index(d, "fuzz"),
        )


def metadata_seeds() -> list[str]:
    """DCP metadata documents: a tensor in two row chunks, one in one chunk, plain values,
    planner data and storage metadata, items spread over two ranks."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ckptstore.integrations.dcp._metadata import Location, encode_metadata

    def tensor(size: list[int], chunks: list[tuple[list[int], list[int]]]) -> Any:
        return TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16),
            torch.Size(size),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
        )

    state = {
        "model.w": tensor([4, 6], [([0, 0], [2, 6]), ([2, 0], [2, 6])]),
        "model.b": tensor([6], [([0], [6])]),
        "optim.step": BytesStorageMetadata(),
    }
    locations = {
        MetadataIndex("model.w", torch.Size([0, 0])): Location(0, 0),
        MetadataIndex("model.w", torch.Size([2, 0])): Location(1, 0),
        MetadataIndex("model.b", torch.Size([0])): Location(0, 1),
        MetadataIndex("optim.step"): Location(0, 2),
    }
    planner = {"model.w": ("model", "w"), "model.b": ("model", "b"), "optim.step": ("optim",)}
    meta = Metadata(state, planner, None, StorageMeta(save_id="s1", modules=["m"]), version="1")
    ranks = {0: "b3:" + "a" * 64, 1: "b3:" + "b" * 64}
    return [encode_metadata(meta, locations, ranks)]


def metadata_mutants(seed: int) -> Mutants:
    """Inputs of ``decode_metadata`` (then ``expected_items``, where it exists)."""
    from ckptstore.integrations.dcp import _metadata as dcp_metadata

    try:
        from ckptstore.integrations.dcp._validate import expected_items
    except ImportError:
        expected_items = None

    def parse(text: str) -> Any:
        stored = dcp_metadata.decode_metadata(text, "fuzz")
        return stored if expected_items is None else expected_items(stored, "fuzz")

    return _json_mutants(JsonMutator(metadata_seeds(), seed), parse)


def _json_mutants(mutate: JsonMutator, parse: Callable[[str], Any]) -> Mutants:
    while True:
        text = mutate()
        yield {"document": text}, lambda text=text: parse(text)
