"""Shared parts of the concurrency torture tests (test_concurrency_torture.py), and the child
processes they start.

The states the writers save are reproducible from (writer, step), so the parent, the writers and
the GC checker all know exactly what every checkpoint must load back as. Content repeats on
purpose, so that deduplication shares blobs between live checkpoints, checkpoints that retention
has just deleted, and other runs:

- ``embed``: the same in every run at every step;
- ``shared``: the same in every run at a given step (runs dedup against each other's blobs);
- ``phase``: changes every 3 steps;
- ``cycle``: per writer, repeats every 4 steps: with ``keep_latest_k=2`` it reuses a blob that
  only a deleted checkpoint references, which GC may be condemning or sweeping right then;
- ``w`` and ``moment``: new at every step.

Child processes, ``python concurrency_child.py MODE JSON``, talk in JSON lines: they print events
on stdout and read the parent's lines on stdin; a looping child stops when its stdin closes.

- ``committer``: open a run, say ``ready``, wait for ``go``, save ``steps`` checkpoints
  (asynchronously, retention on), print the outcome.
- ``gc-loop``: say ``ready``, wait for ``go``, then run garbage collection in a loop until stdin
  closes; after every pass, check that every committed checkpoint verifies and that the latest
  checkpoint of each run loads back exactly. Prints the totals.
- ``fenced-writer``: commit step 1, then start step 2 and hold it in flight (its first upload
  waits for the parent's ``go``) while the parent opens the run as a newer writer; report what
  the stale writer's saves do.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ckptstore import RetentionPolicy, Run, SaveHandle, WriterOptions, open_run
from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, FencedError, SaveError
from ckptstore.maintenance import collect_garbage, verify
from ckptstore.manifest import Database
from ckptstore.objectstore import LocalStore, ObjectStore, open_store
from ckptstore.objectstore.base import PutData

#: Tensors of 1 KiB and more get chunk blobs of their own, so small states still share blobs.
OPTIONS = WriterOptions(pack_threshold=1024, max_workers=4)
#: Retention deletes continuously: the 2 newest and the best by reward survive each commit.
RETENTION = RetentionPolicy(keep_top_k=1, metric_name="reward", keep_latest_k=2)
#: The safe ways a save can lose a race with GC: the commit re-checks every blob it references
#: and finds one swept (GC took an object the save had uploaded or meant to reuse), or GC
#: removed the temporary file of an upload in progress (only a LocalStore has those).
SAFE_FAILURES = re.compile(
    r"\d+ blob\(s\) this checkpoint references are missing from "
    r"|writing \S+/cas/[0-9a-f]{2}/[0-9a-f]{64} failed: No such file or directory"
)
FENCED = "was opened for writing by a newer writer"


def tensor(seed: int, numel: int = 512, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def state(writer: int, step: int) -> dict[str, Any]:
    """Writer ``writer``'s state at ``step`` (see the module docstring)."""
    return {
        "policy": {
            "embed": tensor(1),
            "shared": tensor(10_000 + step),
            "phase": tensor(20_000 + step // 3),
            "cycle": tensor(30_000 + 10 * writer + step % 4),
            "w": tensor(1_000_000 + 1000 * writer + step),
        },
        "optimizer": {
            "step": torch.tensor(step),
            "moment": tensor(2_000_000 + 1000 * writer + step, 256, torch.bfloat16),
            "lr": 1e-3 / (1 + step),
        },
        "meta": {"writer": writer, "step": step},
    }


def reward(writer: int, step: int) -> float:
    """Goes up and down, so retention deletes out of step order."""
    return ((writer * 7 + step * 5) % 11) / 10


def expected_kept(committed: list[int], writer: int) -> set[int]:
    """The committed steps RETENTION keeps once every save is done: the two newest and the best
    by reward over every step that committed (ties go to the newer step)."""
    if not committed:
        return set()
    best = max(committed, key=lambda s: (reward(writer, s), s))
    return {*sorted(committed)[-2:], best}


def differences(actual: Any, expected: Any, path: str = "") -> list[str]:
    """Where ``actual`` differs from ``expected``: tensors by dtype, shape and torch.equal."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{path}: {type(actual).__name__}, expected a tensor"]
        got, want = (actual.dtype, list(actual.shape)), (expected.dtype, list(expected.shape))
        if got != want:
            return [f"{path}: {got}, expected {want}"]
        return [] if torch.equal(actual, expected) else [f"{path}: values differ"]
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping) or set(actual) != set(expected):
            keys = sorted(actual) if isinstance(actual, Mapping) else type(actual).__name__
            return [f"{path}: keys {keys}, expected {sorted(expected)}"]
        return [d for k in expected for d in differences(actual[k], expected[k], f"{path}/{k}")]
    if type(actual) is not type(expected) or actual != expected:
        return [f"{path}: {actual!r}, expected {expected!r}"]
    return []


# -- writing -------------------------------------------------------------------------------------


@dataclass
class WriterLog:
    """What one writer's saves came to."""

    attempts: int = 0
    committed: list[int] = field(default_factory=list)
    #: (step, message) of every save that failed.
    failures: list[tuple[int, str]] = field(default_factory=list)


def write_steps(run: Run, writer: int, steps: int, *, retries: int = 20) -> WriterLog:
    """Save steps 1..``steps`` asynchronously, the way a training loop does.

    A save that fails surfaces at the next ``save()``, which then starts nothing; that step is
    simply saved again. The last step is retried until it commits (at most ``retries`` times),
    so the run always ends at ``steps``.
    """
    log = WriterLog()
    handles: list[SaveHandle] = []

    def start(step: int) -> None:
        metrics = {"reward": reward(writer, step)}
        handles.append(run.save(step, state(writer, step), metrics=metrics))
        log.attempts += 1

    step = 1
    while step <= steps:
        try:
            start(step)
        except SaveError:
            start(step)  # the previous save failed (classified below); start this one again
        step += 1

    def outcome(handle: SaveHandle) -> bool:
        try:
            handle.wait()
        except SaveError as exc:
            log.failures.append((handle.step, str(exc)))
            return False
        log.committed.append(handle.step)
        return True

    results = [outcome(h) for h in handles]
    for _ in range(retries):
        if results[-1]:
            break
        start(steps)
        results.append(outcome(handles[-1]))
    return log


# -- garbage collection in a loop, checking after every pass --------------------------------------


@dataclass
class GcStats:
    passes: int = 0
    condemned: int = 0
    swept: int = 0
    orphans: int = 0
    #: Checks after a pass: a verify of every committed checkpoint plus a load of each latest.
    checks: int = 0
    checkpoints_verified: int = 0
    latest_loaded: int = 0
    #: Committed checkpoints that failed to verify or to load back exactly.
    lost: int = 0
    problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def gc_loop(
    db: Database,
    store: ObjectStore,
    grace: dt.timedelta,
    runs: Mapping[str, int],
    stop: threading.Event,
    stats: GcStats,
) -> None:
    """Collect garbage until ``stop`` is set; after each pass, check the invariant for the runs
    ``runs`` (name -> writer). Problems are recorded in ``stats``, never raised."""
    readers: dict[str, Run] = {}
    newest: dict[str, int] = {}
    try:
        while not stop.is_set():
            report = collect_garbage(db, store, grace=grace)
            stats.passes += 1
            stats.condemned += report.condemned
            stats.swept += report.swept
            stats.orphans += report.orphans
            stats.errors += report.errors
            check(db, store, runs, readers, newest, stats)
    except BaseException as exc:
        stats.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        for reader in readers.values():
            reader.close()


def check(
    db: Database,
    store: ObjectStore,
    runs: Mapping[str, int],
    readers: dict[str, Run],
    newest: dict[str, int],
    stats: GcStats,
) -> None:
    """Every committed checkpoint verifies; each run's latest is committed, never older than the
    last one seen, and loads back exactly (no fallback: a damaged latest must show)."""
    stats.checks += 1
    report = verify(db, store, mark_corrupt=False)
    stats.checkpoints_verified += report.checkpoints
    stats.lost += len(report.corrupt_checkpoints)
    stats.problems += [f"verify: {p}" for p in report.problems]
    for name, writer in runs.items():
        if name not in readers:
            try:
                readers[name] = open_run(name, db=db, store=store, writable=False)
            except CheckpointNotFoundError:
                continue  # its writer has not created it yet
        reader = readers[name]
        try:
            loaded = reader.load(fallback=False)
        except CheckpointNotFoundError:
            continue  # nothing committed yet
        info = loaded.info
        stats.latest_loaded += 1
        if info.status != "committed":
            stats.problems.append(f"{name}: latest() returned a {info.status} checkpoint")
        if info.step < newest.get(name, 0):
            stats.problems.append(f"{name}: latest went back from {newest[name]} to {info.step}")
        newest[name] = max(newest.get(name, 0), info.step)
        diff = differences(loaded.state, state(writer, info.step))
        if diff:
            stats.lost += 1
            stats.problems.append(f"{name} step {info.step} loads wrong: {diff[:3]}")


# -- child processes -----------------------------------------------------------------------------


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def open_child_store(spec: Mapping[str, Any]) -> ObjectStore:
    if spec.get("endpoint_url"):
        return open_store(spec["url"], endpoint_url=spec["endpoint_url"])
    return LocalStore(spec["url"], fsync=False)


@contextmanager
def stop_on_stdin_eof() -> Iterator[threading.Event]:
    """An event set when the parent closes our stdin (after its ``go`` line)."""
    stop = threading.Event()

    def watch() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    yield stop


def wait_for_go() -> None:
    line = sys.stdin.readline().strip()
    if line != "go":
        raise SystemExit(f"expected 'go' from the parent, got {line!r}")


def committer(args: Mapping[str, Any]) -> None:
    store = open_child_store(args["store"])
    with open_run(
        args["name"],
        db=args["db"],
        store=store,
        retention=RETENTION,
        writer_options=OPTIONS,
        async_save=True,
    ) as run:
        emit("ready")
        wait_for_go()
        log = write_steps(run, args["writer"], args["steps"])
    store.close()
    emit("done", **asdict(log))


def gc_child(args: Mapping[str, Any]) -> None:
    db = Database(args["db"])
    store = open_child_store(args["store"])
    stats = GcStats()
    emit("ready")
    wait_for_go()
    with stop_on_stdin_eof() as stop:
        gc_loop(db, store, dt.timedelta(seconds=args["grace"]), args["runs"], stop, stats)
    store.close()
    db.close()
    emit("done", **asdict(stats))


class GatedStore(LocalStore):
    """A LocalStore whose uploads, once ``armed``, wait: the first upload calls ``hold(key)``
    (which returns when the test lets the save go on); the others wait for it to return."""

    armed = False

    def __init__(self, root: str, hold: Callable[[str], None]) -> None:
        super().__init__(root, fsync=False)
        self._hold = hold
        self._gate = threading.Lock()
        self._open = threading.Event()

    def put(self, key: str, data: PutData) -> bool:
        if self.armed:
            with self._gate:
                if not self._open.is_set():
                    self._hold(key)
                    self._open.set()
        return super().put(key, data)


def fenced_writer(args: Mapping[str, Any]) -> None:
    def hold(key: str) -> None:
        emit("in-flight", key=key)
        wait_for_go()

    store = GatedStore(args["store"]["url"], hold)
    run = open_run(args["name"], db=args["db"], store=store, writer_options=OPTIONS)
    first = run.save(1, state(0, 1)).wait()
    emit("committed", step=first.step, epoch=run.epoch)
    store.armed = True
    in_flight = run.save(2, state(0, 2))  # its first upload waits for the parent

    def attempt(step: int, wait: Callable[[], Any]) -> None:
        try:
            wait()
        except FencedError as exc:
            emit("fenced", step=step, error=str(exc))
        except CkptStoreError as exc:
            emit("failed", step=step, error=f"{type(exc).__name__}: {exc}")
        else:
            emit("committed", step=step, epoch=run.epoch)

    attempt(2, in_flight.wait)
    # The old job is still alive and carries on saving: refused every time.
    for step in (3, 4):
        attempt(step, lambda step=step: run.save(step, state(0, step)).wait())
    run.close()  # every failure was reported: closing raises nothing
    store.close()
    emit("done")


MODES: dict[str, Callable[[Mapping[str, Any]], None]] = {
    "committer": committer,
    "gc-loop": gc_child,
    "fenced-writer": fenced_writer,
}

if __name__ == "__main__":
    MODES[sys.argv[1]](json.loads(sys.argv[2]))
