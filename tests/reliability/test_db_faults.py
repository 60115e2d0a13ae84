"""Manifest-database faults (issue #6, family 3): cut connections and lock contention.

PostgreSQL: the connection of the session that is saving is cut with ``pg_terminate_backend``
(run from another connection) at chosen points of the save protocol, found by watching the
statements the writer sends (SQLAlchemy's ``before_cursor_execute`` and ``commit`` events):

- ``begin``: while the pending row is inserted;
- ``mid-commit``: inside the commit transaction, after the blob rows and references were
  sent, before the components;
- ``before-COMMIT``: after every statement of the commit transaction, just before COMMIT;
- ``before-COMMIT+mark-failed``: as before, and the write that marks the row ``failed`` is cut
  too, so the row stays ``pending``.

After each cut: the writer reports the failure (a SaveError naming the step and the lost
connection), no checkpoint is half-committed (the row is failed or pending, with no components
and no blob references, and never visible to ``latest``), and saving the same step again
commits; resume loads exactly what was saved. Between cuts every idle pooled connection is
terminated too (a server restart): the next save must not notice.

Also: a connection cut during a read (``latest``) must give the library's DatabaseError, not a
raw SQLAlchemy exception; and the answer to a COMMIT that took effect is lost on the wire (a
TCP proxy that parses the protocol drops the CommandComplete): whatever the writer then
reports must be what resume sees.

SQLite: several processes race to create one fresh database file, then each commits
checkpoints to its own run while reading its own and a neighbour's ``latest``: every save
succeeds ("database is locked" is absorbed by the busy timeout and retries, never surfaced),
and every checkpoint is committed and loads back exactly.

Families: ``database faults`` (cuts, reported, retried ok, half committed) and ``sqlite
contention`` (processes, saves, lock errors).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import socket
import struct
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from manifest_rows import child_rows
from sqlalchemy import Engine, create_engine, event, func, select, text
from sqlalchemy.engine import Connection, make_url

from ckptstore.checkpointer import Run, open_run
from ckptstore.errors import DatabaseError, SaveError
from ckptstore.maintenance import verify
from ckptstore.manifest import Database
from ckptstore.manifest.models import BlobRow
from ckptstore.objectstore import LocalStore
from ckptstore.serialize.compare import first_difference


def state(seed: int, step: int) -> dict[str, Any]:
    """A small checkpoint (tens of KB), different for every (seed, step)."""
    gen = torch.Generator().manual_seed(seed * 100_000 + step)
    return {
        "policy": {
            "w": torch.randn(4096, generator=gen),
            "b": torch.randn(32, generator=gen).to(torch.bfloat16),
        },
        "optimizer": {"step": torch.tensor(step), "exp_avg": torch.randn(1024, generator=gen)},
        "dataloader": {"position": step * 17, "epoch": step // 10, "seed": seed},
    }


def mismatch(loaded: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """None if ``loaded`` equals ``expected`` exactly (tensors by ``torch.equal``)."""
    if sorted(loaded) != sorted(expected):
        return f"components {sorted(loaded)} != {sorted(expected)}"
    for name, value in expected.items():
        diff = first_difference(loaded[name], value, name)
        if diff is not None:
            return diff
    return None


# -- PostgreSQL: connections cut mid-save ----------------------------------------------------------

CUT_POINTS = ["begin", "mid-commit", "before-COMMIT", "before-COMMIT+mark-failed"]
#: Every connection of the Database under test carries this application_name.
APP_NAME = "ckpt-reliability-cut"


#: How psycopg words a connection whose backend was terminated (depending on when it notices).
LOST_CONNECTION = (
    "terminating connection due to administrator command",
    "server closed the connection unexpectedly",
    "the connection is lost",
    "the connection is closed",
)


def _sql(statement: str) -> str:
    return " ".join(statement.split()).lower()


#: The statement (lower case, one line) at which each cut point strikes.
_STATEMENT_AT: dict[str, Callable[[str], bool]] = {
    "begin": lambda sql: sql.startswith("insert into checkpoints "),
    "mid-commit": lambda sql: sql.startswith("insert into components "),
    # finish_commit's UPDATE is the commit transaction's last statement.
    "before-COMMIT": lambda sql: sql.startswith("update checkpoints ") and "committed_at" in sql,
    "mark-failed": lambda sql: sql.startswith("update checkpoints ") and "error=" in sql,
    "read": lambda sql: sql.startswith("select ") and " from checkpoints " in sql,
}


class BackendCutter:
    """Terminates the PostgreSQL backend of a Database's connection at armed save points.

    ``arm(point)`` cuts the next save at ``point`` (see the module doc). The cut runs
    ``pg_terminate_backend(pid, 5000)`` from a connection of its own, which returns once the
    backend is gone, so the writer's next statement (or its COMMIT) meets a dead connection.
    """

    def __init__(self, database: Database, admin_url: str) -> None:
        self.admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        self.engine: Engine = database.engine
        self.cuts: list[str] = []
        self._armed: list[str] = []
        self._commit_of: int | None = None  # backend whose next COMMIT is to be cut
        event.listen(self.engine, "before_cursor_execute", self._before_execute)
        event.listen(self.engine, "commit", self._before_commit)

    def arm(self, point: str) -> None:
        assert point in [*CUT_POINTS, "read"], point
        self._armed = (
            ["before-COMMIT", "mark-failed"] if point == "before-COMMIT+mark-failed" else [point]
        )

    @property
    def armed(self) -> bool:
        return bool(self._armed) or self._commit_of is not None

    def close(self) -> None:
        event.remove(self.engine, "before_cursor_execute", self._before_execute)
        event.remove(self.engine, "commit", self._before_commit)
        self.admin.dispose()

    def _before_execute(
        self, conn: Connection, cursor: Any, statement: str, *args: Any, **kwargs: Any
    ) -> None:
        if not self._armed:
            return
        sql, point = _sql(statement), self._armed[0]
        if not _STATEMENT_AT[point](sql):
            return
        if point == "before-COMMIT":  # every statement is sent: cut when COMMIT is next
            self._armed.pop(0)
            self._commit_of = _backend_pid(conn)
        else:
            self._cut(conn, point)

    def kill_idle(self) -> int:
        """Terminate every connection of the Database under test (idle in its pool, as after a
        server restart); returns how many there were."""
        with self.admin.connect() as admin:
            killed = admin.execute(
                text(
                    "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
                    "WHERE application_name = :name"
                ),
                {"name": APP_NAME},
            )
            return int(killed.scalar() or 0)

    def _before_commit(self, conn: Connection) -> None:
        if self._commit_of is not None and _backend_pid(conn) == self._commit_of:
            self._commit_of = None
            self._cut(conn, "before-COMMIT", consume=False)

    def _cut(self, conn: Connection, point: str, *, consume: bool = True) -> None:
        if consume:
            self._armed.pop(0)
        pid = _backend_pid(conn)
        with self.admin.connect() as admin:
            gone = admin.execute(text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid})
            assert gone.scalar() is True, f"backend {pid} did not terminate"
        self.cuts.append(point)


def _backend_pid(conn: Connection) -> int:
    return int(conn.connection.dbapi_connection.info.backend_pid)  # type: ignore[union-attr]


@pytest.fixture
def pg_database(pg_schema_url: str) -> Iterator[Database]:
    url = make_url(pg_schema_url).update_query_dict({"application_name": APP_NAME})
    database = Database(url.render_as_string(hide_password=False))
    yield database
    database.close()


@pytest.fixture
def cutter(pg_database: Database, pg_url: str) -> Iterator[BackendCutter]:
    cut = BackendCutter(pg_database, pg_url)
    yield cut
    cut.close()


def cut_and_retry(
    run: Run, cutter: BackendCutter, point: str, step: int, seed: int
) -> dict[str, int]:
    """Cut the save of ``step`` at ``point``, check the aftermath, save ``step`` again."""
    before = run.latest()
    known = {c.id for c in run.checkpoints()}
    blobs_before = _blob_rows(run)
    want = state(seed, step)
    cutter.arm(point)
    with pytest.raises(SaveError) as failure:
        run.save(step, want).wait()
    assert not cutter.armed, f"the cut point {point!r} was never reached"
    assert cutter.cuts[-1] == ("mark-failed" if point.endswith("mark-failed") else point)
    message = str(failure.value)
    what = "starting" if point == "begin" else "committing"
    reported = f"{what} checkpoint at step {step}" in message and any(
        lost in message for lost in LOST_CONNECTION
    )
    assert reported, message

    # Nothing half-committed: the new row (if any) is failed or pending, owns nothing, and
    # resume still sees the previous checkpoint. No blob row of the lost transaction remains.
    fresh = [c for c in run.checkpoints() if c.id not in known]
    expected_status = {
        "begin": [],
        "mid-commit": ["failed"],
        "before-COMMIT": ["failed"],
        "before-COMMIT+mark-failed": ["pending"],
    }[point]
    assert [c.status for c in fresh] == expected_status
    half = sum(1 for c in fresh if child_rows(run, c.id) != (0, 0) or c.status == "committed")
    latest = run.latest()
    assert (latest and latest.id) == (before and before.id), "latest changed after a cut save"
    assert _blob_rows(run) == blobs_before

    # The same step again commits, and resume loads it exactly.
    info = run.save(step, want).wait()
    assert info.status == "committed"
    assert info.step == step
    resumed = run.load()
    retried_ok = resumed.info.id == info.id and mismatch(resumed.state, want) is None
    assert retried_ok
    return {"cuts": 1, "reported": int(reported), "retried_ok": int(retried_ok), "half": half}


def _blob_rows(run: Run) -> int:
    with run.db.read() as session:
        return int(session.scalar(select(func.count()).select_from(BlobRow)) or 0)


def run_cut_rounds(
    pg_database: Database,
    cutter: BackendCutter,
    store: LocalStore,
    rounds: int,
    reliability_report: Any,
) -> None:
    totals = {"cuts": 0, "reported": 0, "retried_ok": 0, "half": 0}
    expected: dict[int, dict[str, Any]] = {}
    step = 0
    with open_run("cut", db=pg_database, store=store) as run:
        for round_ in range(rounds):
            for point in CUT_POINTS:
                # The server drops every idle connection (a restart, a failover): the next
                # save must not notice (the pool checks a connection before handing it out).
                assert cutter.kill_idle() >= 1
                step += 1  # a clean save between cuts
                expected[step] = state(round_, step)
                assert run.save(step, expected[step]).wait().status == "committed"
                step += 1
                figures = cut_and_retry(run, cutter, point, step, round_)
                expected[step] = state(round_, step)
                for key, value in figures.items():
                    totals[key] += value
        committed = {c.step for c in run.checkpoints(["committed"])}
        assert committed == set(expected)
        for s, want in expected.items():
            assert mismatch(run.load(s).state, want) is None, f"step {s}"
    report = verify(pg_database, store, mark_corrupt=False)
    assert report.problems == []
    assert report.checkpoints == len(expected)
    reliability_report.add(
        "database faults",
        cuts=totals["cuts"],
        reported=totals["reported"],
        retried_ok=totals["retried_ok"],
        half_committed=totals["half"],
    )
    assert totals["half"] == 0
    assert totals["cuts"] == totals["reported"] == totals["retried_ok"] == rounds * len(CUT_POINTS)
    assert len(cutter.cuts) == rounds * (len(CUT_POINTS) + 1)  # + the cut mark-failed writes


@pytest.mark.integration
def test_connection_cut_at_every_point_of_a_save(
    pg_database: Database, cutter: BackendCutter, store: LocalStore, reliability_report: Any
) -> None:
    run_cut_rounds(pg_database, cutter, store, rounds=1, reliability_report=reliability_report)


@pytest.mark.integration
@pytest.mark.stress
@pytest.mark.timeout(240)
def test_stress_connection_cuts(
    pg_database: Database, cutter: BackendCutter, store: LocalStore, reliability_report: Any
) -> None:
    run_cut_rounds(pg_database, cutter, store, rounds=8, reliability_report=reliability_report)


@pytest.mark.integration
def test_connection_cut_during_a_read_is_a_clear_database_error(
    pg_database: Database, cutter: BackendCutter, store: LocalStore, reliability_report: Any
) -> None:
    """A read whose connection is cut either succeeds (retried: reads are idempotent) or
    raises the library's own DatabaseError naming the database; a raw SQLAlchemy exception
    breaks every caller that catches CkptStoreError. The next read works either way."""
    want = state(0, 1)
    with open_run("read-cut", db=pg_database, store=store) as run:
        run.save(1, want).wait()
        cutter.arm("read")
        try:
            got = run.latest()
        except Exception as exc:
            outcome: Any = exc
        else:
            outcome = got
        assert cutter.cuts == ["read"]
        after = run.latest()
        retried_ok = after is not None and after.step == 1
        retried_ok = retried_ok and mismatch(run.load().state, want) is None
    if isinstance(outcome, BaseException):
        message = str(outcome)
        reported = (
            isinstance(outcome, DatabaseError)
            and "ckpt_test_" in message
            and any(lost in message for lost in LOST_CONNECTION)
        )
    else:
        reported = outcome is not None and outcome.step == 1
    reliability_report.add(
        "database faults",
        cuts=1,
        reported=int(reported),
        retried_ok=int(retried_ok),
        half_committed=0,
    )
    assert retried_ok
    assert reported, f"latest() during a cut connection gave {outcome!r}"


class CommitReplyDropper:
    """A TCP proxy in front of PostgreSQL that can lose the server's answer to one COMMIT.

    It relays bytes both ways; server-to-client traffic is cut into protocol messages (type
    byte, int32 length). ``arm(port)`` makes it wait, on the connection whose client port is
    ``port``, for the CommandComplete ``COMMIT`` message: the transaction has committed on the
    server, and instead of that answer the client's connection is closed. The client cannot
    know whether its commit happened: the ambiguous outcome every networked database has.
    Clients must connect with ``sslmode=disable&gssencmode=disable`` (no negotiation bytes).
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.dropped: list[int] = []
        self._armed_port: int | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._spawn(self._accept_loop)

    def arm(self, client_port: int) -> None:
        with self._lock:
            self._armed_port = client_port

    @property
    def armed(self) -> bool:
        return self._armed_port is not None

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="pg-dropper")
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, (_, client_port) = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            with self._lock:
                self._sockets += [client, upstream]
            self._spawn(self._client_to_server, client, upstream)
            self._spawn(self._server_to_client, upstream, client, client_port)

    def _client_to_server(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                upstream.sendall(data)
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_WR)

    def _server_to_client(
        self, upstream: socket.socket, client: socket.socket, client_port: int
    ) -> None:
        buffer = b""
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                buffer += data
                out = b""
                while len(buffer) >= 5:
                    size = 1 + struct.unpack("!i", buffer[1:5])[0]
                    if len(buffer) < size:
                        break
                    message, buffer = buffer[:size], buffer[size:]
                    if (
                        message[:1] == b"C"
                        and message[5:12] == b"COMMIT\0"
                        and self._take(client_port)
                    ):
                        # The answer is lost: the client's connection just ends.
                        client.sendall(out)
                        client.shutdown(socket.SHUT_RDWR)
                        upstream.shutdown(socket.SHUT_RDWR)
                        return
                    out += message
                client.sendall(out)
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_WR)

    def _take(self, client_port: int) -> bool:
        with self._lock:
            if self._armed_port != client_port:
                return False
            self._armed_port = None
            self.dropped.append(client_port)
            return True

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close would not)
        self.listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(timeout=10)
        for sock in sockets:
            sock.close()


def _client_port(conn: Connection) -> int:
    fd = conn.connection.dbapi_connection.pgconn.socket  # type: ignore[union-attr]
    with socket.socket(fileno=os.dup(fd)) as sock:
        return int(sock.getsockname()[1])


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_lost_answer_to_a_commit_leaves_the_writer_and_resume_in_agreement(
    pg_schema_url: str, store: LocalStore, reliability_report: Any
) -> None:
    """COMMIT reached the server and the checkpoint committed, but the answer was lost. The
    writer cannot know; whatever it reports must be what resume sees: a reported failure
    leaves the checkpoint invisible to ``latest``, a reported success leaves it committed and
    loadable. Either way the same step saves again, and resume is exact."""
    url = make_url(pg_schema_url)
    dropper = CommitReplyDropper(url.host or "127.0.0.1", url.port or 5432)
    proxied = url.set(host="127.0.0.1", port=dropper.port).update_query_dict(
        {"sslmode": "disable", "gssencmode": "disable"}
    )
    database = Database(proxied.render_as_string(hide_password=False))

    def arm_at_final_update(conn: Connection, cursor: Any, statement: str, *args: Any) -> None:
        if armed_for[0] and _STATEMENT_AT["before-COMMIT"](_sql(statement)):
            armed_for[0] = False
            dropper.arm(_client_port(conn))

    armed_for = [False]
    event.listen(database.engine, "before_cursor_execute", arm_at_final_update)
    try:
        first, second = state(5, 1), state(5, 2)
        with open_run("ambiguous", db=database, store=store) as run:
            run.save(1, first).wait()
            armed_for[0] = True
            try:
                info = run.save(2, second).wait()
            except SaveError as exc:
                outcome: SaveError | Any = exc
            else:
                outcome = info
            assert not armed_for[0], "the commit's last statement was never sent"
            assert not dropper.armed, "the COMMIT was never answered"
            assert len(dropper.dropped) == 1
            rows = [(c.step, c.status) for c in run.checkpoints()]
            latest = run.latest()
            assert latest is not None
            if isinstance(outcome, SaveError):
                message = str(outcome)
                reported = "committing checkpoint at step 2" in message and any(
                    lost in message for lost in LOST_CONNECTION
                )
                assert reported, message
                agree = latest.step == 1 and (2, "committed") not in rows
            else:
                reported = True
                agree = latest.step == 2 and mismatch(run.load().state, second) is None
            assert agree, f"the writer said {outcome!r}; the database holds {rows}"
            info = run.save(2, second).wait()
            resumed = run.load()
            retried_ok = resumed.info.id == info.id and mismatch(resumed.state, second) is None
            assert mismatch(run.load(1).state, first) is None
        reliability_report.add(
            "database faults",
            cuts=1,
            reported=int(reported),
            retried_ok=int(retried_ok),
            half_committed=int(not agree),
        )
        assert retried_ok
    finally:
        database.close()
        dropper.close()


# -- SQLite: many processes, one database file -----------------------------------------------------


def contention_worker(
    index: int,
    processes: int,
    db_url: str,
    store_root: str,
    saves: int,
    barrier: Any,
    results: Any,
) -> None:
    """One process: race to open the fresh database, then commit ``saves`` checkpoints to run
    ``writer-<index>``, reading its own and a neighbour's latest after each; report back."""
    outcome: dict[str, Any] = {"index": index, "saved": 0, "errors": []}
    try:
        store = LocalStore(store_root, fsync=False)
        barrier.wait(timeout=120)  # everyone creates the schema and the runs at once
        with open_run(f"writer-{index}", db=db_url, store=store) as run:
            barrier.wait(timeout=120)  # every run exists now
            neighbour = open_run(
                f"writer-{(index + 1) % processes}", db=db_url, store=store, writable=False
            )
            try:
                seen = 0
                for step in range(1, saves + 1):
                    try:
                        run.save(step, state(index, step), metrics={"step": step}).wait()
                    except Exception as exc:
                        outcome["errors"].append(f"save {step}: {type(exc).__name__}: {exc}")
                        continue
                    outcome["saved"] += 1
                    latest = run.latest()
                    if latest is None or latest.step != step:
                        outcome["errors"].append(f"latest after save {step}: {latest}")
                    other = neighbour.latest()
                    if other is not None:
                        if other.step < seen:
                            outcome["errors"].append(f"neighbour went back: {other.step}<{seen}")
                        seen = other.step
                    if step % 5 == 0:
                        diff = mismatch(run.load().state, state(index, step))
                        if diff is not None:
                            outcome["errors"].append(f"load after save {step}: {diff}")
            finally:
                neighbour.close()
    except Exception:
        outcome["errors"].append(traceback.format_exc())
    finally:
        results.put(outcome)


def run_contention(tmp_path: Path, processes: int, saves: int, reliability_report: Any) -> None:
    db_url = f"sqlite:///{tmp_path / 'shared.db'}"
    store_root = tmp_path / "store"
    # A fork server imports torch and ckptstore once; each worker is a fork of it (a clean,
    # single-threaded process), instead of every worker importing torch on 2 cores at once.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ckptstore.checkpointer", __name__])
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    workers = [
        ctx.Process(
            target=contention_worker,
            args=(i, processes, db_url, str(store_root), saves, barrier, results),
            name=f"sqlite-writer-{i}",
        )
        for i in range(processes)
    ]
    outcomes: list[dict[str, Any]] = []
    try:
        for worker in workers:
            worker.start()
        for _ in workers:
            outcomes.append(results.get(timeout=240))
        for worker in workers:
            worker.join(timeout=60)
            assert worker.exitcode == 0, f"{worker.name} exited with {worker.exitcode}"
    except queue.Empty:
        pytest.fail(f"workers did not report in time; got {outcomes}")
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
        results.close()
        results.join_thread()

    errors = [e for o in outcomes for e in o["errors"]]
    lock_errors = [e for e in errors if "locked" in e or "busy" in e]
    saved = sum(o["saved"] for o in outcomes)
    reliability_report.add(
        "sqlite contention", processes=processes, saves=saved, lock_errors=len(lock_errors)
    )
    assert lock_errors == []
    assert errors == []
    assert saved == processes * saves

    store = LocalStore(store_root, fsync=False)
    for index in range(processes):
        with open_run(f"writer-{index}", db=db_url, store=store, writable=False) as run:
            rows = [(c.step, c.status) for c in run.checkpoints()]
            assert rows == [(s, "committed") for s in range(1, saves + 1)]
            for step in range(1, saves + 1):
                diff = mismatch(run.load(step).state, state(index, step))
                assert diff is None, f"writer-{index} step {step}: {diff}"
    database = Database(db_url)
    try:
        report = verify(database, store, mark_corrupt=False)
    finally:
        database.close()
    assert report.problems == []
    assert report.checkpoints == processes * saves


@pytest.mark.timeout(240)
def test_sqlite_processes_commit_and_read_concurrently(
    tmp_path: Path, reliability_report: Any
) -> None:
    run_contention(tmp_path, processes=4, saves=15, reliability_report=reliability_report)


@pytest.mark.stress
@pytest.mark.timeout(300)
def test_stress_sqlite_contention(tmp_path: Path, reliability_report: Any) -> None:
    run_contention(tmp_path, processes=6, saves=60, reliability_report=reliability_report)
