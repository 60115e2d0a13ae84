"""Checkpoints whose blobs get damaged, for the ``verify`` and ``gc`` command tests."""

from __future__ import annotations

from typing import Any

import torch
from populated import EMBED, OPTIONS, randn

from ckptstore.cas import blob_key, digest_bytes
from ckptstore.checkpointer import open_run
from ckptstore.cli import main
from ckptstore.objectstore import LocalStore


def verify_state(step: int) -> dict[str, Any]:
    """Three components, each with a chunk of its own that changes with the step."""
    return {
        "policy": {"w": randn(10 + step, 4096), "shared": EMBED},
        "optimizer": {"m": randn(20 + step, 4096), "step": step},
        "value": {"v": randn(30 + step, 4096)},
    }


def chunk_key(t: torch.Tensor) -> str:
    """The store key of the chunk blob that holds ``t``'s bytes."""
    return blob_key(digest_bytes(t.contiguous().numpy().tobytes()))


def damage(store: LocalStore) -> dict[str, tuple[str, str]]:
    """Flip a byte of step 2's policy chunk, truncate its optimizer chunk, delete its value
    chunk; returns component -> (key, expected kind)."""
    new = verify_state(2)
    flipped = chunk_key(new["policy"]["w"])
    truncated = chunk_key(new["optimizer"]["m"])
    missing = chunk_key(new["value"]["v"])
    path = store.root / flipped
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    path = store.root / truncated
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    (store.root / missing).unlink()
    return {
        "policy": (flipped, "corrupt"),
        "optimizer": (truncated, "corrupt"),
        "value": (missing, "missing"),
    }


def corrupt_shared_chunk(db_url: str, store: LocalStore) -> tuple[str, bytes]:
    """Steps 1 and 2 of run 'shared' both hold EMBED; one flipped byte of its chunk, found by
    `verify`, makes both corrupt. Returns the chunk's key and its good bytes."""
    with open_run("shared", db=db_url, store=store, writer_options=OPTIONS) as run:
        for step in (1, 2):
            run.save(step, verify_state(step)).wait()
    key = chunk_key(EMBED)
    good = (store.root / key).read_bytes()
    damaged = bytearray(good)
    damaged[-1] ^= 0xFF
    (store.root / key).write_bytes(bytes(damaged))
    assert main(["--db", db_url, "--store", str(store.root), "verify"]) == 1
    assert shared_statuses(db_url, store) == {1: "corrupt", 2: "corrupt"}
    return key, good


def shared_statuses(db_url: str, store: LocalStore) -> dict[int, str]:
    """Step -> status of run 'shared'."""
    with open_run("shared", db=db_url, store=store, writable=False) as run:
        return {c.step: c.status for c in run.checkpoints()}
