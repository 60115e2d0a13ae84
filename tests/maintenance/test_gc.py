"""Garbage collection (DESIGN.md §8) on real SQLite and PostgreSQL manifests and a real LocalStore.

- mark and sweep: what a pass condemns and deletes, what it never touches, orphan objects,
  ``dry_run``, the single-GC lease, and a condemned blob revived by a new commit;
- GC running in a loop while several writers save overlapping states and retention deletes:
  afterwards every committed checkpoint loads bit-exactly, ``verify`` is clean, and a final
  GC with grace 0 leaves exactly the blobs committed checkpoints reference.

Ages are set by writing old timestamps into the manifest (``last_claimed_at``,
``condemned_at``) or old modification times on the store's files (``os.utime``) — the same
values time would produce, without waiting for it.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from pg_waits import wait_for_a_lock_waiter
from sqlalchemy import select, update

from ckptstore.cas import Kind, blob_key, digest_from_key, put_blob
from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer import RetentionPolicy, Run, open_run
from ckptstore.errors import ObjectStoreError, SaveError
from ckptstore.maintenance import GcBusyError, GcReport, collect_garbage, verify
from ckptstore.maintenance.gc import LEASE_TTL, gc_lease
from ckptstore.manifest import Database
from ckptstore.manifest.models import (
    BlobRow,
    BlobState,
    CheckpointBlobRow,
    CheckpointRow,
    GcLeaseRow,
    Status,
    utcnow,
)
from ckptstore.objectstore import LocalStore, ObjectInfo
from ckptstore.serialize.compare import first_difference

#: Tensors of 1 KiB and more get chunk blobs of their own, so small states still show which
#: blobs steps share; smaller values go into packs.
OPTIONS = WriterOptions(pack_threshold=1024)
NOW = dt.timedelta(0)
HOUR = dt.timedelta(hours=1)


# -- helpers ---------------------------------------------------------------------------------------


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Components bit-exact (a load returns components in name order, not save order)."""
    assert sorted(actual) == sorted(expected)
    for name, state in expected.items():
        diff = first_difference(actual[name], state, name)
        assert diff is None, diff


def tensor(seed: int, numel: int = 2048, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def state(step: int) -> dict[str, Any]:
    """``embed`` is the same at every step (one shared blob); the rest changes per step."""
    return {
        "policy": {"embed": tensor(0), "w": tensor(100 + step), "b": tensor(200 + step, 64)},
        "optimizer": {"step": torch.tensor(step), "lr": 1e-3 * step},
    }


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database(db_url)
    yield database
    database.close()


def open_test_run(db: Database, store: LocalStore, name: str, keep: int | None = None) -> Run:
    return open_run(
        name,
        db=db,
        store=store,
        retention=RetentionPolicy(keep_top_k=keep),
        writer_options=OPTIONS,
        async_save=False,
    )


def referenced(db: Database, checkpoint_id: int) -> set[str]:
    with db.read() as session:
        return set(
            session.scalars(
                select(CheckpointBlobRow.digest).where(
                    CheckpointBlobRow.checkpoint_id == checkpoint_id
                )
            )
        )


def committed_references(db: Database) -> set[str]:
    with db.read() as session:
        return set(
            session.scalars(
                select(CheckpointBlobRow.digest)
                .join(CheckpointRow, CheckpointRow.id == CheckpointBlobRow.checkpoint_id)
                .where(CheckpointRow.status == Status.COMMITTED)
            )
        )


def blob_rows(db: Database) -> dict[str, tuple[str, int, Any, Any]]:
    """digest -> (state, stored_bytes, last_claimed_at, condemned_at)."""
    with db.read() as session:
        return {
            b.digest: (b.state, b.stored_bytes, b.last_claimed_at, b.condemned_at)
            for b in session.scalars(select(BlobRow))
        }


def cas_objects(store: LocalStore) -> dict[str, int]:
    """digest -> size of every blob object in the store."""
    found = {}
    for info in store.list("cas/"):
        digest = digest_from_key(info.key)
        assert digest is not None, f"unexpected object {info.key}"
        found[digest] = info.size
    return found


def store_listing(store: LocalStore) -> dict[str, tuple[int, float]]:
    """Every object (any prefix) -> (size, mtime)."""
    return {info.key: (info.size, info.mtime) for info in store.list("")}


def age_blob_rows(db: Database, digests: set[str] | None, column: str, by: dt.timedelta) -> None:
    """Move ``column`` of some (or all) blob rows ``by`` into the past."""
    stamp = utcnow() - by

    def transaction(session: Any) -> None:
        query = update(BlobRow).values({column: stamp})
        if digests is not None:
            query = query.where(BlobRow.digest.in_(sorted(digests)))
        session.execute(query)

    db.write(transaction)


def age_object(store: LocalStore, key: str, by: dt.timedelta) -> None:
    when = time.time() - by.total_seconds()
    os.utime(store.root / key, (when, when))


def report_counts(report: GcReport) -> tuple[int, int, int]:
    return report.condemned, report.swept, report.orphans


# -- mark and sweep --------------------------------------------------------------------------------


def test_blob_only_a_deleted_checkpoint_references_is_condemned_and_swept(
    db: Database, store: LocalStore
) -> None:
    with open_test_run(db, store, "deleted", keep=1) as run:
        first = run.save(1, state(1)).wait()
        second = run.save(2, state(2)).wait()
        assert [(c.step, c.status) for c in run.checkpoints()] == [(1, "deleted"), (2, "committed")]

        garbage = referenced(db, first.id) - referenced(db, second.id)
        kept = referenced(db, second.id)
        assert garbage, "steps 1 and 2 should not share every blob"
        shared = referenced(db, first.id) & kept
        assert shared, "the embedding is shared between the steps"
        rows = blob_rows(db)
        garbage_bytes = sum(rows[d][1] for d in garbage)

        report = collect_garbage(db, store, grace=NOW)
        # With grace 0 the blobs are condemned and, being condemned "long enough", swept in
        # the same pass.
        assert (report.condemned, report.condemned_bytes) == (len(garbage), garbage_bytes)
        assert (report.swept, report.swept_bytes) == (len(garbage), garbage_bytes)
        assert (report.orphans, report.errors) == (0, [])

        rows, objects = blob_rows(db), cas_objects(store)
        assert not garbage & set(rows), "swept rows are gone"
        assert not garbage & set(objects), "swept objects are gone"
        # The deleted checkpoint's references to swept blobs went with them.
        assert referenced(db, first.id) == shared
        assert set(rows) == set(objects) == kept
        assert {rows[d][0] for d in kept} == {BlobState.LIVE}

        assert_same(run.load().state, state(2))
        assert verify(db, store).problems == []
        # Nothing left to do.
        assert report_counts(collect_garbage(db, store, grace=NOW)) == (0, 0, 0)


class DeletesThenFails(LocalStore):
    """A local store whose ``delete`` removes the first half of the keys it is given, after a
    pause (so the sweep's row deletes run while it works), then fails."""

    def delete(self, keys: Any) -> None:
        listed = list(keys)
        time.sleep(0.05)
        super().delete(listed[: len(listed) // 2])
        raise ObjectStoreError("injected: the store failed halfway through a batch delete")


def test_a_sweep_whose_object_deletes_fail_keeps_its_rows_and_the_next_gc_finishes(
    db: Database, store: LocalStore
) -> None:
    """The sweep deletes a batch's objects on another thread while it deletes their rows; when
    the store fails, the rows' deletes are rolled back (they stay condemned, their objects
    half gone), nothing committed loses a blob, and the next GC sweeps the rest."""
    with open_test_run(db, store, "failing-deletes", keep=1) as run:
        first = run.save(1, state(1)).wait()
        second = run.save(2, state(2)).wait()
        garbage = referenced(db, first.id) - referenced(db, second.id)
        kept = referenced(db, second.id)
        assert len(garbage) >= 2

        failing = DeletesThenFails(store.root)
        with pytest.raises(ObjectStoreError, match="injected"):
            collect_garbage(db, failing, grace=NOW)
        rows, objects = blob_rows(db), cas_objects(store)
        assert garbage <= set(rows), "the failed batch's row deletes were rolled back"
        assert {rows[d][0] for d in garbage} == {BlobState.CONDEMNED}
        assert kept <= set(objects), "no committed blob was touched"
        assert 0 < len(garbage - set(objects)) < len(garbage), "half the objects went"
        assert_same(run.load().state, state(2))

        report = collect_garbage(db, store, grace=NOW)
        assert report.swept == len(garbage)
        assert set(blob_rows(db)) == set(cas_objects(store)) == kept
        assert verify(db, store).problems == []


def test_blobs_of_committed_checkpoints_are_never_touched(db: Database, store: LocalStore) -> None:
    with open_test_run(db, store, "kept") as run:
        for step in (1, 2, 3):
            run.save(step, state(step))
        before_rows = blob_rows(db)
        # As old as can be: claimed and created long ago, objects written long ago.
        age_blob_rows(db, None, "last_claimed_at", dt.timedelta(days=30))
        age_blob_rows(db, None, "created_at", dt.timedelta(days=30))
        for digest in before_rows:
            age_object(store, blob_key(digest), dt.timedelta(days=30))
        objects = cas_objects(store)

        for grace in (NOW, HOUR):
            report = collect_garbage(db, store, grace=grace)
            assert report_counts(report) == (0, 0, 0)

        rows = blob_rows(db)
        assert set(rows) == set(before_rows) == set(objects) == committed_references(db)
        assert {r[0] for r in rows.values()} == {BlobState.LIVE}
        assert cas_objects(store) == objects
        for step in (1, 2, 3):
            assert_same(run.load(step=step).state, state(step))


def test_orphan_objects_older_than_the_grace_are_deleted(db: Database, store: LocalStore) -> None:
    old = put_blob(store, b"an old orphan: its save crashed before the commit" * 20, Kind.CHUNK)
    young = put_blob(store, b"a young orphan: its save may still commit" * 20, Kind.CHUNK)
    age_object(store, blob_key(old.digest), 2 * HOUR)
    # Objects GC does not own: outside cas/, or under cas/ without a blob key.
    store.put("quarantine/somebody-elses", b"x")
    store.put("cas/zz/not-a-digest", b"x")
    for key in ("quarantine/somebody-elses", "cas/zz/not-a-digest"):
        age_object(store, key, 2 * HOUR)
    old_size = store.head(blob_key(old.digest)).size

    report = collect_garbage(db, store, grace=HOUR)
    assert (report.orphans, report.orphan_bytes) == (1, old_size)
    assert (report.condemned, report.swept) == (0, 0)
    keys = set(store_listing(store))
    assert blob_key(old.digest) not in keys
    assert {blob_key(young.digest), "quarantine/somebody-elses", "cas/zz/not-a-digest"} <= keys

    report = collect_garbage(db, store, grace=NOW)
    assert report.orphans == 1
    assert set(store_listing(store)) == {"quarantine/somebody-elses", "cas/zz/not-a-digest"}


def test_dry_run_reports_counts_and_bytes_and_changes_nothing(
    db: Database, store: LocalStore
) -> None:
    with open_test_run(db, store, "dry", keep=1) as run:
        first = run.save(1, state(1)).wait()
        second = run.save(2, state(2)).wait()
    garbage = referenced(db, first.id) - referenced(db, second.id)
    garbage_bytes = sum(blob_rows(db)[d][1] for d in garbage)
    orphan = put_blob(store, b"orphan bytes" * 50, Kind.CHUNK)
    age_object(store, blob_key(orphan.digest), 3 * HOUR)
    orphan_bytes = store.head(blob_key(orphan.digest)).size

    def snapshot() -> tuple[Any, ...]:
        return blob_rows(db), store_listing(store), committed_references(db)

    before = snapshot()
    dry = collect_garbage(db, store, grace=NOW, dry_run=True)
    assert dry.dry_run
    assert (dry.condemned, dry.condemned_bytes) == (len(garbage), garbage_bytes)
    assert (dry.orphans, dry.orphan_bytes) == (1, orphan_bytes)
    assert (dry.swept, dry.swept_bytes) == (0, 0)  # nothing is condemned yet
    assert snapshot() == before

    # A real pass that condemns but cannot sweep yet (condemned just now, grace 1 h) ...
    age_blob_rows(db, garbage, "last_claimed_at", 2 * HOUR)
    real = collect_garbage(db, store, grace=HOUR)
    assert (real.condemned, real.condemned_bytes, real.swept) == (len(garbage), garbage_bytes, 0)
    assert (real.orphans, real.orphan_bytes) == (1, orphan_bytes)
    assert {blob_rows(db)[d][0] for d in garbage} == {BlobState.CONDEMNED}

    # ... then, once the condemnation is old enough, a dry run counts what the sweep would do.
    age_blob_rows(db, garbage, "condemned_at", 2 * HOUR)
    before = snapshot()
    dry = collect_garbage(db, store, grace=HOUR, dry_run=True)
    assert (dry.condemned, dry.swept, dry.swept_bytes) == (0, len(garbage), garbage_bytes)
    assert dry.orphans == 0
    assert snapshot() == before

    real = collect_garbage(db, store, grace=HOUR)
    assert (real.swept, real.swept_bytes) == (len(garbage), garbage_bytes)
    assert not garbage & set(blob_rows(db))
    assert not garbage & set(cas_objects(store))


def test_only_one_gc_at_a_time(db: Database, store: LocalStore) -> None:
    with gc_lease(db, holder="first-gc"):
        with pytest.raises(GcBusyError, match="first-gc"):
            collect_garbage(db, store, grace=NOW)
        with pytest.raises(GcBusyError):
            collect_garbage(db, store, grace=NOW, dry_run=True)
    # Released at the end of the block.
    assert report_counts(collect_garbage(db, store, grace=NOW)) == (0, 0, 0)
    with db.read() as session:
        assert session.scalars(select(GcLeaseRow)).all() == []

    # A lease whose holder died expires; the next GC takes it over.
    db.write(
        lambda s: s.add(
            GcLeaseRow(id=1, holder="dead-host:1:0", expires_at=utcnow() - dt.timedelta(minutes=1))
        )
    )
    collect_garbage(db, store, grace=NOW)
    with db.read() as session:
        assert session.scalars(select(GcLeaseRow)).all() == []
    # A live lease of another process (another host's GC) is respected.
    db.write(
        lambda s: s.add(GcLeaseRow(id=1, holder="live-host:2:0", expires_at=utcnow() + LEASE_TTL))
    )
    with pytest.raises(GcBusyError, match="live-host"):
        collect_garbage(db, store, grace=NOW)


@pytest.mark.integration
def test_two_gcs_starting_together_on_postgresql(pg_schema_url: str, store: LocalStore) -> None:
    first_db, second_db = Database(pg_schema_url), Database(pg_schema_url)
    inserted, release = threading.Event(), threading.Event()
    outcome: dict[str, BaseException | GcReport] = {}

    def first_gc_taking_the_lease(session: Any) -> None:
        # What gc_lease() does on an empty table, stopped between its INSERT and its COMMIT.
        session.add(GcLeaseRow(id=1, holder="first-gc", expires_at=utcnow() + LEASE_TTL))
        session.flush()
        inserted.set()
        release.wait(30)

    def second_gc() -> None:
        try:
            outcome["second"] = collect_garbage(second_db, store, grace=NOW)
        except BaseException as exc:
            outcome["second"] = exc

    first = threading.Thread(target=lambda: first_db.write(first_gc_taking_the_lease))
    first.start()
    second = None
    try:
        assert inserted.wait(30)
        second = threading.Thread(target=second_gc)
        second.start()
        # Wait until the second GC is blocked on the first one's uncommitted lease row.
        wait_for_a_lock_waiter(first_db.engine, "the second GC never reached the lease")
    finally:
        release.set()
        first.join(30)
        if second is not None:
            second.join(30)
        first_db.close()
        second_db.close()
    assert isinstance(outcome["second"], GcBusyError), repr(outcome["second"])


def test_condemned_blob_revived_by_a_new_commit_survives_the_sweep(
    db: Database, store: LocalStore
) -> None:
    with open_test_run(db, store, "revive", keep=1) as run:
        first = run.save(1, state(1)).wait()
        second = run.save(2, state(2)).wait()
        only_first = referenced(db, first.id) - referenced(db, second.id)
        # Step 1's blobs were last claimed long ago: a GC with a 1 h grace condemns them now
        # and could sweep them in an hour.
        age_blob_rows(db, only_first, "last_claimed_at", 2 * HOUR)
        report = collect_garbage(db, store, grace=HOUR)
        assert (report.condemned, report.swept) == (len(only_first), 0)
        assert {blob_rows(db)[d][0] for d in only_first} == {BlobState.CONDEMNED}

        # Training goes back to step 1's weights: the commit claims the condemned blobs.
        third = run.save(3, state(1)).wait()
        revived = only_first & referenced(db, third.id)
        assert revived, "step 3 references step 1's condemned chunks"
        rows = blob_rows(db)
        assert {rows[d][0] for d in revived} == {BlobState.LIVE}

        # Even once the old condemnation is past the grace, the sweep leaves them.
        age_blob_rows(db, revived, "condemned_at", 2 * HOUR)
        report = collect_garbage(db, store, grace=NOW)
        assert not revived & {d for d, r in blob_rows(db).items() if r[0] != BlobState.LIVE}
        assert revived <= set(cas_objects(store))
        assert revived <= set(blob_rows(db))
        assert_same(run.load().state, state(1))
        assert verify(db, store).problems == []


class SweepingStore(LocalStore):
    """A real LocalStore that runs ``gc`` the first time ``trigger`` is probed: a GC pass that
    lands while a save is between its upload checks and its commit."""

    def __init__(self, root: Any, gc: Callable[[], GcReport]) -> None:
        super().__init__(root, fsync=False)
        self.gc = gc
        self.trigger: str | None = None
        self.reports: list[GcReport] = []

    def head(self, key: str) -> ObjectInfo:
        if key == self.trigger:
            self.trigger = None
            self.reports.append(self.gc())
        return super().head(key)


def test_sweep_between_a_saves_uploads_and_its_commit_fails_the_save_safely(
    db: Database, db_url: str, tmp_path: Any
) -> None:
    gc_db = Database(db_url)
    store = SweepingStore(tmp_path / "store", lambda: collect_garbage(gc_db, store, grace=NOW))
    try:
        sweep_during_a_save(db, store)
    finally:
        store.close()
        gc_db.close()


def sweep_during_a_save(db: Database, store: SweepingStore) -> None:
    with open_test_run(db, store, "race", keep=1) as run:
        first = run.save(1, state(1)).wait()
        second = run.save(2, state(2)).wait()
        only_first = referenced(db, first.id) - referenced(db, second.id)
        age_blob_rows(db, only_first, "last_claimed_at", 2 * HOUR)
        assert collect_garbage(db, store, grace=HOUR).condemned == len(only_first)

        # Training goes back to step 1's state. Its chunks are condemned but still stored, so
        # the save reuses them; then, as it checks the policy index, a GC sweeps them all.
        policy_index = next(c.index_digest for c in first.components if c.name == "policy")
        assert policy_index in only_first
        store.trigger = blob_key(policy_index)
        with pytest.raises(SaveError, match="missing"):
            run.save(3, state(1))
        assert store.trigger is None
        assert store.reports[0].swept == len(only_first)
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "deleted"),
            (2, "committed"),
            (3, "failed"),
        ]
        loaded = run.load()
        assert loaded.info.step == 2
        assert_same(loaded.state, state(2))

        # The next save uploads the bytes again.
        info = run.save(4, state(1)).wait()
        assert info.uploaded_bytes > 0
        loaded = run.load()
        assert loaded.info.step == 4
        assert_same(loaded.state, state(1))
        assert verify(db, store).problems == []


# -- GC in a loop while writers save and retention deletes ----------------------------------------


def gc_state(writer: int, step: int) -> dict[str, Any]:
    """A writer's state at ``step``, reproducible from (writer, step).

    - ``embed``: the same for every writer and step (one blob shared by all runs);
    - ``phase``: the same for every writer, changes every 3 steps (shared across runs, then
      garbage once every run has moved on and retention dropped the older checkpoints);
    - ``cycle``: per writer, repeats every 3 steps (reuses blobs of checkpoints that retention
      may have deleted and GC condemned or swept meanwhile);
    - ``w``, ``moment``: new at every step.
    """
    return {
        "policy": {
            "embed": tensor(1),
            "phase": tensor(1000 + step // 3),
            "cycle": tensor(2000 + 10 * writer + step % 3),
            "w": tensor(3000 + 100 * writer + step),
        },
        "optimizer": {
            "step": torch.tensor(step),
            "moment": tensor(5000 + 100 * writer + step, 128, torch.bfloat16),
            "lr": 1e-3 / (1 + step),
        },
        "dataloader": {"position": 64 * step, "writer": writer},
    }


def gc_reward(writer: int, step: int) -> float:
    """A reward that goes up and down, so retention deletes out of step order."""
    return ((writer * 7 + step * 5) % 11) / 10


@dataclass
class WriterResult:
    name: str
    committed: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)


def write_run(
    db_url: str, store_root: str, writer: int, steps: int, pause: float, start: Any = None
) -> WriterResult:
    """Save ``steps`` checkpoints of writer ``writer``'s run (a thread or a spawned process)."""
    if start is not None:
        start.wait(timeout=120)
    result = WriterResult(f"writer-{writer}")
    store = LocalStore(store_root, fsync=False)
    with open_run(
        result.name,
        db=db_url,
        store=store,
        retention=RetentionPolicy(keep_top_k=2, metric_name="reward"),
        writer_options=OPTIONS,
        async_save=False,
    ) as run:
        for step in range(1, steps + 1):
            try:
                run.save(step, gc_state(writer, step), metrics={"reward": gc_reward(writer, step)})
                result.committed.append(step)
            except SaveError as exc:  # GC removed a blob this save meant to reuse
                result.failed.append((step, str(exc)))
            time.sleep(pause)
    store.close()
    return result


@dataclass
class GcLoop:
    passes: int = 0
    condemned: int = 0
    swept: int = 0
    orphans: int = 0
    errors: list[str] = field(default_factory=list)


def gc_loop(db_url: str, store: LocalStore, stop: threading.Event, stats: GcLoop) -> None:
    db = Database(db_url)
    try:
        while not stop.is_set():
            report = collect_garbage(db, store, grace=dt.timedelta(seconds=1))
            stats.passes += 1
            stats.condemned += report.condemned
            stats.swept += report.swept
            stats.orphans += report.orphans
            stats.errors += report.errors
            time.sleep(0.05)
    except BaseException as exc:
        stats.errors.append(repr(exc))
        raise
    finally:
        db.close()


def check_store_after_gc_storm(
    db_url: str, store: LocalStore, results: list[WriterResult], writers: int, steps: int
) -> None:
    failures = [f for r in results for f in r.failed]
    assert len(failures) <= max(2, writers * steps // 10), failures
    for _, message in failures:
        assert "missing" in message, message

    def check_every_committed_checkpoint() -> int:
        count = 0
        for writer, result in enumerate(results):
            with open_run(result.name, db=db_url, store=store, writable=False) as run:
                rows = run.checkpoints()
                committed = [c.step for c in rows if c.status == Status.COMMITTED]
                # Retention: the 2 best plus the latest at most.
                assert 1 <= len(committed) <= 3, [(c.step, c.status) for c in rows]
                assert {c.step for c in rows if c.status == Status.FAILED} == {
                    s for s, _ in result.failed
                }
                assert set(committed) <= set(result.committed)
                assert max(committed) == max(result.committed)
                for step in committed:
                    assert_same(run.load(step=step).state, gc_state(writer, step))
                count += len(committed)
        return count

    committed = check_every_committed_checkpoint()
    db = Database(db_url)
    try:
        report = verify(db, store)
        assert report.problems == []
        assert report.checkpoints == committed

        final = collect_garbage(db, store, grace=NOW)
        assert final.errors == []
        needed = committed_references(db)
        rows = blob_rows(db)
        assert set(rows) == needed, "every blob row is referenced by a committed checkpoint"
        assert set(cas_objects(store)) == needed, "every cas/ object has a row, and vice versa"
        assert {r[0] for r in rows.values()} == {BlobState.LIVE}
        assert check_every_committed_checkpoint() == committed
        assert verify(db, store).problems == []
    finally:
        db.close()


def test_gc_loop_while_writers_save_and_retention_deletes(db_url: str, store: LocalStore) -> None:
    writers, steps = 3, 12
    open_run("warmup", db=db_url, store=store).close()  # the schema, created once up front
    stop, stats = threading.Event(), GcLoop()
    collector = threading.Thread(target=gc_loop, args=(db_url, store, stop, stats))
    collector.start()
    results: list[WriterResult | None] = [None] * writers

    def writer_thread(i: int) -> None:
        results[i] = write_run(db_url, str(store.root), i, steps, pause=0.3)

    threads = [threading.Thread(target=writer_thread, args=(i,)) for i in range(writers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        stop.set()
        collector.join(60)
    assert not collector.is_alive()
    assert stats.errors == []
    assert all(r is not None for r in results), "a writer thread died"
    assert stats.passes >= 3
    # Retention deletes from step 3 on; 1 s after their last claim GC condemns those blobs,
    # 1 s later it deletes them, while the writers still have seconds of saving to do.
    assert stats.condemned > 0, "GC never found anything to do while the writers ran"
    assert stats.swept > 0, "GC never deleted anything while the writers ran"
    check_store_after_gc_storm(db_url, store, [r for r in results if r is not None], writers, steps)


@pytest.mark.slow
def test_gc_loop_while_writer_processes_save(db_url: str, store: LocalStore) -> None:
    """The larger variant: writer processes (spawned), more of them, more steps."""
    writers, steps = 4, 25
    open_run("warmup", db=db_url, store=store).close()
    context = multiprocessing.get_context("spawn")
    stop, stats = threading.Event(), GcLoop()
    collector = threading.Thread(target=gc_loop, args=(db_url, store, stop, stats))
    with context.Manager() as manager, ProcessPoolExecutor(writers, mp_context=context) as pool:
        start = manager.Barrier(writers)
        futures = [
            pool.submit(write_run, db_url, str(store.root), i, steps, 0.1, start)
            for i in range(writers)
        ]
        collector.start()
        try:
            results = [f.result(timeout=300) for f in futures]
        finally:
            stop.set()
            collector.join(60)
    assert stats.errors == []
    assert stats.swept > 0
    check_store_after_gc_storm(db_url, store, results, writers, steps)


def test_temporary_files_of_killed_writers_are_swept_after_the_grace(
    db: Database, store: LocalStore
) -> None:
    # What a writer killed between writing its temp file and linking it leaves behind.
    shard = store.root / "cas" / "ab"
    shard.mkdir(parents=True)
    old = shard / ".tmp-abcdef.0123456789abcdef"
    old.write_bytes(b"x" * 1000)
    stamp = time.time() - 7200
    os.utime(old, (stamp, stamp))
    young = shard / ".tmp-abcdef.fedcba9876543210"
    young.write_bytes(b"y" * 10)  # a put in progress right now

    dry = collect_garbage(db, store, grace=dt.timedelta(hours=1), dry_run=True)
    assert (dry.incomplete, dry.incomplete_bytes) == (1, 1000)
    assert old.exists()
    report = collect_garbage(db, store, grace=dt.timedelta(hours=1))
    assert (report.incomplete, report.incomplete_bytes) == (1, 1000)
    assert not old.exists()
    assert young.exists()


@pytest.mark.integration
def test_abandoned_multipart_uploads_are_aborted(db: Database, seaweed_store: Any) -> None:
    # A real server: moto reports every upload as initiated in 2010.
    client, bucket = seaweed_store.client, seaweed_store.bucket
    key = f"{seaweed_store.prefix}/cas/ab/abandoned" if seaweed_store.prefix else "cas/ab/x"
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)
    client.upload_part(
        Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"z" * 4096
    )
    assert collect_garbage(db, seaweed_store, grace=dt.timedelta(hours=1)).incomplete == 0
    report = collect_garbage(db, seaweed_store, grace=dt.timedelta(0))
    assert (report.incomplete, report.incomplete_bytes) == (1, 4096)
    left = client.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])
    assert left == []
