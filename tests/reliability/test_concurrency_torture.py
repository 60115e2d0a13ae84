"""Concurrency torture (issue #6, family 4): GC against writers, fenced writers, many processes.

(a) Garbage collection loops (grace 0, and a small positive grace) while a writer saves
    asynchronously with retention deleting continuously and content that repeats across steps.
    After every GC pass every committed checkpoint verifies and the latest loads back exactly.
(b) Two writers on one run: the newer writer's open fences the older one, also while the older
    one has a save in flight, also when the older one is another process that is still alive.
(c) Processes (4 in the fast tier, 8 in the stress tier) commit to different runs of one
    PostgreSQL database, deduplicating against each other's blobs, while a GC process loops and
    checks after every pass.
Plus deterministic regression tests for races the tortures can only hit by chance: a fenced
writer's retention, a blob swept between a writer's "already live" check and its commit, and
GC's mark reaching blobs that a commit in progress claims.

After every torture the audit holds: no checkpoint is left pending, every failed save is a
`failed` row and failed for a stated, safe reason, every committed checkpoint loads back exactly
(torch.equal) and verifies, retention kept exactly what its rules say, and a final GC with grace
0 leaves exactly the blobs that committed checkpoints reference, each row with its object's size.

Figures go to the "concurrency" line of the reliability report (saves = committed saves).
"""

from __future__ import annotations

import datetime as dt
import json
import queue
import random
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
from concurrency_child import (
    FENCED,
    OPTIONS,
    RETENTION,
    SAFE_FAILURES,
    GatedStore,
    GcStats,
    WriterLog,
    differences,
    expected_kept,
    gc_loop,
    state,
    tensor,
    write_steps,
)
from pg_waits import wait_for_a_lock_waiter
from sqlalchemy import select

from ckptstore import RetentionPolicy, Run, SaveHandle, open_run
from ckptstore.cas import digest_from_key
from ckptstore.errors import FencedError, SaveError
from ckptstore.maintenance import collect_garbage, verify
from ckptstore.manifest import Database
from ckptstore.manifest.models import BlobRow, BlobState, CheckpointBlobRow, CheckpointRow, Status
from ckptstore.objectstore import LocalStore, ObjectStore

FAMILY = "concurrency"
CHILD = Path(__file__).with_name("concurrency_child.py")
GRACE_0 = dt.timedelta(0)
#: Small enough that blobs are condemned and swept while the writer still runs.
SMALL_GRACE = dt.timedelta(milliseconds=100)


def record(
    report: Any, *, saves: int, gc_passes: int = 0, fenced: int = 0, processes: int = 0, lost: int
) -> None:
    """Add to the report's "concurrency" line (always every key, in the same order)."""
    report.add(
        FAMILY,
        saves=saves,
        gc_passes=gc_passes,
        fenced_refused=fenced,
        processes=processes,
        lost=lost,
    )


# -- the audit after a torture ---------------------------------------------------------------------


def load_every_committed(db_url: str, store: ObjectStore, runs: Mapping[str, int]) -> list[str]:
    """Load every committed checkpoint of ``runs`` (name -> writer); what did not load exactly."""
    lost: list[str] = []
    for name, writer in runs.items():
        with open_run(name, db=db_url, store=store, writable=False) as run:
            for info in run.checkpoints([Status.COMMITTED]):
                try:
                    loaded = run.load(step=info.step)
                except Exception as exc:  # a committed checkpoint that does not load is lost
                    lost.append(f"{name} step {info.step}: {type(exc).__name__}: {exc}")
                    continue
                diff = differences(loaded.state, state(writer, info.step))
                if diff:
                    lost.append(f"{name} step {info.step}: {diff[:3]}")
    return lost


def cas_objects(store: ObjectStore) -> dict[str, int]:
    """digest -> size of every blob object in the store."""
    found = {}
    for info in store.list("cas/"):
        digest = digest_from_key(info.key)
        if digest is not None:
            found[digest] = info.size
    return found


def assert_store_exact(db_url: str, store: ObjectStore) -> int:
    """Every committed checkpoint verifies; a final GC with grace 0 leaves exactly the blobs that
    committed checkpoints reference, as live rows whose stored size is their object's size.
    Returns the number of committed checkpoints."""
    db = Database(db_url)
    try:
        before = verify(db, store, mark_corrupt=False)
        assert before.problems == []
        final = collect_garbage(db, store, grace=GRACE_0)
        assert final.errors == []
        with db.read() as session:
            needed = set(
                session.scalars(
                    select(CheckpointBlobRow.digest)
                    .join(CheckpointRow, CheckpointRow.id == CheckpointBlobRow.checkpoint_id)
                    .where(CheckpointRow.status == Status.COMMITTED)
                )
            )
            rows = {b.digest: b for b in session.scalars(select(BlobRow))}
        objects = cas_objects(store)
        assert set(rows) == needed, "every blob row is referenced by a committed checkpoint"
        assert set(objects) == needed, "every cas/ object has a row, and every row its object"
        assert {r.state for r in rows.values()} <= {BlobState.LIVE}
        wrong = {d: (r.stored_bytes, objects[d]) for d, r in rows.items()}
        wrong = {d: sizes for d, sizes in wrong.items() if sizes[0] != sizes[1]}
        assert wrong == {}, "blob rows whose stored_bytes is not their object's size"
        after = verify(db, store, mark_corrupt=False)
        assert after.problems == []
        assert after.checkpoints == before.checkpoints
        return after.checkpoints
    finally:
        db.close()


def assert_writer_outcome(run: Run, writer: int, log: WriterLog, steps: int) -> None:
    """The rows of a run written by :func:`write_steps` say exactly what its saves did."""
    rows = run.checkpoints()
    listing = [(c.step, c.status) for c in rows]
    assert {c.status for c in rows} <= {Status.COMMITTED, Status.DELETED, Status.FAILED}, listing
    for step, message in log.failures:
        assert SAFE_FAILURES.search(message), f"step {step} failed unexpectedly: {message}"
    failed = [c for c in rows if c.status == Status.FAILED]
    assert sorted(c.step for c in failed) == sorted(s for s, _ in log.failures), listing
    assert all(SAFE_FAILURES.search(c.error or "") for c in failed), [c.error for c in failed]
    saved = sorted(c.step for c in rows if c.status in (Status.COMMITTED, Status.DELETED))
    assert saved == sorted(log.committed), listing
    assert log.attempts == len(rows)
    assert log.committed[-1] == steps, "the last step never committed"
    kept = {c.step for c in rows if c.status == Status.COMMITTED}
    assert kept == expected_kept(log.committed, writer), listing
    latest = run.latest()
    assert latest is not None
    assert (latest.step, latest.status) == (steps, Status.COMMITTED)


# -- child processes -------------------------------------------------------------------------------


class Child:
    """A child process of concurrency_child.py; JSON events on its stdout, lines to its stdin."""

    def __init__(self, mode: str, args: Mapping[str, Any], log_dir: Path, tag: str) -> None:
        self.tag = tag
        self.stderr_path = log_dir / f"{tag}.stderr"
        self._stderr: IO[str] = open(self.stderr_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), mode, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"{tag}-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr_tail(self) -> str:
        self._stderr.flush()
        return "\n--- stderr of " + self.tag + " ---\n" + self.stderr_path.read_text()[-3000:]

    def expect(self, event: str, timeout: float = 120.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"{self.tag}: no {event!r} within {timeout}s{self.stderr_tail()}"
            ) from None
        if line is None:
            raise AssertionError(
                f"{self.tag} exited (rc={self.proc.wait()}) before {event!r}{self.stderr_tail()}"
            )
        message: dict[str, Any] = json.loads(line)
        assert message["event"] == event, f"{self.tag}: {message}{self.stderr_tail()}"
        return message

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def finish(self, timeout: float = 60.0) -> None:
        """Wait for a clean exit."""
        rc = self.proc.wait(timeout)
        assert rc == 0, f"{self.tag} exited with {rc}{self.stderr_tail()}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()
        self._stderr.close()


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Callable[..., Child]]:
    """Start children with ``children(mode, args, tag)``; all are stopped at teardown."""
    started: list[Child] = []

    def start(mode: str, args: Mapping[str, Any], tag: str) -> Child:
        child = Child(mode, args, tmp_path, tag)
        started.append(child)
        return child

    try:
        yield start
    finally:
        for child in started:
            child.stop()


# -- backends for the stress tier -----------------------------------------------------------------


@dataclass
class Backend:
    db_url: str
    #: Opens a new store over the one location (each thread or process gets its own).
    new_store: Callable[[], ObjectStore]
    #: How a child process opens that location.
    child_store: dict[str, Any]


@pytest.fixture
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """``sqlite-local`` (SQLite + LocalStore) or ``pg-seaweed`` (PostgreSQL + SeaweedFS)."""
    if request.param == "sqlite-local":
        root = tmp_path / "store"
        stores: list[LocalStore] = []

        def new_local() -> LocalStore:
            stores.append(LocalStore(root, fsync=False))
            return stores[-1]

        yield Backend(f"sqlite:///{tmp_path / 'manifest.db'}", new_local, {"url": str(root)})
        for s in stores:
            s.close()
        return
    assert request.param == "pg-seaweed"
    factory = request.getfixturevalue("seaweed_store_factory")
    yield Backend(
        request.getfixturevalue("pg_schema_url"),
        factory,
        {"url": f"s3://{factory.bucket}/{factory.prefix}", "endpoint_url": factory.endpoint_url},
    )


# == (a) GC loops against a writer and retention ==================================================


def gc_against_writer(
    db_url: str, writer_store: ObjectStore, gc_store: ObjectStore, grace: dt.timedelta, steps: int
) -> tuple[WriterLog, GcStats]:
    """One writer thread saves ``steps`` checkpoints (async, retention on) while a GC thread runs
    passes with ``grace`` and checks the invariant after each one."""
    name = "gc-torture"
    with open_run(
        name,
        db=db_url,
        store=writer_store,
        retention=RETENTION,
        writer_options=OPTIONS,
        async_save=True,
    ) as run:
        gc_db = Database(db_url)
        stop, stats = threading.Event(), GcStats()
        collector = threading.Thread(
            target=gc_loop, args=(gc_db, gc_store, grace, {name: 0}, stop, stats), name="gc"
        )
        collector.start()
        try:
            log = write_steps(run, 0, steps)
        finally:
            stop.set()
            collector.join(120)
            gc_db.close()
        assert not collector.is_alive(), "the GC loop did not stop"
    return log, stats


def check_gc_torture(
    db_url: str,
    store: ObjectStore,
    log: WriterLog,
    stats: GcStats,
    steps: int,
    report: Any,
) -> None:
    lost = load_every_committed(db_url, store, {"gc-torture": 0})
    record(report, saves=len(log.committed), gc_passes=stats.passes, lost=stats.lost + len(lost))
    assert stats.errors == []
    assert stats.problems == []
    assert lost == []
    assert stats.lost == 0
    assert stats.checks == stats.passes >= 3
    assert stats.latest_loaded >= 1
    # GC found work while the writer ran: retention keeps deleting, so blobs become garbage.
    assert stats.condemned > 0, "GC never condemned anything while the writer ran"
    assert stats.swept > 0, "GC never deleted anything while the writer ran"
    # A save may lose a race with GC (with grace 0, GC sweeps what a save has uploaded but not
    # yet committed); it then fails safely (SAFE_FAILURES, checked below) and is saved again.
    with open_run("gc-torture", db=db_url, store=store, writable=False) as run:
        assert_writer_outcome(run, 0, log, steps)
    assert assert_store_exact(db_url, store) == len(expected_kept(log.committed, 0))


@pytest.mark.parametrize("grace", [GRACE_0, SMALL_GRACE], ids=["grace0", "grace100ms"])
def test_gc_loop_against_async_writer_and_retention(
    grace: dt.timedelta, tmp_path: Path, reliability_report: Any
) -> None:
    """Fast tier: 36 async saves on SQLite + LocalStore against a GC loop."""
    steps = 36
    db_url = f"sqlite:///{tmp_path / 'manifest.db'}"
    writer_store = LocalStore(tmp_path / "store", fsync=False)
    gc_store = LocalStore(tmp_path / "store", fsync=False)
    try:
        log, stats = gc_against_writer(db_url, writer_store, gc_store, grace, steps)
        check_gc_torture(db_url, writer_store, log, stats, steps, reliability_report)
    finally:
        writer_store.close()
        gc_store.close()


@pytest.mark.stress
@pytest.mark.parametrize("grace", [GRACE_0, SMALL_GRACE], ids=["grace0", "grace100ms"])
@pytest.mark.parametrize("backend", ["sqlite-local", "pg-seaweed"], indirect=True)
def test_gc_loop_against_async_writer_stress(
    backend: Backend, grace: dt.timedelta, reliability_report: Any
) -> None:
    """Stress tier: 200 async saves against a GC loop, on each backend."""
    steps = 200
    store = backend.new_store()
    log, stats = gc_against_writer(backend.db_url, store, backend.new_store(), grace, steps)
    check_gc_torture(backend.db_url, store, log, stats, steps, reliability_report)


# == (b) two writers on one run: fencing ===========================================================


def statuses(run: Run) -> list[tuple[int, str, int]]:
    return [(c.step, c.status, c.writer_epoch) for c in run.checkpoints()]


def test_stale_writer_with_a_save_in_flight_is_fenced(
    db_url: str, store: LocalStore, reliability_report: Any
) -> None:
    """Writer A's save is uploading when writer B opens the run: A's save, and every later one,
    fails with FencedError and nothing of it becomes visible; B's saves commit."""
    entered, release = threading.Event(), threading.Event()

    def hold(_key: str) -> None:
        entered.set()
        release.wait(60)

    a_store = GatedStore(str(store.root), hold)
    a = open_run("fenced", db=db_url, store=a_store, writer_options=OPTIONS)
    fenced = 0
    try:
        first = a.save(1, state(0, 1)).wait()
        a_store.armed = True
        in_flight = a.save(2, state(0, 2))
        assert entered.wait(60), "A's save never started uploading"
        b = open_run("fenced", db=db_url, store=store, writer_options=OPTIONS)
        try:
            assert a.epoch is not None
            assert b.epoch == a.epoch + 1
            ea, eb = a.epoch, b.epoch
            # A's save is in flight: its row is pending, and resume never sees it.
            # Opening B marked A's pending row failed: A can never commit it.
            assert statuses(b) == [(1, "committed", ea), (2, "failed", ea)]
            latest = b.latest()
            assert latest is not None
            assert (latest.id, latest.step) == (first.id, 1)
            assert differences(b.load().state, state(0, 1)) == []

            release.set()
            with pytest.raises(FencedError, match=FENCED):
                in_flight.wait(60)
            fenced += 1
            # The old writer is still alive and tries again: refused again.
            with pytest.raises(FencedError, match=FENCED):
                a.save(3, state(0, 3)).wait(60)
            fenced += 1

            for step in (2, 3):
                b.save(step, state(1, step)).wait(60)
            rows = b.checkpoints()
            assert statuses(b) == [
                (1, "committed", ea),
                (2, "failed", ea),
                (2, "committed", eb),
                (3, "failed", ea),
                (3, "committed", eb),
            ]
            for row in rows:
                if row.status == "failed":
                    assert row.error is not None
                    # Abandoned when B opened, or refused at A's commit.
                    assert row.error.startswith(("FencedError: ", "abandoned: ")), row.error
                    assert FENCED in row.error or "replaced by writer epoch" in row.error
            loaded = b.load()
            assert (loaded.info.step, loaded.info.writer_epoch) == (3, eb)
            lost = len(differences(loaded.state, state(1, 3)))
            lost += len(differences(b.load(step=2).state, state(1, 2)))
            lost += len(differences(b.load(step=1).state, state(0, 1)))
        finally:
            b.close()
    finally:
        release.set()
        a.close()  # every failure of A was reported: closing raises nothing
        a_store.close()
    record(reliability_report, saves=3, fenced=fenced, lost=lost)
    assert lost == 0
    # A's uploads were never committed: GC removes them and keeps exactly B's and step 1's.
    assert assert_store_exact(db_url, store) == 3


def test_stale_writer_process_still_alive_is_fenced(
    db_url: str, store: LocalStore, children: Callable[..., Child], reliability_report: Any
) -> None:
    """Writer A is another process (an old job still alive) with a save in flight when writer B
    opens the run; A's in-flight save and its later saves are all refused."""
    name = "fenced-process"
    a = children(
        "fenced-writer", {"name": name, "db": db_url, "store": {"url": str(store.root)}}, "a"
    )
    first = a.expect("committed", timeout=180)
    assert first["step"] == 1
    a.expect("in-flight")
    with open_run(name, db=db_url, store=store, writer_options=OPTIONS) as b:
        ea, eb = first["epoch"], b.epoch
        assert eb == ea + 1
        # Opening B marked A's pending row failed: A can never commit it.
        assert statuses(b) == [(1, "committed", ea), (2, "failed", ea)]
        latest = b.latest()
        assert latest is not None
        assert latest.step == 1

        a.send("go")
        refused = [a.expect("fenced") for _ in (2, 3, 4)]
        assert [r["step"] for r in refused] == [2, 3, 4]
        assert all(FENCED in r["error"] for r in refused), refused
        a.expect("done")
        a.finish()

        for step in (2, 3, 4):
            b.save(step, state(1, step)).wait(60)
        assert statuses(b) == [
            (1, "committed", ea),
            *[row for step in (2, 3, 4) for row in ((step, "failed", ea), (step, "committed", eb))],
        ]
        loaded = b.load()
        assert loaded.info.step == 4
        lost = len(differences(loaded.state, state(1, 4)))
        lost += sum(len(differences(b.load(step=s).state, state(1, s))) for s in (2, 3))
        lost += len(differences(b.load(step=1).state, state(0, 1)))
    record(reliability_report, saves=4, fenced=len(refused), processes=1, lost=lost)
    assert lost == 0
    assert assert_store_exact(db_url, store) == 4


class GatedDatabase(Database):
    """Holds the retention transaction that follows a commit until the test releases it."""

    hold_retention = False

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.held, self.release = threading.Event(), threading.Event()

    def write(self, fn: Callable[..., Any], *, what: str = "database write") -> Any:
        if self.hold_retention and what == "applying retention":
            self.held.set()
            self.release.wait(60)
        return super().write(fn, what=what)


def test_stale_writer_retention_cannot_delete_the_new_writers_checkpoints(
    db_url: str, store: LocalStore, reliability_report: Any
) -> None:
    """Writer A commits step 2 just before writer B opens the run; A's retention (keep 1) runs
    after B took over. It must not touch the run: B keeps its 3 newest."""
    a_db = GatedDatabase(db_url)
    keep_1 = RetentionPolicy(keep_top_k=0, keep_latest_k=1)
    keep_3 = RetentionPolicy(keep_top_k=0, keep_latest_k=3)
    a = open_run("retention-fence", db=a_db, store=store, retention=keep_1, writer_options=OPTIONS)
    try:
        a.save(1, state(0, 1)).wait(60)
        a_db.hold_retention = True
        committed_then_held = a.save(2, state(0, 2))
        assert a_db.held.wait(60), "A's save never reached its retention"
        with open_run(
            "retention-fence", db=db_url, store=store, retention=keep_3, writer_options=OPTIONS
        ) as b:
            for step in (3, 4):
                b.save(step, state(1, step)).wait(60)
            kept = [c.step for c in b.checkpoints([Status.COMMITTED])]
            assert kept == [2, 3, 4]  # B's own retention: its 3 newest
            a_db.release.set()
            assert committed_then_held.wait(60).step == 2  # committed before B opened
            # The stale writer's retention ran after B took over.
            assert [c.step for c in b.checkpoints([Status.COMMITTED])] == [2, 3, 4]
            lost = len(differences(b.load(step=3).state, state(1, 3)))
        record(reliability_report, saves=4, lost=lost)
        assert lost == 0
    finally:
        a_db.release.set()
        a.close()
        a_db.close()


class StaleJob(threading.Thread):
    """Writer A: saves continuously (async, retention on) until one of its saves is refused."""

    def __init__(self, run: Run) -> None:
        super().__init__(name=f"stale-{run.name}")
        self.run_ = run
        self.handles: list[SaveHandle] = []
        self.refusal: BaseException | None = None
        self._progress = threading.Condition()

    def run(self) -> None:
        for step in range(1, 500):
            try:
                handle = self.run_.save(step, state(0, step), metrics={"reward": 0.5})
            except SaveError as exc:  # the previous save was refused: the job gives up
                self.refusal = exc
                return
            with self._progress:
                self.handles.append(handle)
                self._progress.notify_all()

    def wait_started(self, saves: int) -> None:
        with self._progress:
            assert self._progress.wait_for(lambda: len(self.handles) >= saves, 60)


def fence_at_random_moment(
    db_url: str, store: LocalStore, name: str, saves_before: int
) -> tuple[int, int, int]:
    """One round: B opens once A has started ``saves_before`` saves. Returns (committed saves,
    refused saves, lost)."""
    with open_run(name, db=db_url, store=store, retention=RETENTION, writer_options=OPTIONS) as a:
        job = StaleJob(a)
        job.start()
        try:
            job.wait_started(saves_before)
            b = open_run(name, db=db_url, store=store, retention=RETENTION, writer_options=OPTIONS)
        finally:
            job.join(120)
        assert not job.is_alive()
        assert isinstance(job.refusal, SaveError)
        assert isinstance(job.refusal.__cause__, FencedError), job.refusal
        with b:
            latest = b.latest()
            newest_before = latest.step if latest is not None else 0
            outcomes: list[tuple[int, str]] = []
            for handle in job.handles:
                try:
                    outcomes.append((handle.step, f"epoch {handle.wait(60).writer_epoch}"))
                except FencedError as exc:
                    outcomes.append((handle.step, "fenced" if FENCED in str(exc) else str(exc)))
            steps = len(job.handles)
            # A committed a prefix of its steps, all before B opened; afterwards only refusals.
            assert outcomes == [
                *[(s, f"epoch {a.epoch}") for s in range(1, newest_before + 1)],
                *[(s, "fenced") for s in range(newest_before + 1, steps + 1)],
            ]
            assert newest_before < steps, "A was never refused"
            for step in (newest_before + 1, newest_before + 2):
                b.save(step, state(1, step), metrics={"reward": 0.5}).wait(60)
            loaded = b.load()
            assert loaded.info.step == newest_before + 2
            lost = len(differences(loaded.state, state(1, newest_before + 2)))
            rows = b.checkpoints()
            assert not [c for c in rows if c.status == Status.PENDING]
            refused = list(range(newest_before + 1, steps + 1))
            assert sorted(c.step for c in rows if c.status == Status.FAILED) == refused
    return newest_before + 2, len(refused), lost


@pytest.mark.stress
def test_stale_writer_fenced_at_random_moments_stress(
    db_url: str, store: LocalStore, reliability_report: Any
) -> None:
    """Rounds of: writer A saves continuously; writer B opens the run at a random moment (A's
    save uploading, committing or applying retention). Whatever A committed before B opened is
    B's latest, A commits nothing afterwards, and every later save of A is refused."""
    rng = random.Random(6)
    rounds, committed, fenced, lost = 20, 0, 0, 0
    for round_ in range(rounds):
        c, f, n = fence_at_random_moment(db_url, store, f"race-{round_}", rng.randint(1, 6))
        committed, fenced, lost = committed + c, fenced + f, lost + n
    record(reliability_report, saves=committed, fenced=fenced, lost=lost)
    assert lost == 0
    # Every reward is equal: RETENTION keeps each run's 2 newest.
    assert assert_store_exact(db_url, store) == 2 * rounds


# == GC racing two writers that share a blob =======================================================


class CommitGate(Database):
    """Holds this database's checkpoint commits until the test releases them."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.held, self.release = threading.Event(), threading.Event()

    def write(self, fn: Callable[..., Any], *, what: str = "database write") -> Any:
        if what.startswith("committing checkpoint"):
            self.held.set()
            self.release.wait(60)
        return super().write(fn, what=what)


def test_blob_swept_between_a_live_check_and_the_commit_keeps_its_real_size(
    db_url: str, store: LocalStore, reliability_report: Any
) -> None:
    """Run r1 reuses a live blob (no upload); GC sweeps it before r1 commits; run r2 uploads it
    again; r1 commits first. Both checkpoints load, and the blob's row records its real size."""
    x = {"p": {"x": tensor(7, 2048)}}
    keep_1 = RetentionPolicy(keep_top_k=0, keep_latest_k=1)
    db = Database(db_url)
    gates = [CommitGate(db_url), CommitGate(db_url)]
    try:
        with open_run("r0", db=db, store=store, retention=keep_1, writer_options=OPTIONS) as r0:
            r0.save(1, x).wait()
            r0.save(2, {"p": {"y": tensor(8, 2048)}}).wait()  # step 1 deleted: x is garbage
        with (
            open_run("r1", db=gates[0], store=store, writer_options=OPTIONS) as r1,
            open_run("r2", db=gates[1], store=store, writer_options=OPTIONS) as r2,
        ):
            h1 = r1.save(1, x)  # every blob of x is live: nothing uploaded
            assert gates[0].held.wait(60)
            gc = collect_garbage(db, store, grace=GRACE_0)
            assert gc.swept == 2  # x's chunk and its index: rows and objects
            h2 = r2.save(1, x)  # uploads them again
            assert gates[1].held.wait(60)
            gates[0].release.set()
            assert h1.wait(60).status == "committed"
            gates[1].release.set()
            assert h2.wait(60).status == "committed"
        lost = []
        for name in ("r1", "r2"):
            with open_run(name, db=db, store=store, writable=False) as run:
                lost += differences(run.load().state, x)
        assert lost == []
        assert assert_store_exact(db_url, store) == 3
        record(reliability_report, saves=4, gc_passes=2, lost=len(lost))
    finally:
        for gate in gates:
            gate.release.set()
            gate.close()
        db.close()


class HoldOpenCommit(Database):
    """Once ``armed``, holds a checkpoint's commit transaction open after its last statement,
    before COMMIT (a slow network round trip), until the test releases it."""

    armed = False

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.held, self.release = threading.Event(), threading.Event()

    def write(self, fn: Callable[..., Any], *, what: str = "database write") -> Any:
        if not (self.armed and what.startswith("committing checkpoint")):
            return super().write(fn, what=what)

        def held_open(session: Any) -> Any:
            result = fn(session)
            self.held.set()
            self.release.wait(60)
            return result

        return super().write(held_open, what=what)


def test_gc_mark_racing_a_commit_leaves_its_blobs_live(
    pg_schema_url: str, store: LocalStore, reliability_report: Any
) -> None:
    """A commit claims blobs that only a deleted checkpoint referenced; GC's mark reaches them
    while the commit's transaction is still open. The checkpoint commits, and every blob it
    references must be live (not condemned) once GC is done."""
    x = {"p": {"x": tensor(9, 2048)}}
    keep_1 = RetentionPolicy(keep_top_k=0, keep_latest_k=1)
    db = Database(pg_schema_url)
    gate = HoldOpenCommit(pg_schema_url)
    report: list[Any] = []
    collector = threading.Thread(
        target=lambda: report.append(collect_garbage(db, store, grace=GRACE_0)), name="gc"
    )
    try:
        with open_run(
            "claimer", db=gate, store=store, retention=keep_1, writer_options=OPTIONS
        ) as r:
            r.save(1, x).wait(60)
            r.save(2, {"p": {"y": tensor(10, 2048)}}).wait(60)  # step 1 deleted: x unreferenced
            gate.armed = True
            handle = r.save(3, x)  # x's blobs are live rows: claimed, not uploaded
            assert gate.held.wait(60), "the commit never ran"
            collector.start()
            # GC's mark waits for the commit's row lock.
            wait_for_a_lock_waiter(db.engine, "GC's mark never waited for the commit's lock")
            gate.release.set()
            info = handle.wait(60)
            collector.join(60)
            assert not collector.is_alive()
            assert differences(r.load().state, x) == []
        with db.read() as session:
            rows = session.execute(
                select(BlobRow.digest, BlobRow.state)
                .join(CheckpointBlobRow, CheckpointBlobRow.digest == BlobRow.digest)
                .where(CheckpointBlobRow.checkpoint_id == info.id)
            )
            states = dict(rows.all())
        assert len(states) == 2  # x's chunk and its index
        assert set(states.values()) == {BlobState.LIVE}, states
        assert assert_store_exact(pg_schema_url, store) == 1
        record(reliability_report, saves=3, gc_passes=2, lost=0)
    finally:
        gate.release.set()
        if collector.is_alive():
            collector.join(60)
        gate.close()
        db.close()


# == (c) many processes commit to different runs while GC loops ====================================


def processes_against_gc(
    db_url: str,
    child_store: dict[str, Any],
    children: Callable[..., Child],
    *,
    writers: int,
    steps: int,
    grace: dt.timedelta,
) -> tuple[dict[str, WriterLog], GcStats]:
    runs = {f"proc-{i}": i for i in range(writers)}
    gc = children(
        "gc-loop",
        {"db": db_url, "store": child_store, "grace": grace.total_seconds(), "runs": runs},
        "gc",
    )
    committers = {
        name: children(
            "committer",
            {"name": name, "db": db_url, "store": child_store, "writer": i, "steps": steps},
            name,
        )
        for name, i in runs.items()
    }
    everyone = [gc, *committers.values()]
    for child in everyone:
        child.expect("ready", timeout=240)
    for child in everyone:  # all start together
        child.send("go")
    logs = {}
    for name, child in committers.items():
        done = child.expect("done", timeout=240)
        logs[name] = WriterLog(
            attempts=done["attempts"],
            committed=done["committed"],
            failures=[(step, message) for step, message in done["failures"]],
        )
        child.finish()
    gc.close_stdin()
    totals = gc.expect("done", timeout=120)
    gc.finish()
    totals.pop("event")
    return logs, GcStats(**totals)


def check_processes(
    db_url: str,
    store: ObjectStore,
    logs: dict[str, WriterLog],
    stats: GcStats,
    steps: int,
    report: Any,
) -> None:
    runs = {name: int(name.split("-")[1]) for name in logs}
    lost = load_every_committed(db_url, store, runs)
    record(
        report,
        saves=sum(len(log.committed) for log in logs.values()),
        gc_passes=stats.passes,
        processes=len(logs) + 1,
        lost=stats.lost + len(lost),
    )
    assert stats.errors == []
    assert stats.problems == []
    assert lost == []
    assert stats.lost == 0
    assert stats.checks == stats.passes >= 2
    for name, log in logs.items():
        with open_run(name, db=db_url, store=store, writable=False) as run:
            assert_writer_outcome(run, runs[name], log, steps)
    kept = sum(len(expected_kept(log.committed, runs[name])) for name, log in logs.items())
    assert assert_store_exact(db_url, store) == kept


def test_processes_commit_while_gc_loops(
    pg_schema_url: str, store: LocalStore, children: Callable[..., Child], reliability_report: Any
) -> None:
    """Fast tier: 4 processes x 3 saves on PostgreSQL + LocalStore, a GC process at grace 0.
    (Each process imports torch, 2-4 CPU-seconds; eight of them are the stress tier's.)"""
    steps = 3
    logs, stats = processes_against_gc(
        pg_schema_url, {"url": str(store.root)}, children, writers=4, steps=steps, grace=GRACE_0
    )
    check_processes(pg_schema_url, store, logs, stats, steps, reliability_report)


@pytest.mark.stress
@pytest.mark.parametrize("backend", ["pg-seaweed"], indirect=True)
def test_eight_processes_commit_while_gc_loops_stress(
    backend: Backend, children: Callable[..., Child], reliability_report: Any
) -> None:
    """Stress tier: 8 processes x 25 saves on PostgreSQL + SeaweedFS, a GC process at grace 0."""
    steps = 25
    logs, stats = processes_against_gc(
        backend.db_url, backend.child_store, children, writers=8, steps=steps, grace=GRACE_0
    )
    check_processes(backend.db_url, backend.new_store(), logs, stats, steps, reliability_report)
