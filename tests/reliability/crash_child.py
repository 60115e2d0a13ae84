"""The saving process of the crash-consistency tests (test_crash_points.py), killed on purpose.

A job (JSON) names a database, a store, a run, how many steps to commit first, an action for the
step under test, and a kill point. The child wraps library seams (object-store writes, the
manifest's write transactions, the snapshot copy, retention, ...) with a kill switch; when the
switch reaches the point for the ``nth`` time it appends ``kill POINT`` to the job's progress
file and SIGKILLs its own process (for a partial write it first writes a prefix of the bytes).
Nothing is cleaned up: the parent then checks what a user resuming after such a crash sees.

States are a deterministic function of the step (:func:`make_state`), so the parent knows what
every committed checkpoint must load back as. Some content repeats across steps (dedup shares
blobs, also with checkpoints that retention deleted).

Modes:

- ``python crash_child.py run JOB_JSON``: run one job in this process.
- ``python crash_child.py serve``: a zygote. It imports torch and ckptstore once, then reads one
  job per stdin line, forks a child per job and prints JSON lines on stdout:
  ``{"pid": P}`` when the child starts and ``{"pid": P, "status": S}`` when it ended (S as
  ``subprocess`` reports it: -9 after SIGKILL). A child may print ``{"pid": P, "event": ...}``
  lines too. Forking from a process that imported everything costs milliseconds where a fresh
  interpreter costs seconds, so the fast tier can afford many kill points. The zygote starts no
  threads and opens nothing before it forks. It exits when stdin closes.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch

from ckptstore import RetentionPolicy, Run, ShardWriter, WriterOptions, open_run
from ckptstore.checkpointer import commit as commit_module
from ckptstore.checkpointer.snapshot import Snapshotter
from ckptstore.errors import ObjectStoreError
from ckptstore.manifest import Database
from ckptstore.manifest._orm import blobs as q
from ckptstore.objectstore import LocalStore, ObjectStore, RetryPolicy, S3Store
from ckptstore.objectstore import _local as local_module
from ckptstore.objectstore import _s3 as s3_module

MiB = 1 << 20
#: Tensors of 1 KiB and more get chunk blobs of their own; smaller values go into packs.
OPTIONS = WriterOptions(pack_threshold=1024, max_workers=2)
#: Multipart threshold and part size of the S3 stores of jobs that test multipart uploads.
MULTIPART_BYTES = 5 * MiB
#: Retention deletes on every commit: the 2 newest committed checkpoints survive.
RETENTION = RetentionPolicy(keep_top_k=0, keep_latest_k=2)
FAST_RETRY = RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.01)
#: Exit codes of a child that was not killed.
EXIT_NOT_REACHED = 3
EXIT_ERROR = 4
_KIND_NAMES = {0: "chunk", 1: "pack", 2: "index"}


# -- the states ------------------------------------------------------------------------------


def _randn(seed: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def make_state(step: int, *, big: bool = False) -> dict[str, Any]:
    """The components saved at ``step``: chunks (>= 1 KiB), packed small values and JSON.

    ``frozen`` is the same at every step and ``cycle`` repeats every 3 steps (with
    ``keep_latest_k=2`` a new checkpoint reuses a blob that only a deleted one referenced).
    ``big`` adds an 8 MiB fp32 tensor: a multipart upload on S3 even once the float codec has
    shrunk it (to about 6.7 MiB, over the 5 MiB threshold the crash tests set).
    """
    model: dict[str, Any] = {
        "w": _randn(10 * step + 1, 1024).reshape(32, 32),
        "frozen": _randn(7, 512),
        "cycle": _randn(1000 + step % 3, 384),
        "bias": _randn(10 * step + 2, 16),
        "layers": [_randn(10 * step + 3, 8), _randn(10 * step + 4, 300, torch.bfloat16)],
    }
    if big:
        model["big"] = _randn(10 * step + 5, 2 * MiB)
    return {
        "model": model,
        "optim": {
            "step": torch.tensor(step),
            "exp_avg": _randn(10 * step + 6, 600, torch.bfloat16),
            "mask": _randn(10 * step + 7, 64) > 0,
        },
        "extra": {"lr": 0.001 * step, "tag": f"step-{step}", "flags": [True, None, step]},
    }


def train_in_place(state: Any) -> None:
    """One "training step" on the live state: every float tensor changes in place."""
    if isinstance(state, torch.Tensor):
        if state.is_floating_point():
            state.add_(1.0)
    elif isinstance(state, dict):
        for value in state.values():
            train_in_place(value)
    elif isinstance(state, list):
        for value in state:
            train_in_place(value)


# -- opening the store -------------------------------------------------------------------------


def open_job_store(spec: dict[str, Any]) -> ObjectStore:
    if spec["kind"] == "local":
        return LocalStore(spec["root"], fsync=False)
    options: dict[str, Any] = {"endpoint_url": spec["endpoint_url"], "retry": FAST_RETRY}
    if spec.get("multipart"):
        options.update(multipart_threshold=MULTIPART_BYTES, part_size=MULTIPART_BYTES)
    return S3Store(spec["bucket"], spec["prefix"], **options)


def open_job_run(job: dict[str, Any], store: ObjectStore, *, async_save: bool) -> Run:
    return open_run(
        job["run"],
        db=job["db"],
        store=store,
        retention=RETENTION,
        writer_options=OPTIONS,
        async_save=async_save,
    )


# -- the kill switch ---------------------------------------------------------------------------


class Switch:
    """Counts hits of named points once armed; the ``nth`` hit of ``point`` kills the process.

    A hit names a point and variants (``put.partial`` and ``put.partial.chunk``); while a phase
    is set (``async``, ``shard``, ``controller``, ``finalize``) the names are ``PHASE:name``.
    """

    def __init__(self, point: str, nth: int, progress: int) -> None:
        self.point = point
        self.nth = nth
        self.count = 0
        self.armed = False
        self.phase = ""
        self.progress = progress
        #: When set, a matching hit first waits for this event (what must be going on then).
        self.gate: threading.Event | None = None
        #: Object-store writes raise instead of writing (a store outage), once armed.
        self.fail_puts = False
        self._lock = threading.Lock()
        self._local = threading.local()

    def log(self, line: str) -> None:
        os.write(self.progress, (line + "\n").encode())

    def matches(self, *names: str) -> bool:
        if not self.armed:
            return False
        if self.phase:
            names = tuple(f"{self.phase}:{n}" for n in names)
        return self.point in names

    def hit(self, *names: str, before_kill: Callable[[], None] | None = None) -> None:
        if not self.matches(*names):
            return
        with self._lock:
            self.count += 1
            if self.count != self.nth:
                return
        if self.gate is not None and not self.gate.wait(30):
            self.log(f"gate never opened for {self.point}")
            os._exit(EXIT_ERROR)
        if before_kill is not None:
            before_kill()
        self.die()

    def die(self) -> None:
        self.log(f"kill {self.point}")
        os.kill(os.getpid(), signal.SIGKILL)

    @property
    def kind(self) -> str:
        """Kind of the blob the current thread is storing ("" outside a blob write)."""
        return getattr(self._local, "kind", "")

    @contextmanager
    def storing(self, kind: str) -> Iterator[None]:
        self._local.kind = kind
        try:
            yield
        finally:
            self._local.kind = ""


def _tag(what: str) -> str:
    """The short name of a manifest write transaction (``Database.write``'s ``what``)."""
    for prefix, tag in (
        ("starting checkpoint", "begin"),
        ("committing checkpoint", "commit"),
        ("applying retention", "retention"),
        ("marking a failed", "mark-failed"),
        ("opening run", "open"),
    ):
        if what.startswith(prefix):
            return tag
    return "other"


def install(switch: Switch, store: ObjectStore) -> None:
    """Wrap the seams. Runs in the child only, after the fork."""
    # Snapshot: every tensor copied into the snapshot's host buffers.
    copy_view = Snapshotter._copy_view

    def _copy_view(self: Snapshotter, component: str) -> Any:
        view = copy_view(self, component)

        def wrapped(tensor: torch.Tensor, path: str) -> Any:
            switch.hit("snapshot")
            return view(tensor, path)

        return wrapped

    Snapshotter._copy_view = _copy_view  # type: ignore[method-assign]

    # Manifest write transactions: at their start, after their work before COMMIT, after COMMIT.
    write = Database.write

    def db_write(self: Database, fn: Callable[[Any], Any], *, what: str = "database write") -> Any:
        tag = _tag(what)

        def body(session: Any) -> Any:
            switch.hit(f"{tag}.start")
            out = fn(session)
            session.flush()
            switch.hit(f"{tag}.before-commit")
            return out

        out = write(self, body, what=what)
        switch.hit(f"{tag}.after-commit")
        return out

    Database.write = db_write  # type: ignore[method-assign]

    # Inside the commit transaction: blob rows and refs inserted, components not yet.
    record_components = q.record_components

    def _record_components(session: Any, checkpoint_id: int, components: Any) -> None:
        switch.hit("commit.after-blobs")
        record_components(session, checkpoint_id, components)

    q.record_components = _record_components

    # Inside the commit transaction: the run row is locked, blobs are about to be re-checked.
    check_objects = commit_module.check_objects

    def _check_objects(store: Any, digests: Any) -> Any:
        switch.hit("commit.revalidate")
        return check_objects(store, digests)

    commit_module.check_objects = _check_objects

    # Dedup: the manifest said a blob is already stored, so it is neither probed nor uploaded.
    is_live = Run._is_live_blob

    def _is_live_blob(self: Run, digest: str) -> bool:
        live = is_live(self, digest)
        if live:
            switch.hit("dedup.known")
        return live

    Run._is_live_blob = _is_live_blob  # type: ignore[method-assign]

    # finalize() is being waited in (for points that must happen during it).
    finalize = Run.finalize
    in_finalize = threading.Event()

    def _finalize(self: Run) -> Any:
        in_finalize.set()
        return finalize(self)

    Run.finalize = _finalize  # type: ignore[method-assign]
    switch.in_finalize = in_finalize  # type: ignore[attr-defined]

    # Object writes, any backend: before and after the store's put.
    put = store.put

    def store_put(key: str, data: Any) -> bool:
        kind = _blob_kind(data)
        if switch.fail_puts and switch.armed:
            raise ObjectStoreError(f"writing {store.url}/{key} failed: injected outage")
        with switch.storing(kind):
            switch.hit("put.before", f"put.before.{kind}")
            created = put(key, data)
        switch.hit("put.after", f"put.after.{kind}")
        return created

    store.put = store_put  # type: ignore[method-assign]

    if isinstance(store, LocalStore):
        _install_local(switch)
    else:
        _install_s3(switch)


def _blob_kind(data: Any) -> str:
    if isinstance(data, list | tuple) and data:
        header = bytes(memoryview(data[0])[:8])
        if header[:4] == b"CKPB":
            return _KIND_NAMES.get(header[5], "?")
    return "?"


def _install_local(switch: Switch) -> None:
    # Mid-write: a prefix of the object's bytes is in its temp file when the process dies.
    write_all = local_module._write_all

    def _write_all(fd: int, parts: list[memoryview]) -> None:
        kind = switch.kind
        names = ("put.partial", f"put.partial.{kind}")
        if switch.matches(*names):
            first = parts[0]

            def write_prefix() -> None:
                os.write(fd, first[: max(1, first.nbytes // 2)])

            switch.hit(*names, before_kill=write_prefix)
        write_all(fd, parts)

    local_module._write_all = _write_all

    # The temp file is complete and fsynced; the object is not yet published under its key.
    link = local_module._link_no_replace

    def _link_no_replace(src: Any, dst: Any) -> bool:
        kind = switch.kind
        switch.hit("put.before-link", f"put.before-link.{kind}")
        created = link(src, dst)
        switch.hit("put.after-link", f"put.after-link.{kind}")  # before the directory fsync
        return created

    local_module._link_no_replace = _link_no_replace


def _install_s3(switch: Switch) -> None:
    # Mid-request: half of a PUT's (or a part's) body is on the wire when the process dies.
    # botocore reads the body once to sign it, then urllib3 reads it again in blocks to send
    # it; on the sending pass the first read returns only half the body, and the next read
    # (that half has been sent) kills.
    reader = s3_module._PartsReader
    read = reader.read

    def _read(self: Any, size: int | None = -1) -> bytes:
        kind = switch.kind
        names = ("put.partial", f"put.partial.{kind}")
        if not (switch.matches(*names) and _sending()):
            return read(self, size)
        if getattr(self, "_ckpt_half_sent", False):
            switch.hit(*names)
        half = max(1, self._size // 2)
        self._ckpt_half_sent = True
        want = half - self._pos if size is None or size < 0 else min(size, half - self._pos)
        return read(self, max(1, want))

    reader.read = _read  # type: ignore[method-assign]

    upload_part = S3Store._upload_part

    def _upload_part(
        self: S3Store, key: str, full: str, upload_id: str, number: int, *rest: Any
    ) -> str:
        switch.hit(f"put.part{number}")
        return upload_part(self, key, full, upload_id, number, *rest)

    S3Store._upload_part = _upload_part  # type: ignore[method-assign,assignment]


def _sending() -> bool:
    """Whether the HTTP layer (not the signer) is reading a request body right now."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "chunk_readable" or (
            code.co_name == "send" and code.co_filename.endswith("http/client.py")
        ):
            return True
        frame = frame.f_back
    return False


# -- actions: what the child does with the step under test -------------------------------------


def _save_sync(switch: Switch, run: Run, step: int, job: dict[str, Any]) -> None:
    run.save(step, make_state(step, big=job.get("big", False))).wait()


def _save_async_training(switch: Switch, run: Run, step: int, job: dict[str, Any]) -> None:
    """An async save while the training loop keeps mutating the state it saved."""
    state = make_state(step, big=job.get("big", False))
    training = threading.Event()
    switch.gate = training  # the kill waits until training has really gone on
    switch.phase = "async"
    handle = run.save(step, state)
    while not handle.done():
        train_in_place(state)
        training.set()
    handle.wait()


def _save_shard(switch: Switch, run: Run, step: int, job: dict[str, Any]) -> None:
    """A worker stores its shard with a ShardWriter; the controller commits the receipt."""
    state = make_state(step, big=job.get("big", False))
    switch.phase = "shard"
    with ShardWriter(run.store, options=OPTIONS) as writer:
        receipt = writer.write("model", state.pop("model"))
    switch.hit("receipt")
    switch.phase = "controller"
    run.save(step, state, receipts=[receipt]).wait()


def _save_finalize(switch: Switch, run: Run, step: int, job: dict[str, Any]) -> None:
    """An async save, then finalize() waits for it; the kill comes while finalize waits."""
    switch.gate = switch.in_finalize  # type: ignore[attr-defined]
    switch.phase = "finalize"
    run.save(step, make_state(step, big=job.get("big", False)))
    run.finalize()


def _reopen(switch: Switch, run: Run, step: int, job: dict[str, Any]) -> None:
    """A new writer opens the run (bumping the writer epoch) — killed while it does."""
    open_job_run(job, run.store, async_save=False).close()


def _save_failing(switch: Switch, run: Run, step: int, job: dict[str, Any]) -> None:
    """The store fails every write; the save fails and its row is being marked failed."""
    switch.fail_puts = True
    run.save(step, make_state(step, big=job.get("big", False))).wait()


ACTIONS: dict[str, Callable[[Switch, Run, int, dict[str, Any]], None]] = {
    "sync": _save_sync,
    "async": _save_async_training,
    "shard": _save_shard,
    "finalize": _save_finalize,
    "reopen": _reopen,
    "failing": _save_failing,
}


def run_job(job: dict[str, Any]) -> int:
    """Commit ``before`` steps, arm the switch, run the action on step ``before + 1``."""
    progress = os.open(job["progress"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    switch = Switch(job["point"], job.get("nth", 1), progress)
    store = open_job_store(job["store"])
    install(switch, store)
    big = job.get("big", False)
    with open_job_run(job, store, async_save=True) as run:
        for step in range(1, job["before"] + 1):
            run.save(step, make_state(step, big=big)).wait()
            switch.log(f"done {step}")
        step = job["before"] + 1
        switch.log(f"armed {step}")
        switch.armed = True
        ACTIONS[job["action"]](switch, run, step, job)
    switch.log("finished without reaching the kill point")
    return EXIT_NOT_REACHED


def stream_job(job: dict[str, Any]) -> int:
    """Resume from the latest checkpoint and save a stream of async checkpoints while
    "training" mutates the state, until the parent kills the process at a random moment."""
    progress = os.open(job["progress"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    store = open_job_store(job["store"])
    with open_job_run(job, store, async_save=True) as run:
        latest = run.latest()
        first = latest.step + 1 if latest is not None else 1
        announced = False
        for step in range(first, first + job.get("max_saves", 10_000)):
            state = make_state(step)
            os.write(progress, f"start {step}\n".encode())
            handle = run.save(step, state)
            if not announced:
                print(json.dumps({"pid": os.getpid(), "event": "streaming"}), flush=True)
                announced = True
            while not handle.done():
                train_in_place(state)
            handle.wait()
            os.write(progress, f"done {step}\n".encode())
    return EXIT_NOT_REACHED


def execute(job: dict[str, Any]) -> int:
    try:
        if job.get("mode") == "stream":
            return stream_job(job)
        return run_job(job)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return EXIT_ERROR


# -- the zygote --------------------------------------------------------------------------------


def serve() -> None:
    # Warm what every job needs before forking: imports done, the datetime C module loaded.
    dt.datetime.now(dt.UTC)
    torch.set_num_threads(1)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        assert threading.active_count() == 1, "the zygote must not fork with threads running"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = EXIT_ERROR
            try:
                _die_with_parent()
                code = execute(job)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "status": _returncode(status)}), flush=True)


def _die_with_parent() -> None:
    """A job's process dies with the zygote (Linux), so no saving process outlives the tests."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the zygote died before the call
        os._exit(EXIT_ERROR)


def _returncode(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        serve()
        return 0
    if argv[:1] == ["run"] and len(argv) == 2:
        return execute(json.loads(argv[1]))
    print("usage: crash_child.py serve | run JOB_JSON", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
