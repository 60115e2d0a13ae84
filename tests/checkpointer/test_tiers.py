"""Node-local tiers through the library (DESIGN.md §13), on SQLite and PostgreSQL.

Three nodes are simulated on this machine as three tier directories (``tier-{node}``), reached
with the default PathTransport; a lost node loses its directory. Every test checks the bytes on
the tiers and in the store directly, not only through the run.
"""

from __future__ import annotations

import datetime as dt
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from counting_store import CountingStore
from sqlalchemy import create_engine, text

from ckptstore import ShardWriter, TierConfig, open_run, writer_store
from ckptstore.cas.digest import blob_key
from ckptstore.errors import CheckpointNotFoundError, ConfigError, SaveError
from ckptstore.extending import receipt_from_json, receipt_to_json
from ckptstore.maintenance import collect_garbage
from ckptstore.manifest import Database
from ckptstore.objectstore import LocalStore

NODES = ("a", "b", "c")

Tiers = Callable[..., TierConfig]


@pytest.fixture
def tiers(tmp_path: Path) -> Tiers:
    """``tiers(node, **options)``: node ``node``'s TierConfig over the three nodes' directories
    (each made, as its node would at start)."""
    template = str(tmp_path / "tier-{node}")
    for node in NODES:
        (tmp_path / f"tier-{node}").mkdir()

    def make(node: str, **options: Any) -> TierConfig:
        return TierConfig(local_dir=template, node=node, nodes=NODES, fsync=False, **options)

    return make


def state(seed: int, n: int = 20_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(n, generator=g),
        "b": torch.randn(64, generator=g),
        "s": torch.tensor(seed),
    }


def rows(db_url: str, sql: str) -> list[tuple[Any, ...]]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()


def tier_keys(tmp_path: Path, node: str) -> set[str]:
    root = tmp_path / f"tier-{node}"
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_local_save_is_committed_local_with_every_blob_fsynced_on_r_nodes(
    db_url: str, store: LocalStore, tiers: Tiers, tmp_path: Path
) -> None:
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        info = run.save(1, {"policy": state(1)}).wait()
        assert info.status == "local"
        assert run.latest() is not None
        assert run.latest().step == 1
    copies = rows(db_url, "SELECT digest, node FROM blob_copies ORDER BY digest, node")
    digests = {d for d, _ in copies}
    refs = {d for (d,) in rows(db_url, "SELECT digest FROM checkpoint_blobs")}
    assert digests == refs
    assert digests
    # The writer's node and the next one on the ring (R = 2 of 3 nodes), nothing elsewhere.
    assert {n for _, n in copies} == {"a", "b"}
    assert len(copies) == 2 * len(digests)
    for node in ("a", "b"):
        assert tier_keys(tmp_path, node) == {blob_key(d) for d in digests}
    assert tier_keys(tmp_path, "c") == set()
    assert list(store.list("cas/")) == []  # the store holds nothing yet
    assert rows(db_url, "SELECT COUNT(*) FROM blobs WHERE in_store") == [(0,)]


def test_receipts_on_too_few_nodes_or_in_the_store_are_refused_and_nothing_is_claimed(
    db_url: str, store: LocalStore, tiers: Tiers
) -> None:
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        one = TierConfig(local_dir=tiers("c").local_dir, node="c", nodes=NODES, replicas=1)
        with ShardWriter(writer_store(one)) as writer:
            lone = writer.write("rank2", state(2))
        assert lone.nodes == ("c",)
        with pytest.raises(SaveError, match="fewer than 2 tier copies"):
            run.save(1, {"policy": state(1)}, receipts=[lone]).wait()
        with ShardWriter(store) as writer:
            remote = writer.write("rank2", state(2))
        with pytest.raises(SaveError, match="stored in the object store, not on the tiers"):
            run.save(2, {"policy": state(1)}, receipts=[remote]).wait()
        assert [c.status for c in run.checkpoints()] == ["failed", "failed"]
    assert rows(db_url, "SELECT COUNT(*) FROM blob_copies") == [(0,)]


def test_a_copy_gone_before_the_commit_fails_the_save_and_claims_nothing(
    db_url: str, store: LocalStore, tiers: Tiers, tmp_path: Path
) -> None:
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        with ShardWriter(writer_store(tiers("b"))) as writer:
            receipt = writer.write("rank1", state(3))
        # The peer's copy vanishes between the writer's flush and the commit.
        lost = receipt.result.blobs[0].digest
        (tmp_path / "tier-c" / blob_key(lost)).unlink()
        with pytest.raises(SaveError, match=r"tier copies of step 1 are gone.*node 'c'"):
            run.save(1, {"policy": state(1)}, receipts=[receipt]).wait()
        assert run.latest() is None
    assert rows(db_url, "SELECT COUNT(*) FROM blob_copies") == [(0,)]
    assert rows(db_url, "SELECT status FROM checkpoints") == [("failed",)]


def test_a_receipt_carries_its_nodes_across_processes_as_json(tiers: Tiers) -> None:
    with ShardWriter(writer_store(tiers("b"))) as writer:
        receipt = writer.write("rank1", state(3))
    assert receipt_from_json(receipt_to_json(receipt)) == receipt
    doc = receipt_to_json(receipt) | {"nodes": ["../x"]}
    with pytest.raises(ConfigError, match="a receipt's node"):
        receipt_from_json(doc)


def test_consecutive_local_saves_deduplicate_by_content(
    db_url: str, store: LocalStore, tiers: Tiers
) -> None:
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        first = run.save(1, {"policy": state(1)}).wait()
        again = run.save(2, {"policy": state(1)}).wait()
    assert first.uploaded_bytes > 0
    assert again.uploaded_bytes == 0
    assert again.stored_bytes == first.stored_bytes


def test_a_drain_uploads_verified_copies_and_makes_the_checkpoint_remote_durable(
    db_url: str, store: LocalStore, tiers: Tiers
) -> None:
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        run.save(1, {"policy": state(1)})
        report = run.drain()
        assert report is not None
        assert report.drained
        assert report.uploaded_blobs > 0
        assert run.drain(1) is not None
        assert run.drain(1).uploaded_blobs == 0
        assert run.drain() is None  # nothing local is left
    assert rows(db_url, "SELECT status FROM checkpoints") == [("committed",)]
    assert rows(db_url, "SELECT COUNT(*) FROM blobs WHERE NOT in_store") == [(0,)]
    # A reader that knows only the store loads it now.
    with open_run("r", db=db_url, store=store, writable=False) as reader:
        assert equal(reader.load().state["policy"], state(1))


def test_a_drain_interrupted_midway_stays_local_and_the_next_one_sends_the_rest(
    db_url: str, tmp_path: Path, tiers: Tiers, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        run.save(1, {"policy": state(1), "other": state(5)})
        sent: list[str] = []
        put = LocalStore.put

        def failing(self: LocalStore, key: str, data: Any) -> bool:
            if self is store and len(sent) >= 2:
                raise OSError("the network went away")
            sent.append(key)
            return put(self, key, data)

        monkeypatch.setattr(LocalStore, "put", failing)
        with pytest.raises(OSError, match="network"):
            run.drain()
        assert [c.status for c in run.checkpoints()] == ["local"]
        monkeypatch.setattr(LocalStore, "put", put)
        report = run.drain()
        assert report is not None
        assert report.drained
        assert report.present_blobs >= 2  # the first drain's uploads were not sent again
    assert rows(db_url, "SELECT status FROM checkpoints") == [("committed",)]


def test_a_drain_never_marks_what_the_store_does_not_hold(
    db_url: str, store: LocalStore, tiers: Tiers, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        run.save(1, {"policy": state(1)})
        flush = LocalStore.flush

        def lose_one(self: LocalStore) -> None:
            flush(self)
            if self is store:  # an upload vanishes before the drain's commit checks the store
                first = next(iter(store.list("cas/")))
                store.delete([first.key])

        monkeypatch.setattr(LocalStore, "flush", lose_one)
        with pytest.raises(SaveError, match=r"not in the store.*stays local-durable"):
            run.drain()
        assert [c.status for c in run.checkpoints()] == ["local"]


def test_a_drain_that_cannot_end_before_its_deadline_sends_nothing_and_says_so(
    db_url: str, store: LocalStore, tiers: Tiers
) -> None:
    import time

    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        run.save(1, {"policy": state(1)})
        report = run.drain(deadline=time.monotonic() + 0.1)
        assert report is not None
        assert not report.drained
        assert report.stopped is not None
        assert "deadline" in report.stopped
        assert [c.status for c in run.checkpoints()] == ["local"]
    assert list(store.list("cas/")) == []


def test_a_lost_node_is_recovered_from_its_peers_without_reading_the_store(
    db_url: str, store: LocalStore, tiers: Tiers, tmp_path: Path
) -> None:
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        run.save(1, {"policy": state(1)})
        run.drain()
        run.save(2, {"policy": state(2)})  # local only: newer than anything in the store
    shutil.rmtree(tmp_path / "tier-a")  # node a is lost with its disk
    with open_run("r", db=db_url, store=store, tiers=tiers("b"), async_save=False) as run:
        loaded = run.load()
    assert loaded.info.step == 2
    assert loaded.info.status == "local"
    assert equal(loaded.state["policy"], state(2))
    assert set(loaded.read_bytes) == {"b"}  # every byte from the surviving replica


def test_with_one_replica_a_lost_node_reads_from_the_store_only_what_it_alone_held(
    db_url: str, tmp_path: Path, tiers: Tiers
) -> None:
    store = CountingStore(tmp_path / "store")
    solo = {n: tiers(n, replicas=1) for n in NODES}
    with open_run("r", db=db_url, store=store, tiers=solo["a"], async_save=False) as run:
        receipts = []
        for node, seed in (("b", 11), ("c", 12)):
            with ShardWriter(writer_store(solo[node])) as writer:
                receipts.append(writer.write(f"rank-{node}", state(seed)))
        run.save(1, {"policy": state(10)}, receipts=receipts)
        assert run.drain() is not None
    lost = {ref.digest for ref in receipts[1].result.blobs}  # what node c alone held
    shutil.rmtree(tmp_path / "tier-c")
    store.reads.clear()
    with open_run("r", db=db_url, store=store, tiers=solo["a"], async_save=False) as run:
        loaded = run.load()
    assert equal(loaded.state["rank-c"], state(12))
    assert equal(loaded.state["rank-b"], state(11))
    assert set(store.reads) == {blob_key(d) for d in lost}
    assert loaded.read_bytes["store"] == sum(
        (tmp_path / "store" / blob_key(d)).stat().st_size for d in lost
    )


def test_a_damaged_tier_copy_is_skipped_for_the_next_one_and_forgotten(
    db_url: str, store: LocalStore, tiers: Tiers, tmp_path: Path
) -> None:
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        info = run.save(1, {"policy": state(1)}).wait()
    big = max(
        rows(
            db_url,
            f"SELECT b.digest, b.stored_bytes FROM blobs b JOIN checkpoint_blobs c "
            f"ON c.digest = b.digest WHERE c.checkpoint_id = {info.id}",
        ),
        key=lambda r: r[1],
    )[0]
    path = tmp_path / "tier-a" / blob_key(big)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # one flipped bit in the payload: the digest catches it
    path.write_bytes(bytes(data))
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        loaded = run.load()
    assert equal(loaded.state["policy"], state(1))
    assert loaded.read_bytes.get("b", 0) > 0
    assert rows(db_url, f"SELECT node FROM blob_copies WHERE digest = '{big}'") == [("b",)]


def test_a_checkpoint_whose_only_copy_is_damaged_falls_back_to_the_older_one(
    db_url: str, store: LocalStore, tiers: Tiers, tmp_path: Path
) -> None:
    solo = tiers("a", replicas=1)
    with open_run("r", db=db_url, store=store, tiers=solo, async_save=False) as run:
        run.save(1, {"policy": state(1)})
        run.drain()
        run.save(2, {"policy": state(2)})
    only = {d for (d,) in rows(db_url, "SELECT digest FROM blobs WHERE NOT in_store")}
    for digest in only:
        path = tmp_path / "tier-a" / blob_key(digest)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    with open_run("r", db=db_url, store=store, tiers=solo, async_save=False) as run:
        loaded = run.load()
        assert loaded.info.step == 1
        assert [s for s, _ in loaded.skipped] == [2]
        assert equal(loaded.state["policy"], state(1))
        # Step 2 is no longer recoverable from here: its bad copies were forgotten.
        assert run.latest() is not None
        assert run.latest().step == 1
        with pytest.raises(CheckpointNotFoundError, match="local-durable, but"):
            run.load(2)


def test_gc_keeps_the_blobs_of_local_checkpoints(
    db_url: str, store: LocalStore, tiers: Tiers
) -> None:
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        run.save(1, {"policy": state(1)})
    db = Database(db_url)
    try:
        collect_garbage(db, store, grace=dt.timedelta(0))
        collect_garbage(db, store, grace=dt.timedelta(0))
    finally:
        db.close()
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        assert equal(run.load().state["policy"], state(1))
        assert run.drain() is not None
    assert rows(db_url, "SELECT status FROM checkpoints") == [("committed",)]


def test_each_tier_keeps_the_last_k_checkpoints_and_every_undrained_one(
    db_url: str, store: LocalStore, tiers: Tiers, tmp_path: Path
) -> None:
    keep = tiers("a", keep_last=1)
    with open_run("r", db=db_url, store=store, tiers=keep, async_save=False) as run:
        first = run.save(1, {"policy": state(1)}).wait()
        second = run.save(2, {"policy": state(2)}).wait()
        # Step 1 is local and undrained: its copies stay although it is not the newest.
        assert {blob_key(d) for d in digests_of(db_url, first.id)} <= tier_keys(tmp_path, "a")
        run.drain(2)
        # Step 2 is remote now and newer: step 1 is dropped (it was never drained) ...
        assert [c.status for c in run.checkpoints()] == ["deleted", "committed"]
        # ... and once step 3 is saved it is the one newest checkpoint a tier keeps (K = 1):
        # step 2's copies go too (it is in the store).
        third = run.save(3, {"policy": state(3)}).wait()
    assert second.status == "local"
    assert tier_keys(tmp_path, "a") == {blob_key(d) for d in digests_of(db_url, third.id)}
    assert rows(db_url, "SELECT DISTINCT node FROM blob_copies ORDER BY node") == [("a",), ("b",)]


def digests_of(db_url: str, checkpoint_id: int) -> set[str]:
    return {
        d
        for (d,) in rows(
            db_url, f"SELECT digest FROM checkpoint_blobs WHERE checkpoint_id = {checkpoint_id}"
        )
    }


def test_a_writer_sweeps_what_the_manifest_does_not_know_from_its_tier_at_start(
    db_url: str, store: LocalStore, tiers: Tiers, tmp_path: Path
) -> None:
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        run.save(1, {"policy": state(1)})
    known = tier_keys(tmp_path, "a")
    # A crash between the copies and the commit leaves an object no row knows.
    orphan = LocalStore(tmp_path / "tier-a", fsync=False)
    from ckptstore.cas import Kind
    from ckptstore.cas.blobs import put_blob

    ref = put_blob(orphan, b"left by a crash" * 100, Kind.CHUNK)
    assert blob_key(ref.digest) in tier_keys(tmp_path, "a")
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), writable=False):
        assert blob_key(ref.digest) in tier_keys(tmp_path, "a")  # a reader changes nothing
    with open_run("r", db=db_url, store=store, tiers=tiers("a")):
        pass
    assert tier_keys(tmp_path, "a") == known


def test_saving_local_without_tiers_is_refused_with_the_fix(db_url: str, store: LocalStore) -> None:
    with open_run("r", db=db_url, store=store, async_save=False) as run:
        with pytest.raises(ConfigError, match="tiers=TierConfig"):
            run.save(1, {"policy": state(1)}, durability="local")
        with pytest.raises(ConfigError, match="no node-local tiers to drain"):
            run.drain()


def test_gc_with_local_dir_cleans_the_tiers_it_reaches_of_what_no_row_knows(
    db_url: str, store: LocalStore, tiers: Tiers, tmp_path: Path
) -> None:
    from ckptstore.cas import Kind
    from ckptstore.cas.blobs import put_blob

    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        run.save(1, {"policy": state(1)})
    known = {n: tier_keys(tmp_path, n) for n in NODES}
    stray = put_blob(LocalStore(tmp_path / "tier-b", fsync=False), b"orphan" * 64, Kind.CHUNK)
    db = Database(db_url)
    try:
        grace = dt.timedelta(0)
        dry = collect_garbage(db, store, grace=grace, dry_run=True, tiers=tiers("a"))
        assert (dry.tier_orphans, dry.tier_nodes) == (1, ["a", "b", "c"])
        assert blob_key(stray.digest) in tier_keys(tmp_path, "b")  # a dry run changes nothing
        report = collect_garbage(db, store, grace=grace, tiers=tiers("a"))
    finally:
        db.close()
    assert report.tier_orphans == 1
    assert {n: tier_keys(tmp_path, n) for n in NODES} == known  # the local checkpoint's stay
    with open_run("r", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        assert equal(run.load().state["policy"], state(1))


def test_a_dcp_save_and_load_of_a_run_with_tiers_go_through_the_tiers(
    db_url: str, store: LocalStore, tiers: Tiers, tmp_path: Path
) -> None:
    from ckptstore.integrations import dcp as ckpt_dcp

    saved = {"model": state(7), "step": 7}
    with open_run("d", db=db_url, store=store, tiers=tiers("a"), async_save=False) as run:
        info = ckpt_dcp.save(saved, run, 7)
        assert info is not None
        assert info.status == "local"
        assert list(store.list("cas/")) == []
    shutil.rmtree(tmp_path / "tier-a")  # the coordinator's node is lost: node b holds a copy
    with open_run("d", db=db_url, store=store, tiers=tiers("c"), async_save=False) as run:
        target = {"model": {k: torch.zeros_like(v) for k, v in state(7).items()}, "step": 0}
        loaded = ckpt_dcp.load(target, run)
    assert loaded.step == 7
    assert equal(target["model"], state(7))
    assert target["step"] == 7


def test_a_run_that_ends_with_a_drain_leaves_its_tiers_bounded(
    db_url: str, store: LocalStore, tiers: Tiers, tmp_path: Path
) -> None:
    solo = tiers("a", replicas=1)
    with open_run("r", db=db_url, store=store, tiers=solo, async_save=False) as run:
        infos = [run.save(step, {"policy": state(step)}).wait() for step in range(1, 7)]
        run.drain()
    # Steps 1-4 were made unnecessary by the drain of step 6: closing the run dropped their
    # copies; the tier keeps the keep_last=2 newest (5: local, 6: remote).
    kept = digests_of(db_url, infos[4].id) | digests_of(db_url, infos[5].id)
    assert tier_keys(tmp_path, "a") == {blob_key(d) for d in kept}
    assert {d for (d,) in rows(db_url, "SELECT digest FROM blob_copies")} == kept
