"""``ckptstore verify`` refuses DCP and Megatron metadata that a load refuses.

Each lying checkpoint is committed through the public API (crafted_checkpoints.py): every blob
is healthy and every digest valid, only the metadata lies about tensor 'w' (a gap, an overlap, a
chunk past the end, a size no store holds). Re-hashing the blobs finds nothing; verify must also
check the metadata as the loader does, report the checkpoint (run, step, tensor, why), mark it
corrupt without quarantining a blob, stay red on later passes and under ``--recheck``, and
change nothing with ``--no-mark``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from crafted_checkpoints import (
    DCP_LIES,
    MEGATRON_CONFIG,
    MEGATRON_LIES,
    MegatronCheckpoint,
    Shard,
    commit_dcp,
    commit_megatron,
    rows,
    whole,
)

import ckptstore
from ckptstore.checkpointer import Run, open_run
from ckptstore.cli import main
from ckptstore.integrations import dcp as ckpt_dcp
from ckptstore.objectstore import LocalStore

#: case -> (commits step 1 truthful and step 2 lying, the metadata component, a needle).
Lie = tuple[Callable[[Run], None], str, str]


def dcp_lie(name: str) -> Lie:
    tensor, _, needle = DCP_LIES[name]

    def commit(run: Run) -> None:
        commit_dcp(run, 1, {"w": whole(rows(256))})
        commit_dcp(run, 2, {"w": tensor})

    return commit, "dcp/metadata", needle


def megatron_lie(name: str) -> Lie:
    checkpoint, needle = MEGATRON_LIES[name]

    def commit(run: Run) -> None:
        commit_megatron(run, 1, MegatronCheckpoint([Shard("w", [256, 64], [0, 0], rows(256))]))
        commit_megatron(run, 2, checkpoint)

    return commit, "megatron/meta", needle


LIES: dict[str, Lie] = {
    "dcp_gap": dcp_lie("rows_left_out"),
    "dcp_overlap": dcp_lie("overlap_hides_a_gap"),
    "dcp_chunk_past_the_end": dcp_lie("chunk_past_the_end"),
    "dcp_claims_2_to_the_40_rows": dcp_lie("claims_2_to_the_40_rows"),
    "dcp_claims_2_to_the_70_rows": dcp_lie("claims_2_to_the_70_rows"),
    "dcp_dtype_disagrees_with_the_stored_bytes": dcp_lie("dtype_disagrees_with_the_stored_bytes"),
    "megatron_overlap_hides_a_gap": megatron_lie("overlap_hides_a_gap"),
    "megatron_claims_2_to_the_40_rows": megatron_lie("claims_2_to_the_40_rows"),
    "megatron_shards_disagree_on_the_shape": megatron_lie("shards_disagree_on_the_shape"),
}


def cli(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["--db", db_url, "--store", str(store.root), *args])
    return code, capsys.readouterr().out


def statuses(db_url: str, store: LocalStore) -> dict[int, str]:
    with open_run("lies", db=db_url, store=store, writable=False) as run:
        return {c.step: c.status for c in run.checkpoints()}


def objects(store: LocalStore) -> dict[str, bytes]:
    """Every object in the store and its bytes."""
    return {info.key: (store.root / info.key).read_bytes() for info in store.list("")}


def commit(db_url: str, store: LocalStore, case: str) -> None:
    with open_run("lies", db=db_url, store=store) as run:
        LIES[case][0](run)


@pytest.mark.parametrize("case", list(LIES))
def test_verify_marks_a_checkpoint_whose_metadata_lies_and_moves_no_blob(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    commit(db_url, store, case)
    _, component, needle = LIES[case]
    before = objects(store)

    code, out = cli(db_url, store, capsys, "--json", "verify")
    assert code == 1, out
    report = json.loads(out)
    [problem] = report["problems"]
    assert (problem["run"], problem["step"], problem["component"]) == ("lies", 2, component)
    assert problem["kind"] == "metadata"
    assert "tensor 'w'" in problem["detail"]
    assert needle in problem["detail"]
    assert "the checkpoint's metadata is wrong" in problem["detail"]
    assert report["marked"] == [{"run": "lies", "step": 2}]
    assert statuses(db_url, store) == {1: "committed", 2: "corrupt"}
    # The blobs are healthy: none was quarantined, moved or rewritten.
    assert objects(store) == before

    # Every later pass stays red, and --recheck cannot make it committed: the blobs verify, the
    # metadata is still wrong.
    for args in (["verify"], ["verify", "--recheck"]):
        code, out = cli(db_url, store, capsys, *args)
        assert code == 1, out
        [line] = [x for x in out.splitlines() if x.startswith("STILL CORRUPT:")]
        assert line.startswith(
            "STILL CORRUPT: run 'lies' step 2 is still marked corrupt: verify: wrong metadata: "
        )
        assert "tensor 'w'" in line
    assert statuses(db_url, store) == {1: "committed", 2: "corrupt"}
    assert objects(store) == before
    # The truthful checkpoint verifies clean.
    code, out = cli(db_url, store, capsys, "verify", "lies@1")
    assert (code, out.rstrip()[-4:]) == (0, ": OK"), out


@pytest.mark.parametrize("case", ["dcp_gap", "megatron_overlap_hides_a_gap"])
def test_verify_no_mark_reports_a_lying_checkpoint_and_marks_nothing(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    commit(db_url, store, case)
    _, component, _ = LIES[case]
    before = objects(store)
    for _ in range(2):
        code, out = cli(db_url, store, capsys, "verify", "--no-mark")
        assert code == 1, out
        lines = out.splitlines()
        assert lines[0].startswith(f"METADATA: run 'lies' step 2 component '{component}': ")
        assert lines[-1].endswith(": 1 problem(s) in 1 checkpoint(s), not marked (--no-mark)")
    code, out = cli(db_url, store, capsys, "--json", "verify", "--no-mark", "--recheck")
    assert code == 1, out
    assert "tensor 'w'" in json.loads(out)["problems"][0]["detail"]
    assert json.loads(out)["marked"] == []
    assert statuses(db_url, store) == {1: "committed", 2: "committed"}
    assert objects(store) == before


def test_recheck_keeps_a_checkpoint_the_load_fallback_marked_corrupt(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """A load marks the lying checkpoint corrupt (a writer falls back past it); every blob
    of it verifies, and still ``verify --recheck`` must not make it committed again."""
    commit(db_url, store, "dcp_overlap")
    target = {"w": torch.zeros(256, 64)}
    with open_run("lies", db=db_url, store=store) as run:
        assert ckpt_dcp.load(target, run).step == 1
    assert statuses(db_url, store) == {1: "committed", 2: "corrupt"}

    code, out = cli(db_url, store, capsys, "--json", "verify", "--recheck")
    assert code == 1, out
    report = json.loads(out)
    assert report["repaired"] == []
    [problem] = report["problems"]
    assert (problem["step"], problem["kind"]) == (2, "metadata")
    assert "tensor 'w'" in problem["detail"]
    assert statuses(db_url, store) == {1: "committed", 2: "corrupt"}


def test_a_megatron_meta_from_a_newer_ckptstore_is_unreadable_not_corrupt(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """A format version this ckptstore does not read is no proof of damage: reported (verify
    stays red), never marked."""
    meta: dict[str, Any] = {
        "format": "ckptstore-megatron",
        "version": 2,
        "metadata": MEGATRON_CONFIG,
        "world_size": 1,
        "layout": json.dumps({"tensors": [], "objects": []}),
    }
    with open_run("lies", db=db_url, store=store) as run:
        with ckptstore.ShardWriter(run.store) as writer:
            receipt = writer.write("megatron/rank0", {"t0": rows(4)})
        run.save(1, {"megatron/meta": meta}, receipts=[receipt]).wait()
    code, out = cli(db_url, store, capsys, "--json", "verify")
    assert code == 1, out
    report = json.loads(out)
    [problem] = report["problems"]
    assert (problem["step"], problem["kind"]) == (1, "unreadable")
    assert "version 2 is not supported" in problem["detail"]
    assert report["marked"] == []
    assert statuses(db_url, store) == {1: "committed"}
