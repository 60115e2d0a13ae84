"""The public surface integrations and the trainer build on; stable across releases.

Everything an integration (``ckptstore.integrations.*``) needs from ckptstore comes from here,
from :mod:`ckptstore.errors` or from the package's top level -- never from the layers below
(``tests/test_architecture.py`` enforces it). What it offers, by the job it does:

- **Save** (DESIGN.md §7): workers store their shards with a :class:`ShardWriter` and hand back
  a :class:`ShardReceipt` (small; :func:`receipt_to_json` / :func:`receipt_from_json` carry it
  across processes without pickle); the coordinator commits them with
  ``Run.save(step, components, receipts=...)``. :class:`HostBuffers` are reusable host copies
  for an integration that snapshots state itself; :func:`check_savable` says early whether a
  state can be stored at all.
- **Find**: ``Run.latest(before_step=...)``, ``Run.checkpoint(step)`` and ``Run.load`` return
  :class:`CheckpointInfo` records (with their :class:`ComponentInfo`); no integration queries
  the manifest itself. A coordinator hands a record to ranks that never open the manifest as
  JSON: :func:`checkpoint_info_to_json` / :func:`checkpoint_info_from_json` (every field,
  checked).
- **Read**: a :class:`ComponentReader` per stored component (its index, any entries, a
  subtree), and a :class:`BlobCache` that a batch of byte-range reads shares (each blob fetched
  and verified once, or decoded and verified from bytes another rank sent); :func:`blob_ends`
  names the blobs a byte span of an entry touches and :func:`blob_key` a blob's object key.
  :class:`Entry` is what an index lists; :func:`torch_dtype` /
  :func:`torch_dtype_name` translate its dtype names, :data:`MAX_DIMS` bounds its shapes and
  :func:`check_digest` checks a digest read from a document; :func:`check_step` a step, and
  :func:`parse_step_id` reads one from a framework's checkpoint id (``30``, ``".../step-30"``);
  :class:`SourceTensor` / :class:`Piece` describe a sharded checkpoint's tensor as the entries
  that tile it; :func:`check_shape` / :func:`check_tiling` check such a tensor's declared
  layout (chunks inside it, not overlapping, covering it exactly) before anything is allocated.
  :func:`check_targets` refuses, before a byte is written, the caller's tensors that a load
  could not fill exactly (meta, self-overlapping, or sharing memory with another target).
  :class:`Staging` fills device (CUDA) tensors through reused pinned buffers and side streams,
  the host-to-device copies overlapped with the reads (what ``Run.load`` does for them).
- **Damage**: :func:`mark_corrupt` does what a load does with a checkpoint that fails
  verification; :class:`MissingBlobError` is the ``IntegrityError`` of a blob that is gone.
- **Where**: :func:`open_store` and :class:`ObjectStore`; :class:`WriterOptions` tune uploads;
  :func:`default_db` / :func:`default_store` are where a run goes when nothing is named, and
  one :class:`Database` may be handed to several ``open_run`` calls (a process that opens runs
  repeatedly keeps one connection pool).
- **Runs and their configs** (the trainer): :func:`config_fingerprint` (what ``open_run``
  compares), :func:`identity_changes` (the keys of a run's identity a new config would change:
  what ``open_run(identity=...)`` refuses), :func:`parse_duration` (``30s``, ``6h``,
  ``DD:HH:MM:SS``).
"""

from __future__ import annotations

from typing import Any

from ckptstore.cas.blobs import BlobRef, MissingBlobError
from ckptstore.cas.digest import blob_key, check_digest
from ckptstore.cas.header import Kind
from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer.open import config_fingerprint, identity_changes
from ckptstore.checkpointer.restore import mark_corrupt
from ckptstore.checkpointer.run import Run
from ckptstore.checkpointer.shards import ShardReceipt, ShardWriter
from ckptstore.checkpointer.snapshot import HostBuffers
from ckptstore.checkpointer.tiered import nearest_copies, writer_store
from ckptstore.durations import parse_duration
from ckptstore.manifest import Database
from ckptstore.manifest.records import (
    CheckpointInfo,
    ComponentInfo,
    checkpoint_info_from_json,
    checkpoint_info_to_json,
)
from ckptstore.names import check_step, parse_step_id
from ckptstore.objectstore import ObjectStore, open_store
from ckptstore.serialize.disjoint import check_targets
from ckptstore.serialize.dtypes import torch_dtype, torch_dtype_name
from ckptstore.serialize.index import MAX_DIMS, Entry
from ckptstore.serialize.pieces import Piece, SourceTensor
from ckptstore.serialize.reader import BlobCache, ComponentReader, blob_ends
from ckptstore.serialize.save import ComponentResult, flatten_state
from ckptstore.serialize.staging import Staging
from ckptstore.serialize.tiling import WRONG_METADATA, check_shape, check_tiling
from ckptstore.settings import default_db, default_store
from ckptstore.tiers import TierConfig
from ckptstore.tiers.nodes import check_node_name, node_name
from ckptstore.tiers.ray import RayTransport
from ckptstore.tiers.shared import check_nonce, put_nonce, remove_nonce

__all__ = [
    "MAX_DIMS",
    "WRONG_METADATA",
    "BlobCache",
    "blob_ends",
    "blob_key",
    "CheckpointInfo",
    "ComponentInfo",
    "ComponentReader",
    "Database",
    "Entry",
    "HostBuffers",
    "MissingBlobError",
    "TierConfig",
    "ObjectStore",
    "Piece",
    "RayTransport",
    "Run",
    "ShardReceipt",
    "ShardWriter",
    "SourceTensor",
    "Staging",
    "WriterOptions",
    "check_digest",
    "check_nonce",
    "checkpoint_info_from_json",
    "checkpoint_info_to_json",
    "check_savable",
    "check_shape",
    "check_tiling",
    "check_step",
    "check_targets",
    "config_fingerprint",
    "default_db",
    "default_store",
    "identity_changes",
    "parse_duration",
    "parse_step_id",
    "put_nonce",
    "mark_corrupt",
    "nearest_copies",
    "node_name",
    "open_store",
    "receipt_from_json",
    "receipt_to_json",
    "remove_nonce",
    "torch_dtype",
    "torch_dtype_name",
    "writer_store",
]


def check_savable(state: Any) -> None:
    """Raise ``SerializationError`` naming the path of the first value in ``state`` that
    ckptstore cannot store (before anything is uploaded); nothing is copied."""
    flatten_state(state)


def receipt_to_json(receipt: ShardReceipt) -> dict[str, Any]:
    """A receipt as plain JSON (to hand it to the committing process without pickle)."""
    result = receipt.result
    return {
        "component": receipt.component,
        "kind": receipt.kind,
        "started_at": receipt.started_at,
        "blocked_seconds": receipt.blocked_seconds,
        "upload_seconds": receipt.upload_seconds,
        "index_digest": result.index_digest,
        "entries": result.entries,
        "logical_bytes": result.logical_bytes,
        "blobs": [
            [b.digest, int(b.kind), b.codec, b.logical_bytes, b.stored_bytes, b.uploaded]
            for b in result.blobs
        ],
        "nodes": list(receipt.nodes),
    }


def receipt_from_json(doc: dict[str, Any]) -> ShardReceipt:
    """The receipt :func:`receipt_to_json` wrote (JSON the same job produced: the commit checks
    every blob it names against the store again)."""
    blobs = tuple(BlobRef(d, Kind(k), c, lb, sb, up) for d, k, c, lb, sb, up in doc["blobs"])
    result = ComponentResult(doc["index_digest"], doc["entries"], doc["logical_bytes"], blobs)
    return ShardReceipt(
        doc["component"],
        result,
        doc["kind"],
        doc["started_at"],
        doc["blocked_seconds"],
        doc["upload_seconds"],
        tuple(check_node_name(n, what="a receipt's node") for n in doc.get("nodes", ())),
    )
