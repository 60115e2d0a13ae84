"""DCP and Megatron checkpoints with hand-written metadata, committed through the public API
(``ShardWriter`` receipts + ``Run.save(receipts=...)``): what a buggy or older writer -- or
anyone who can commit -- may leave behind. Every blob is healthy and every digest valid; only
the metadata may lie about the tensors the blobs hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

import ckptstore
from ckptstore.checkpointer import CheckpointInfo, Run

#: metadata.json of a ckptstore Megatron checkpoint (what megatron.CONFIG holds).
MEGATRON_CONFIG = {
    "sharded_backend": "ckptstore",
    "sharded_backend_version": 1,
    "common_backend": "ckptstore",
    "common_backend_version": 1,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Chunk:
    """One stored box of a tensor: its offset, its data, and the sizes the metadata claims
    (the data's own shape unless given)."""

    offsets: list[int]
    data: torch.Tensor
    sizes: list[int] | None = None

    @property
    def claimed(self) -> list[int]:
        return list(self.data.shape) if self.sizes is None else self.sizes


@dataclass
class Tensor:
    """A tensor as the metadata describes it: its (claimed) size, its chunks, its dtype (the
    first chunk's unless given)."""

    size: list[int]
    chunks: list[Chunk]
    dtype: str | None = None

    @property
    def dtype_name(self) -> str:
        return self.dtype or dtype_name(self.chunks[0].data.dtype)


def whole(data: torch.Tensor) -> Tensor:
    """A tensor stored as one chunk, described truthfully."""
    return Tensor(list(data.shape), [Chunk([0] * data.dim(), data)])


def dcp_document(tensors: dict[str, Tensor], digest: str) -> dict[str, Any]:
    """The ``dcp/metadata`` JSON document for ``tensors``, all stored by rank 0 (whose
    component index is ``digest``) in the order they are listed."""
    doc_tensors: dict[str, Any] = {}
    locations: list[list[Any]] = []
    for fqn, tensor in tensors.items():
        doc_tensors[fqn] = {
            "dtype": tensor.dtype_name,
            "size": tensor.size,
            "requires_grad": False,
            "memory_format": "contiguous",
            "chunks": [[c.offsets, c.claimed] for c in tensor.chunks],
        }
        for chunk in tensor.chunks:
            locations.append([fqn, chunk.offsets, 0, len(locations)])
    return {
        "format": "ckptstore/dcp-metadata",
        "version": 1,
        "dcp_version": "1.0.0",
        "tensors": doc_tensors,
        "values": [],
        "planner_data": {fqn: [fqn] for fqn in tensors},
        "storage_meta": None,
        "locations": locations,
        "ranks": [[0, digest]],
    }


def commit_dcp(
    run: Run, step: int, tensors: dict[str, Tensor], *, text: str | None = None
) -> CheckpointInfo:
    """Commit a DCP checkpoint of ``tensors`` (rank 0 stores every chunk's data); ``text``
    replaces the metadata document altogether."""
    items = [chunk.data for tensor in tensors.values() for chunk in tensor.chunks]
    with ckptstore.ShardWriter(run.store) as writer:
        receipt = writer.write("dcp/rank0", items)
    document = text or json.dumps(dcp_document(tensors, receipt.result.index_digest))
    return run.save(
        step,
        {"dcp/metadata": {"format": "ckptstore/dcp", "metadata": document}},
        receipts=[receipt],
    ).wait()


@dataclass
class Shard:
    """One stored box of a Megatron tensor, as the layout records it."""

    key: str
    global_shape: list[int]
    offset: list[int]
    data: torch.Tensor
    shape: list[int] | None = None

    @property
    def claimed(self) -> list[int]:
        return list(self.data.shape) if self.shape is None else self.shape


@dataclass
class MegatronCheckpoint:
    """What to commit: tensor shards (all stored by rank 0) and the layout that lists them, or
    a layout text of one's own."""

    shards: list[Shard] = field(default_factory=list)
    layout_text: str | None = None


def commit_megatron(run: Run, step: int, checkpoint: MegatronCheckpoint) -> CheckpointInfo:
    """Commit a ckptstore Megatron checkpoint (``megatron/meta`` + ``megatron/rank0``)."""
    state = {f"t{i}": shard.data for i, shard in enumerate(checkpoint.shards)}
    with ckptstore.ShardWriter(run.store) as writer:
        receipt = writer.write("megatron/rank0", state)
    rows = [
        [
            shard.key,
            "megatron/rank0",
            f"t{i}",
            dtype_name(shard.data.dtype),
            shard.global_shape,
            shard.offset,
            shard.claimed,
        ]
        for i, shard in enumerate(checkpoint.shards)
    ]
    layout = checkpoint.layout_text or json.dumps({"tensors": rows, "objects": []})
    meta = {
        "format": "ckptstore-megatron",
        "version": 1,
        "metadata": MEGATRON_CONFIG,
        "world_size": 1,
        "layout": layout,
    }
    return run.save(step, {"megatron/meta": meta}, receipts=[receipt]).wait()


def rows(
    count: int, cols: int = 64, *, start: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rows ``start ..`` of a tensor whose element i,j is i * cols + j (every value distinct)."""
    values = torch.arange(start * cols, (start + count) * cols, dtype=torch.float32)
    return values.reshape(count, cols).to(dtype)


#: name -> (the lying metadata's tensor 'w', the shape a destination of it has, a needle).
DCP_LIES: dict[str, tuple[Tensor, tuple[int, ...], str]] = {
    # Rows 128-255 of a 256-row tensor are in no chunk.
    "rows_left_out": (
        Tensor([256, 64], [Chunk([0, 0], rows(128))]),
        (256, 64),
        "hold 8192 of its 16384 elements",
    ),
    # 48 of the 96 columns of a bf16 tensor are in no chunk.
    "bf16_columns_left_out": (
        Tensor([16, 96], [Chunk([0, 0], rows(16, 48, dtype=torch.bfloat16))]),
        (16, 96),
        "near offset [0, 48]",
    ),
    # The second chunk lies past the tensor's end.
    "chunk_past_the_end": (
        Tensor([256, 64], [Chunk([0, 0], rows(128)), Chunk([200, 0], rows(128, start=128))]),
        (256, 64),
        "lies outside the tensor's shape [256, 64]",
    ),
    # Rows 64-127 twice and rows 192-255 never: the right number of elements, wrongly placed.
    "overlap_hides_a_gap": (
        Tensor([256, 64], [Chunk([0, 0], rows(128)), Chunk([64, 0], rows(128, start=64))]),
        (256, 64),
        "overlap and leave a gap",
    ),
    # The metadata says float32 (64 KiB), rank 0 stored bfloat16 (32 KiB).
    "dtype_disagrees_with_the_stored_bytes": (
        Tensor([256, 64], [Chunk([0, 0], rows(256, dtype=torch.bfloat16))], dtype="float32"),
        (256, 64),
        "float32[256, 64] in the metadata, but bfloat16[256, 64] is stored",
    ),
    # 65,536 rows (256 MiB) claimed, 1 MiB stored.
    "claims_256_MiB_holds_1_MiB": (
        Tensor([65536, 1024], [Chunk([0, 0], rows(256, 1024))]),
        (1,),
        "hold 262144 of its 67108864 elements",
    ),
    "claims_2_to_the_40_rows": (
        Tensor([2**40, 1024], [Chunk([0, 0], rows(256, 1024))]),
        (1,),
        "hold 262144 of its 1125899906842624 elements",
    ),
    "claims_2_to_the_70_rows": (
        Tensor([2**70, 1024], [Chunk([0, 0], rows(256, 1024))]),
        (1,),
        "more bytes than any tensor can hold",
    ),
}


def nested(depth: int) -> str:
    """A JSON text nested ``depth`` arrays deep."""
    return "[" * depth + "]" * depth


#: name -> (a Megatron checkpoint whose layout lies about tensor 'w', a needle).
MEGATRON_LIES: dict[str, tuple[MegatronCheckpoint, str]] = {
    # Two shards of rows 0-127, none of rows 128-255: the element count adds up.
    "overlap_hides_a_gap": (
        MegatronCheckpoint(
            [Shard("w", [256, 64], [0, 0], rows(128)), Shard("w", [256, 64], [0, 0], rows(128))]
        ),
        "overlap and leave a gap",
    ),
    "claims_2_to_the_40_rows": (
        MegatronCheckpoint([Shard("w", [2**40, 64], [0, 0], rows(128))]),
        "hold 8192 of its 70368744177664 elements",
    ),
    "claims_2_to_the_70_rows": (
        MegatronCheckpoint([Shard("w", [2**70, 64], [0, 0], rows(128))]),
        "more bytes than any tensor can hold",
    ),
    # The shards disagree on the tensor's shape (the first one's was believed).
    "shards_disagree_on_the_shape": (
        MegatronCheckpoint(
            [
                Shard("w", [256, 64], [0, 0], rows(128)),
                Shard("w", [512, 64], [128, 0], rows(128, start=128)),
            ]
        ),
        "float32[256, 64] in one shard and float32[512, 64] in another",
    ),
}
