"""``ckptstore verify``'s exit code is a gate scripts can trust (issue 22).

It exits 1 while anything is wrong: damage found now, a blob this process cannot read (reported,
never marked), or a checkpoint still marked corrupt from an earlier pass -- until that one is
repaired (good bytes stored again) or released (``ckptstore gc --release-corrupt``). A CI gate
must not turn green over a broken run because the pass that found the damage is over.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from ckptstore.cas.digest import blob_key
from ckptstore.cas.header import Header, decode_header
from ckptstore.checkpointer import CheckpointInfo, open_run
from ckptstore.cli import main
from ckptstore.objectstore import LocalStore
from ckptstore.serialize import read_index

#: float32 elements: above the pack threshold, so ``w`` is a chunk of its own.
LARGE = 300_000
HINT = (
    "  to repair: store good bytes again (save the same state again, or put the object back "
    "under its key), then `ckptstore verify --recheck`; to give up on it: "
    "`ckptstore gc --release-corrupt`"
)


def state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"policy": {"w": torch.randn(LARGE, generator=gen), "step": step}}


@pytest.fixture
def damaged(db_url: str, store: LocalStore) -> str:
    """Run 'r' with steps 1 and 2; a byte of step 2's chunk flipped. Returns its key."""
    with open_run("r", db=db_url, store=store) as run:
        run.save(1, state(1)).wait()
        info2 = run.save(2, state(2)).wait()
    key = blob_key(chunk_of(store, info2))
    data = bytearray((store.root / key).read_bytes())
    data[-1] ^= 0xFF
    (store.root / key).write_bytes(bytes(data))
    return key


def chunk_of(store: LocalStore, info: CheckpointInfo) -> str:
    return read_index(store, info.components[0].index_digest).entry("w").segments[0].digest


def verify(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["--db", db_url, "--store", str(store.root), *args])
    return code, capsys.readouterr().out


def statuses(db_url: str, store: LocalStore) -> list[tuple[int, str]]:
    with open_run("r", db=db_url, store=store, writable=False) as run:
        return [(c.step, c.status) for c in run.checkpoints()]


def test_verify_stays_red_while_a_checkpoint_is_still_marked_corrupt(
    db_url: str, store: LocalStore, damaged: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = verify(db_url, store, capsys, "verify")
    assert code == 1
    assert f"CORRUPT: run 'r' step 2 component 'policy': {store.url}/{damaged}" in out
    assert out.rstrip().endswith(": 1 problem(s) in 1 checkpoint(s), 1 marked corrupt")
    assert HINT in out.splitlines()
    assert statuses(db_url, store) == [(1, "committed"), (2, "corrupt")]

    # The next pass finds no new damage, but step 2 is still marked corrupt: still red.
    for _ in range(2):
        code, out = verify(db_url, store, capsys, "verify")
        assert code == 1, out
        lines = out.splitlines()
        assert lines[0].startswith("STILL CORRUPT: run 'r' step 2 is still marked corrupt: ")
        assert damaged in lines[0]  # why: the damaged blob
        assert lines[1] == HINT
        assert lines[2].endswith(": 1 checkpoint(s) still marked corrupt")
    code, out = verify(db_url, store, capsys, "--json", "verify")
    report = json.loads(out)
    assert code == 1
    assert report["problems"] == []
    assert [(c["run"], c["step"]) for c in report["still_corrupt"]] == [("r", 2)]
    assert damaged in report["still_corrupt"][0]["error"]
    # Scoped to a checkpoint that is fine, it is green.
    code, out = verify(db_url, store, capsys, "verify", "r@1")
    assert (code, out.rstrip()[-4:]) == (0, ": OK")

    # Repaired (the same state saved again stores good bytes): green again.
    with open_run("r", db=db_url, store=store) as run:
        run.save(3, state(2)).wait()
    assert statuses(db_url, store) == [(1, "committed"), (2, "committed"), (3, "committed")]
    code, out = verify(db_url, store, capsys, "verify")
    assert code == 0, out
    assert out.rstrip().endswith(": OK")


def test_verify_stays_red_until_the_corrupt_checkpoint_is_released(
    db_url: str, store: LocalStore, damaged: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert verify(db_url, store, capsys, "verify")[0] == 1
    assert (
        verify(db_url, store, capsys, "gc", "--grace", "0", "--dry-run", "--release-corrupt")[0]
        == 0
    )
    assert verify(db_url, store, capsys, "verify")[0] == 1  # a dry run releases nothing
    assert verify(db_url, store, capsys, "gc", "--release-corrupt")[0] == 0
    assert statuses(db_url, store) == [(1, "committed"), (2, "deleted")]
    code, out = verify(db_url, store, capsys, "verify")
    assert code == 0, out
    assert out.rstrip().endswith(": OK")


class FutureCodec:
    """A codec id this ckptstore does not know, as a newer ckptstore would write it."""

    id = 77
    name = "future"


def test_verify_reports_an_unreadable_blob_and_changes_nothing(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str]
) -> None:
    with open_run("r", db=db_url, store=store) as run:
        run.save(1, state(1)).wait()
        info2 = run.save(2, state(2)).wait()
    key = blob_key(chunk_of(store, info2))
    header = decode_header(memoryview((store.root / key).read_bytes()), key)
    payload = b"only a newer ckptstore decodes this"
    sealed = Header(header.kind, FutureCodec(), 1, header.raw_len, len(payload), header.digest)  # type: ignore[arg-type]
    (store.root / key).write_bytes(sealed.encode() + payload)
    objects = {i.key for i in store.list("")}

    code, out = verify(db_url, store, capsys, "verify")
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == f"UNREADABLE: run 'r' step 2 component 'policy': {store.url}/{key}"
    assert lines[1].startswith("  not marked (not proven damaged): ")
    assert "unknown blob codec id 77" in lines[1]
    assert lines[-1].endswith(": 1 problem(s) in 1 checkpoint(s), 0 marked corrupt")
    assert statuses(db_url, store) == [(1, "committed"), (2, "committed")]
    assert {i.key for i in store.list("")} == objects
    assert (store.root / key).read_bytes() == sealed.encode() + payload
