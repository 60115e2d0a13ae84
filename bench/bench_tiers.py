"""Node-local tiers (issue 39): recovery after a node loss, what a local save blocks and writes,
replication, drains, and the cost of a checkpoint every step in the reference trainer.

Three nodes (``a``, ``b``, ``c``) are simulated on this machine: each node's tier is its own
directory (``tier-{node}``, standing for its own disk) under the scratch folder on ``/`` (ext4),
or under ``/dev/shm`` (tmpfs, an info row). The object store is a SeaweedFS server (``weed
mini`` on 127.0.0.1, ``tests/s3servers.py``) reached through ``bench/throttle.py``: an asyncio
TCP proxy with a token bucket of ``--rate-mbps`` MB/s per direction (a node's bandwidth to its
object store; the server alone serves 0.4-1 GB/s on loopback). ``--store local`` uses a local
directory instead (no server, no throttle: the smoke test's mode; its ratios mean nothing).

Every state is random fp32 (``randn``, 64 MiB tensors: nothing deduplicates; the float codec
still finds ~1.2x in the exponent bytes, and picks it where the bytes go to S3, not to a local
disk). Each contender's result is checked bit for bit (``torch.equal`` on every tensor) before
anything is timed, and every timed load is checked again after its timing (its destination
tensors zeroed before it). Memory is WARM before every timed call (1.25 GiB written and freed,
as ``/work/shared/ENVIRONMENT.md`` asks) and contenders alternate, the order rotating every
repetition. Medians of ``--reps``. Each section's files are removed after it (a full run peaked
at ~35 GB of disk, ~6 GiB of memory plus the server's ~2 GiB, and took ~9 min).

Rows (``--json PATH`` writes them for ``bench/suite.py``; ``met`` None marks an info row):

a. **Recovery after a node loss** (goal: tiered <= 0.1x remote-only). Two ranks of
   ``--gib-per-rank`` GiB each: rank 0 saved through ``Run.save`` on node a, rank 1 through
   ``writer_store`` + ``ShardWriter`` on node b, R = 2 (a -> a, b; b -> b, c), then drained to
   the throttled store (so the store holds everything too). Node a is lost (its tier deleted),
   the surviving tiers' and the server's files dropped from the page cache
   (``posix_fadvise(DONTNEED)``), and a coordinator on node c runs ``run.load(into=...)``:
   from choosing the checkpoint to every tensor loaded and verified. Remote-only: the same
   state saved to the store by a run without tiers, loaded through the throttle. The tiered
   load must read nothing from the store (``read_bytes``, and the proxy's own count). R = 1:
   node a's blobs come from the store, exactly those (bytes read = the stored bytes of the
   blobs only node a held, from ``blob_copies``). Info: the same on ``/dev/shm``, and the
   floor of an evicted recovery (read + BLAKE3 of one copy of every blob file, every CPU).
b. **Restart**: beside each recovery, ``open_run`` (with tiers: the writer's sweep of its tier)
   and the recoverable-checkpoint query (``run.latest()``), and a fresh interpreter's
   ``import torch, ckptstore``. The rest of a restart (the scheduler, Ray's start, the
   trainer's warm-up) is the trainer's, not measured here.
c. **Blocked time** of ``Run.save`` with tiers (R = 2, async) against an async save without
   tiers to a local directory (goal <= 1.1x): ``SaveHandle.blocked_seconds``.
d. **Local tier write throughput** (goal >= 0.8x the floor): a synchronous local save, R = 1,
   call to commit, against writing the same bytes to files of the same sizes in the same file
   system, each fsynced, then the directory, one thread (dd-style); info: against one file of
   all the bytes (the disk's sequential rate). No eviction falls inside a timed save here.
e. **Curves** (info): local save wall time (call to commit, keep_last=2: each commit drops the
   copies of the checkpoint two saves back, as in a trainer's steady state) and blocked time
   for R = 1, 2, 3 (every node's tier is on this one disk: R copies cost R writes here, where
   peers on their own disks would write in parallel); drain time against size (a quarter, half
   and all of ``--gib-per-rank``); recovery time against the throttle's bandwidth (half, 1x, 2x
   ``--rate-mbps``; one run per point, the setting's own point the medians of row a).
f. **The reference trainer** (``backend=local``, in this process) checkpointing every step to a
   tier (``local_period=1``, ``save_period=1000``) against ``checkpointing.enabled=false``,
   alternating; figure: the mean time between consecutive train steps' ends (steps 3..N, the
   save's blocked part and the background save's competition for the CPUs included). Goal:
   <= 1.05x. Model and batch: :data:`TRAINER` (a step of ~0.35 s here, a 36 MiB checkpoint).
   Beside it, where the time goes: the trainer's checkpoint call per step (what training waits
   for), the manifest's ``blocked_seconds`` and ``save_seconds`` (from the policy's snapshot
   to the commit, which the trainer makes at its next step), and the CPU-seconds per save
   beyond the run without checkpoints; and the same with the tier on ``/dev/shm``.

Run: ``.venv/bin/python bench/bench_tiers.py [--gib-per-rank 1] [--rate-mbps 200] [--reps 3]
[--quick] [--json PATH]``; ``--smoke`` (tiny sizes, one repetition) checks that it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import itertools
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH_DIR))

from bench_async_save import machine  # noqa: E402
from bench_store import cpu_seconds, rotated, warm_memory  # noqa: E402
from throttle import Throttle  # noqa: E402

from ckptstore import ShardWriter, TierConfig, open_run, writer_store  # noqa: E402
from ckptstore.objectstore import LocalStore, ObjectStore, S3Store  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
MB = 1e6
NODES = ("a", "b", "c")
RUN = "tiers"
#: Goals (issue 39).
RECOVERY_GOAL = 0.1
BLOCKED_GOAL = 1.1
WRITE_GOAL = 0.8
TRAINER_GOAL = 1.05
BUCKET = "bench"
#: The reference trainer's model and batch for row f: a step of ~0.3 s on this machine, a
#: checkpoint of ~36 MiB (weights, AdamW moments, replay buffer, data and rollout state).
TRAINER = {
    "policy.d_model": 256,
    "policy.n_layers": 4,
    "policy.n_heads": 4,
    "grpo.num_prompts_per_step": 16,
    "grpo.num_generations_per_prompt": 8,
    "async_rl.max_buffered_rollouts": 32,
    "async_rl.max_inflight_prompts": 16,
}
SMOKE_TRAINER = {"policy.d_model": 32, "policy.n_layers": 1, "policy.n_heads": 2}


# -- measuring ----------------------------------------------------------------------------------


#: Warm memory before every timed call (``--smoke`` measures nothing and skips it).
WARM = [True]


def prepare() -> None:
    """The same memory state before every timed call (see /work/shared/ENVIRONMENT.md)."""
    gc.collect()
    if WARM[0]:
        warm_memory()


def process_cpu(pid: int | None) -> float:
    """CPU-seconds (user + system) process ``pid`` has used; 0 without one."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Sample:
    seconds: float
    cpu: float  # this process, all threads
    server: float  # the S3 server's CPU-seconds
    other: float | None  # share of the CPUs other processes used (not us, not the server)


@dataclass
class Series:
    """The timed runs of one contender."""

    name: str
    samples: list[Sample] = field(default_factory=list)
    #: Extra figures per run (bytes read, ...).
    extra: dict[str, list[float]] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(s.seconds for s in self.samples)

    @property
    def other(self) -> float | None:
        shares = [s.other for s in self.samples if s.other is not None]
        return max(shares) if shares else None

    def note(self, key: str, value: float) -> None:
        self.extra.setdefault(key, []).append(value)

    def extra_median(self, key: str) -> float:
        return statistics.median(self.extra[key])

    def runs(self) -> str:
        return " ".join(f"{s.seconds:.3f}" for s in self.samples)


def children_cpu() -> float:
    """CPU-seconds of this process's waited-for children."""
    times = os.times()
    return times.children_user + times.children_system


class Meter:
    """Times calls after warming memory, recording CPU: ours, the server's, everyone else's
    (children of this process count as ours)."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid

    def __call__(self, series: Series, fn: Callable[[], Any], *, warm: bool = True) -> Any:
        if warm:
            prepare()
        busy0, own0 = cpu_seconds()
        own0 += children_cpu()
        srv0 = process_cpu(self.server_pid)
        started = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - started
        busy1, own1 = cpu_seconds()
        own1 += children_cpu()
        server = process_cpu(self.server_pid) - srv0
        other = None
        if seconds >= 0.2:  # /proc/stat counts 10 ms ticks
            foreign = max(0.0, (busy1 - busy0) - (own1 - own0) - server)
            other = foreign / (seconds * (os.cpu_count() or 1))
        series.samples.append(Sample(seconds, own1 - own0, server, other))
        return result


# -- states -------------------------------------------------------------------------------------

State = dict[str, torch.Tensor]


def random_state(nbytes: float, tensor_bytes: int, seed: int) -> State:
    """Random fp32 tensors of ``tensor_bytes`` each, at least ``nbytes`` in all."""
    count = max(1, -(-int(nbytes) // tensor_bytes))
    gen = torch.Generator().manual_seed(seed)
    return {
        f"layer{i:03d}.weight": torch.randn(tensor_bytes // 4, generator=gen) for i in range(count)
    }


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def touch(state: State, k: int) -> None:
    """New values everywhere: no blob of the next save is stored already."""
    for tensor in state.values():
        tensor.add_(1e-3 * (k + 1))


def empty_like(states: dict[str, State]) -> dict[str, State]:
    return {c: {k: torch.empty_like(v) for k, v in s.items()} for c, s in states.items()}


def zero(states: dict[str, State]) -> None:
    for s in states.values():
        for t in s.values():
            t.zero_()


def check_equal(what: str, got: dict[str, Any], want: dict[str, State]) -> None:
    """Every tensor bit for bit, or exit 1 naming the first that differs."""
    for comp, tensors in want.items():
        loaded = got.get(comp)
        if loaded is None or loaded.keys() != tensors.keys():
            raise SystemExit(f"{what}: component {comp!r} is missing or has other entries")
        for key, tensor in tensors.items():
            if not torch.equal(loaded[key], tensor):
                raise SystemExit(f"{what}: {comp}/{key} differs from what was saved")


# -- files --------------------------------------------------------------------------------------


def files_of(root: Path) -> Iterator[Path]:
    for dirpath, _, names in os.walk(root):
        for name in names:
            yield Path(dirpath) / name


def evict(*roots: Path) -> None:
    """Drop every file under ``roots`` from the page cache (fsynced first, so they are clean)."""
    for root in roots:
        for path in files_of(root):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue  # a socket, or gone meanwhile
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_and_hash(paths: list[Path]) -> int:
    """Read and BLAKE3 every file, a file per thread on every CPU (the floor of an evicted
    verified load); the bytes read."""
    from concurrent.futures import ThreadPoolExecutor

    from blake3 import blake3

    def one(path: Path) -> int:
        hasher = blake3(max_threads=1)
        n = 0
        with open(path, "rb", buffering=0) as f:
            while piece := f.read(4 * MiB):
                hasher.update(piece)
                n += len(piece)
        return n

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return sum(pool.map(one, paths))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_floor(where: Path, sizes: list[int], state: State) -> int:
    """dd-style: the state's bytes into files of ``sizes`` (one thread), each fsynced, then the
    directory; the bytes written."""
    where.mkdir(parents=True)
    views = [t.reshape(-1).view(torch.uint8).numpy().data for t in state.values()]
    flat = iter(views * (1 + sum(sizes) // max(1, sum(v.nbytes for v in views))))
    current = memoryview(next(flat))
    total = 0
    for i, size in enumerate(sizes):
        fd = os.open(where / f"{i:05d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            left = size
            while left:
                if not current.nbytes:
                    current = memoryview(next(flat))
                n = os.write(fd, current[: min(left, current.nbytes, 64 * MiB)])
                current = current[n:]
                left -= n
            os.fsync(fd)
        finally:
            os.close(fd)
        total += size
    fsync_dir(where)
    return total


def object_sizes(root: Path) -> list[int]:
    return sorted(p.stat().st_size for p in files_of(root / "cas"))


# -- manifest -----------------------------------------------------------------------------------


def blob_holders(db: Path, run: str, step: int) -> dict[str, tuple[int, set[str]]]:
    """Every blob of ``run``@``step``: digest -> (stored bytes, nodes with a copy), from
    ``blob_copies``."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT b.digest, b.stored_bytes, c.node FROM checkpoints k "
            "JOIN runs r ON r.id = k.run_id "
            "JOIN checkpoint_blobs cb ON cb.checkpoint_id = k.id "
            "JOIN blobs b ON b.digest = cb.digest "
            "LEFT JOIN blob_copies c ON c.digest = b.digest "
            "WHERE r.name = ? AND k.step = ? AND k.status != 'deleted'",
            (run, step),
        ).fetchall()
    out: dict[str, tuple[int, set[str]]] = {}
    for digest, stored, node in rows:
        entry = out.setdefault(digest, (stored, set()))
        if node is not None:
            entry[1].add(node)
    return out


def checkpoint_column(db: Path, run: str, column: str) -> list[float]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            f"SELECT k.{column} FROM checkpoints k JOIN runs r ON r.id = k.run_id "
            "WHERE r.name = ? AND k.status IN ('local', 'committed', 'deleted') ORDER BY k.step",
            (run,),
        ).fetchall()
    return [float(r[0]) for r in rows if r[0] is not None]


# -- the object store ---------------------------------------------------------------------------


class Remote:
    """The object store: SeaweedFS behind the throttle (``direct`` bypasses it), or a local
    directory (``--store local``)."""

    def __init__(self, scratch: Path, kind: str, rate: float) -> None:
        self.scratch, self.kind, self.rate = scratch, kind, rate
        self.proxy: Throttle | None = None
        self.server: Any = None
        self._stack = contextlib.ExitStack()
        self._opened: list[ObjectStore] = []

    def __enter__(self) -> Remote:
        if self.kind == "s3":
            from ckptstore.testing.factories import plain_client
            from tests.s3servers import seaweed_server

            os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
            os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
            self.server = self._stack.enter_context(seaweed_server(self.scratch / "weed"))
            client = plain_client(self.server.endpoint_url)
            client.create_bucket(Bucket=BUCKET)
            client.close()
            self.proxy = self._stack.enter_context(
                Throttle("127.0.0.1", self.server.s3_port, self.rate)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for store in self._opened:
            store.close()
        self._stack.close()

    @property
    def server_pid(self) -> int | None:
        return self.server.process.pid if self.server is not None else None

    def server_files(self) -> list[Path]:
        """The store's files on this machine (dropped from the page cache before a load)."""
        return [self.scratch / ("weed/data" if self.server is not None else "store")]

    def store(self, prefix: str, *, direct: bool = False) -> ObjectStore:
        """The store at ``prefix``: through the throttle unless ``direct``."""
        if self.kind == "local":
            opened: ObjectStore = LocalStore(self.scratch / "store" / prefix)
        else:
            assert self.proxy is not None
            url = self.server.endpoint_url if direct else self.proxy.endpoint_url
            opened = S3Store(BUCKET, prefix, endpoint_url=url, region_name="us-east-1")
        self._opened.append(opened)
        return opened

    def received(self) -> int:
        """Bytes the server sent through the proxy so far (headers included)."""
        return self.proxy.to_client if self.proxy is not None else 0

    def reset_counts(self) -> None:
        if self.proxy is not None:
            self.proxy.reset_counts()


# -- rows ---------------------------------------------------------------------------------------


@dataclass
class Out:
    """The result rows, printed as a table at the end and written by ``--json``."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(
        self,
        work: str,
        ours: float,
        peer: str,
        theirs: float,
        unit: str,
        goal: str = "info",
        met: bool | None = None,
        other: float | None = None,
    ) -> None:
        self.rows.append(
            {
                "work": work,
                "ours": ours,
                "peer": peer,
                "peer_value": theirs,
                "unit": unit,
                "ratio": ours / theirs if theirs else float("nan"),
                "goal": goal,
                "met": met,
                "other_cpu": other,
            }
        )

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.notes.append(line)


def worst(*series: Series) -> float | None:
    shares = [s.other for s in series if s.other is not None]
    return max(shares) if shares else None


def print_table(rows: list[dict[str, Any]]) -> None:
    print()
    print(
        f"{'work':<64} {'ckptstore':>10} {'peer':>10} {'ratio':>7}  {'goal':<10} {'met':<4} "
        f"{'other%':>6}  peer"
    )
    for row in rows:
        unit = row["unit"]
        verdict = "info" if row["met"] is None else "yes" if row["met"] else "NO"
        other = "   n/a" if row["other_cpu"] is None else f"{row['other_cpu']:>6.0%}"
        print(
            f"{row['work'][:64]:<64} {row['ours']:>9.4g}{unit[:1]} {row['peer_value']:>9.4g}"
            f"{unit[:1]} {row['ratio']:>6.3f}x  {row['goal']:<10} {verdict:<4} {other}  "
            f"{row['peer']}"
        )
    goals = [row for row in rows if row["met"] is not None]
    met = sum(bool(row["met"]) for row in goals)
    print(
        f"\n{met} of {len(goals)} goals met (units: s seconds, M MB/s, B bytes; ratio = "
        "ckptstore / peer; other%: the largest share of the CPUs that processes other than this "
        "one and the S3 server used during a timed run of the row)"
    )


# -- sanity: the throttle -----------------------------------------------------------------------


def throttle_sanity(remote: Remote, meter: Meter, size: int, reps: int, out: Out) -> None:
    """GET one object directly, through the proxy unthrottled, and throttled."""
    from ckptstore.testing.factories import plain_client

    assert remote.proxy is not None
    assert remote.server is not None
    body = os.urandom(1 << 20) * (size >> 20)
    direct = plain_client(remote.server.endpoint_url)
    direct.put_object(Bucket=BUCKET, Key="sanity/object", Body=body)
    del body
    free = Throttle("127.0.0.1", remote.server.s3_port, None)
    with free:
        clients = {
            "direct": direct,
            "proxy, no limit": plain_client(free.endpoint_url),
            "proxy, throttled": plain_client(remote.proxy.endpoint_url),
        }
        series = {name: Series(name) for name in clients}

        def get(name: str) -> int:
            response = clients[name].get_object(Bucket=BUCKET, Key="sanity/object")
            return len(response["Body"].read())

        for name in clients:  # untimed first call each (connections)
            get(name)
        for rep in range(reps):
            for name in rotated(list(clients), rep):
                remote.reset_counts()
                got = meter(series[name], lambda name=name: get(name))
                if got != size:
                    raise SystemExit(f"GET {name}: {got} bytes, not {size}")
                if name == "proxy, throttled":
                    series[name].note("proxied", remote.received())
        for client in clients.values():
            client.close()
    rate = remote.proxy.rate
    assert rate is not None
    print(f"\n[throttle] GET of one {size / MiB:.0f} MiB object, setting {rate / MB:.0f} MB/s")
    for s in series.values():
        print(f"  {s.name:<18} {s.median:7.3f} s  {size / s.median / MB:7.0f} MB/s   {s.runs()}")
    achieved = size / series["proxy, throttled"].median / MB
    proxied = series["proxy, throttled"].extra_median("proxied")
    out.say(
        f"throttle: achieved {achieved:.1f} MB/s against a setting of {rate / MB:.0f} MB/s "
        f"({achieved / (rate / MB):.3f}x); bytes through the proxy {proxied:.0f} = object "
        f"{size} + {proxied - size:.0f} of headers"
    )
    out.add(
        f"throttle sanity: GET {size / MiB:.0f} MiB throttled, achieved rate",
        achieved,
        "the setting",
        rate / MB,
        "MB/s",
        other=series["proxy, throttled"].other,
    )
    for name in ("direct", "proxy, no limit"):
        out.add(
            f"throttle sanity: GET {size / MiB:.0f} MiB, {name}",
            size / series[name].median / MB,
            "the setting",
            rate / MB,
            "MB/s",
            other=series[name].other,
        )


# -- a, b: recovery after a node loss -----------------------------------------------------------


@dataclass
class Tiered:
    """A tiered scenario: its tiers, manifest and what node a alone held."""

    label: str
    base: Path
    replicas: int
    db: Path
    stored: dict[str, tuple[int, set[str]]] = field(default_factory=dict)

    def config(self, node: str) -> TierConfig:
        return TierConfig(
            local_dir=str(self.base / "tier-{node}"),
            node=node,
            nodes=NODES,
            replicas=self.replicas,
            fsync=True,
        )

    def survivors(self) -> list[Path]:
        return [self.config(n).root(n) for n in NODES if n != "a"]

    def only_a(self) -> int:
        """Stored bytes of the blobs only node a held (before its loss)."""
        return sum(size for size, nodes in self.stored.values() if nodes == {"a"})


def build_tiered(scenario: Tiered, states: dict[str, State], store: ObjectStore, out: Out) -> None:
    """Save rank 0 on node a and rank 1 on node b (local), drain, lose node a."""
    for node in NODES:
        scenario.config(node).root(node).mkdir(parents=True, exist_ok=True)
    with open_run(
        RUN, db=scenario.db, store=store, tiers=scenario.config("a"), async_save=True
    ) as run:
        with writer_store(scenario.config("b")) as st, ShardWriter(st) as worker:
            receipt = worker.write("rank1", states["rank1"])
        started = time.perf_counter()
        info = run.save(1, {"rank0": states["rank0"]}, receipts=[receipt]).wait()
        saved = time.perf_counter() - started
        if info.status != "local":
            raise SystemExit(f"{scenario.label}: the save is {info.status!r}, not local")
        report = run.drain()
        if report is None or not report.drained:
            raise SystemExit(f"{scenario.label}: the drain did not finish: {report}")
        # What a recovery that has every node reads: bit-exact before anything is timed.
        check_equal(f"{scenario.label}: load before the node loss", run.load().state, states)
    scenario.stored = blob_holders(scenario.db, RUN, 1)
    print(
        f"  {scenario.label}: saved rank 0 in {saved:.2f} s (+ rank 1 on node b), drained "
        f"{report.uploaded_bytes / MiB:.0f} MiB in {report.seconds:.2f} s "
        f"({report.uploaded_blobs} blobs uploaded, {report.present_blobs} present)",
        flush=True,
    )
    shutil.rmtree(scenario.config("a").root("a"))  # node a is lost, and its disk with it


def build_remote(db: Path, states: dict[str, State], store: ObjectStore) -> None:
    with open_run(RUN, db=db, store=store, async_save=False) as run:
        run.save(1, dict(states))


@dataclass
class Recovery:
    """One contender's recovery: open the run, ask for the newest checkpoint, load."""

    name: str
    open: Series
    latest: Series
    load: Series


def recover(
    meter: Meter,
    rec: Recovery,
    opener: Callable[[], Any],
    into: dict[str, State],
    states: dict[str, State],
    remote: Remote,
    evict_first: list[Path],
) -> dict[str, int]:
    """One timed restart: open, latest, load(into); checked bit for bit after. The bytes read
    from each source (``read_bytes``) and through the proxy (``proxy``)."""
    zero(into)
    evict(*evict_first, *remote.server_files())
    run = meter(rec.open, opener)
    try:
        info = meter(rec.latest, run.latest, warm=False)
        if info is None or info.step != 1:
            raise SystemExit(f"{rec.name}: latest() found {info}, not step 1")
        remote.reset_counts()
        loaded = meter(rec.load, lambda: run.load(into=into))
        proxied = remote.received()
    finally:
        run.close()
    check_equal(rec.name, loaded.state, states)
    read = dict(loaded.read_bytes)
    read["proxy"] = proxied
    rec.load.note("store", read.get("store", 0))
    rec.load.note("proxy", proxied)
    return read


def measure_recovery(
    remote: Remote,
    meter: Meter,
    scratch: Path,
    states: dict[str, State],
    reps: int,
    rates: list[float],
    out: Out,
) -> None:
    """Rows a and b, then the recovery-against-bandwidth curve."""
    size = sum(state_bytes(s) for s in states.values())
    print(f"\n[recovery] 2 ranks x {size / 2 / GiB:.2f} GiB, 3 nodes; building ...", flush=True)
    shm = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir="/dev/shm"))
    scenarios = {
        "tiered R=2 (disk)": Tiered("tiered R=2 (disk)", scratch / "r2", 2, scratch / "r2.db"),
        "tiered R=1 (disk)": Tiered("tiered R=1 (disk)", scratch / "r1", 1, scratch / "r1.db"),
        "tiered R=2 (/dev/shm)": Tiered("tiered R=2 (/dev/shm)", shm / "r2", 2, scratch / "shm.db"),
    }
    remote_db = scratch / "remote.db"
    try:
        # One store for the tiered scenarios: the first drain uploads, the others find every
        # blob present (same bytes). The remote-only run saves its own copy, unthrottled.
        tiered_store = remote.store("tiered")
        for scenario in scenarios.values():
            build_tiered(scenario, states, tiered_store, out)
        build_remote(remote_db, states, remote.store("remote", direct=True))
        remote_store = remote.store("remote")
        into = empty_like(states)
        recs = {
            name: Recovery(name, Series(name), Series(name), Series(name))
            for name in [*scenarios, "remote-only"]
        }

        def opener(name: str) -> Callable[[], Any]:
            if name == "remote-only":
                return lambda: open_run(RUN, db=remote_db, store=remote_store)
            scenario = scenarios[name]
            return lambda: open_run(
                RUN, db=scenario.db, store=tiered_store, tiers=scenario.config("c")
            )

        def evicted(name: str) -> list[Path]:
            return [] if name == "remote-only" else scenarios[name].survivors()

        names = list(recs)
        reads: dict[str, list[dict[str, int]]] = {n: [] for n in names}
        for rep in range(reps):
            for name in rotated(names, rep):
                reads[name].append(
                    recover(meter, recs[name], opener(name), into, states, remote, evicted(name))
                )
        floor = Series("read + BLAKE3 of one copy of every blob, every CPU")
        copies = one_copy_each(scenarios["tiered R=2 (disk)"])
        for _ in range(reps):
            evict(*scenarios["tiered R=2 (disk)"].survivors())
            meter(floor, lambda: read_and_hash(copies))
        remote_stored = sum(s for s, _ in blob_holders(remote_db, RUN, 1).values())
        report_recovery(scenarios, recs, reads, floor, size, remote_stored, remote, out)
        if WARM[0]:  # not in a smoke run: a fresh interpreter costs seconds
            import_time(meter, reps, out)
        if remote.proxy is not None and rates:
            bandwidth_curve(remote, meter, recs, opener, evicted, into, states, rates, out)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def one_copy_each(scenario: Tiered) -> list[Path]:
    """The files a recovery on node c reads: node c's copies, and node b's of the rest."""
    own = {p.name: p for p in files_of(scenario.config("c").root("c") / "cas")}
    peer = {p.name: p for p in files_of(scenario.config("b").root("b") / "cas")}
    return [*own.values(), *(p for name, p in peer.items() if name not in own)]


def report_recovery(
    scenarios: dict[str, Tiered],
    recs: dict[str, Recovery],
    reads: dict[str, list[dict[str, int]]],
    floor: Series,
    size: int,
    remote_stored: int,
    remote: Remote,
    out: Out,
) -> None:
    base = recs["remote-only"]
    rate = remote.proxy.rate if remote.proxy is not None else None
    where = f"{rate / MB:.0f} MB/s throttle" if rate else "local-directory store"
    print(f"\n[recovery] medians of {len(base.load.samples)}; store: {where}")
    print(f"{'contender':<24}{'open s':>8}{'latest s':>9}{'load s':>8}{'GB/s':>6}   read from")
    for rec in recs.values():
        sources = ", ".join(
            f"{k} {v / MiB:.0f} MiB" for k, v in sorted(reads[rec.name][-1].items())
        )
        print(
            f"{rec.name:<24}{rec.open.median:>8.3f}{rec.latest.median:>9.4f}{rec.load.median:>8.3f}"
            f"{size / rec.load.median / 1e9:>6.2f}   {sources}   (load runs {rec.load.runs()})"
        )
    print(f"{floor.name}: {floor.median:.3f} s ({size / floor.median / 1e9:.2f} GB/s)")
    ours = recs["tiered R=2 (disk)"]
    ratio = ours.load.median / base.load.median
    out.say(
        f"recovery after a node loss: tiered R=2 {ours.load.median:.3f} s vs remote-only "
        f"{base.load.median:.3f} s = {ratio:.3f}x (goal <= {RECOVERY_GOAL}x)"
    )
    gib = f"{size / GiB:.2f} GiB"
    out.add(
        f"recovery after node loss, tiered R=2 disk, {gib}",
        ours.load.median,
        "remote-only load via throttle",
        base.load.median,
        "s",
        f"<= {RECOVERY_GOAL}x",
        ratio <= RECOVERY_GOAL,
        worst(ours.load, base.load),
    )
    # Bytes from the store: none with R=2, exactly node a's own with R=1.
    for name in ("tiered R=2 (disk)", "tiered R=2 (/dev/shm)"):
        store_bytes = max(r.get("store", 0) for r in reads[name])
        proxied = max(r["proxy"] for r in reads[name])
        out.say(
            f"{name}: object-store bytes read {store_bytes} (read_bytes), {proxied} through the "
            "proxy"
        )
        if store_bytes != 0:
            raise SystemExit(f"{name}: read {store_bytes} bytes from the store; R=2 needs none")
    r1 = recs["tiered R=1 (disk)"]
    only_a = scenarios["tiered R=1 (disk)"].only_a()
    got = statistics.median(r.get("store", 0) for r in reads["tiered R=1 (disk)"])
    proxied_r1 = statistics.median(r["proxy"] for r in reads["tiered R=1 (disk)"])
    out.say(
        f"tiered R=1: object-store bytes read {got:.0f} (read_bytes), {proxied_r1:.0f} through "
        f"the proxy; stored bytes of the blobs only node a held (blob_copies) {only_a}"
    )
    if got != only_a:
        raise SystemExit(f"tiered R=1 read {got} bytes from the store, not {only_a}")
    out.add(
        "R=1: object-store bytes read vs blobs only node a held",
        got,
        "stored bytes of node a's blobs",
        only_a,
        "B",
        "== 1.0x",
        got == only_a,
    )
    drained = sum(s for s, _ in scenarios["tiered R=2 (disk)"].stored.values())
    out.say(
        f"stored bytes of the checkpoint: {remote_stored} saved to the store by the remote-only "
        f"run (codec chosen for S3), {drained} drained from the tiers (objects as encoded for a "
        f"local disk), {size} logical"
    )
    out.add(
        "stored bytes: drained tier objects vs a remote save's",
        drained,
        "remote-only save's stored bytes",
        remote_stored,
        "B",
    )
    if remote.proxy is not None:
        proxied_base = statistics.median(base.load.extra["proxy"])
        out.say(
            f"remote-only: {proxied_base:.0f} bytes through the proxy for {remote_stored} stored "
            f"bytes (+{proxied_base - remote_stored:.0f} of HTTP headers); achieved "
            f"{proxied_base / base.load.median / MB:.0f} MB/s"
        )
        out.add(
            "R=1: proxy bytes vs read_bytes['store'] (headers included)",
            proxied_r1,
            "read_bytes['store']",
            got,
            "B",
        )
    out.add(
        f"recovery after node loss, tiered R=1 disk, {gib}",
        r1.load.median,
        "remote-only load via throttle",
        base.load.median,
        "s",
        other=worst(r1.load, base.load),
    )
    shm = recs["tiered R=2 (/dev/shm)"]
    out.add(
        f"recovery after node loss, tiered R=2 /dev/shm, {gib}",
        shm.load.median,
        "remote-only load via throttle",
        base.load.median,
        "s",
        other=worst(shm.load, base.load),
    )
    out.add(
        f"recovery tiered R=2 disk vs its floor (read+BLAKE3), {gib}",
        ours.load.median,
        floor.name,
        floor.median,
        "s",
        other=worst(ours.load, floor),
    )
    for name, rec in recs.items():
        label = name.replace("tiered ", "").replace(" (disk)", " disk")
        out.add(
            f"restart: open_run + latest(), {label}",
            rec.open.median + rec.latest.median,
            "its load",
            rec.load.median,
            "s",
        )
    out.notes.append(
        "restart: besides open_run, latest() and the load, a real restart pays the process "
        "start and imports (row 'restart: python -c import torch, ckptstore'), the scheduler, "
        "Ray's start (2-4 s here) and the trainer's own set-up and first step: the trainer's, "
        "not measured here"
    )


def import_time(meter: Meter, reps: int, out: Out) -> None:
    """A fresh interpreter that imports torch and ckptstore (a restart's process start)."""
    series = Series("python -c 'import torch, ckptstore'")
    command = [sys.executable, "-c", "import torch, ckptstore; from ckptstore import open_run"]
    for _ in range(reps):
        meter(series, lambda: subprocess.run(command, check=True, cwd=ROOT))
    out.add(
        "restart: python -c import torch, ckptstore (fresh process)",
        series.median,
        "-",
        series.median,
        "s",
        other=series.other,
    )


def bandwidth_curve(
    remote: Remote,
    meter: Meter,
    recs: dict[str, Recovery],
    opener: Callable[[str], Callable[[], Any]],
    evicted: Callable[[str], list[Path]],
    into: dict[str, State],
    states: dict[str, State],
    rates: list[float],
    out: Out,
) -> None:
    """Recovery time against the throttle's bandwidth: one run per point (the setting's own
    point is the medians above)."""
    assert remote.proxy is not None
    setting = remote.proxy.rate
    names = ["tiered R=2 (disk)", "tiered R=1 (disk)", "remote-only"]
    curve: dict[tuple[float, str], float] = {}
    try:
        for rate in rates:
            if rate == setting:
                for name in names:
                    curve[rate, name] = recs[name].load.median
                continue
            remote.proxy.rate = rate
            for name in names:
                rec = Recovery(name, Series(name), Series(name), Series(name))
                recover(meter, rec, opener(name), into, states, remote, evicted(name))
                curve[rate, name] = rec.load.median
    finally:
        remote.proxy.rate = setting
    print("\n[recovery against bandwidth] load seconds (one run per point; the setting: medians)")
    print(f"{'MB/s':>6}" + "".join(f"{n:>22}" for n in names) + f"{'tiered/remote':>15}")
    for rate in rates:
        row = "".join(f"{curve[rate, n]:>22.3f}" for n in names)
        ratio = curve[rate, "tiered R=2 (disk)"] / curve[rate, "remote-only"]
        print(f"{rate / MB:>6.0f}{row}{ratio:>14.3f}x")
    for rate in rates:
        for name in ("tiered R=2 (disk)", "tiered R=1 (disk)"):
            label = name.replace("tiered ", "").replace(" (disk)", "")
            out.add(
                f"curve: recovery {label} at {rate / MB:.0f} MB/s",
                curve[rate, name],
                f"remote-only at {rate / MB:.0f} MB/s",
                curve[rate, "remote-only"],
                "s",
            )


# -- c: blocked time ----------------------------------------------------------------------------


def measure_blocked(meter: Meter, scratch: Path, state: State, reps: int, out: Out) -> None:
    """Run.save with tiers (R=2, async) against an async save to a local directory."""
    tiers = Tiered("blocked", scratch / "blocked", 2, scratch / "blocked.db")
    for node in NODES:
        tiers.config(node).root(node).mkdir(parents=True, exist_ok=True)
    names = ["Run.save local (tiers, R=2)", "Run.save remote (local dir)"]
    series = {n: Series(n) for n in names}
    with (
        open_run(
            "blocked-tiers",
            db=tiers.db,
            store=scratch / "blocked-unused-store",
            tiers=tiers.config("a"),
        ) as local,
        open_run("blocked-remote", db=tiers.db, store=scratch / "blocked-store") as remote_run,
    ):
        runs = {names[0]: local, names[1]: remote_run}
        steps = iter(range(1, 10**6))
        for name, run in runs.items():  # untimed first save: buffers, threads; checked
            step = next(steps)
            run.save(step, {"rank0": state}).wait()
            check_equal(name, run.load(step).state, {"rank0": state})
        for rep in range(3 * reps):  # 3x: the figures are tens of ms, the goal a 10% margin
            touch(state, 100 + rep)
            for name in rotated(names, rep):
                run = runs[name]
                step = next(steps)
                handle = meter(
                    series[name], lambda run=run, step=step: run.save(step, {"rank0": state})
                )
                series[name].note("blocked", handle.blocked_seconds)
                handle.wait()
    ours, theirs = (series[n] for n in names)
    b_ours, b_theirs = ours.extra_median("blocked"), theirs.extra_median("blocked")
    size = state_bytes(state)
    print(f"\n[blocked] {size / GiB:.2f} GiB; medians of {3 * reps} (3x --reps)")
    for s in series.values():
        print(
            f"  {s.name:<32} blocked_seconds {s.extra_median('blocked'):.3f} s, call "
            f"{s.median:.3f} s   runs {' '.join(f'{x:.3f}' for x in s.extra['blocked'])}"
        )
    ratio = b_ours / b_theirs
    out.say(
        f"blocked: local save {b_ours:.3f} s vs async remote save {b_theirs:.3f} s = "
        f"{ratio:.3f}x (goal <= {BLOCKED_GOAL}x)"
    )
    out.add(
        f"blocked: local save (R=2) vs async save to local dir, {size / GiB:.2f} GiB",
        b_ours,
        "async Run.save, no tiers",
        b_theirs,
        "s",
        f"<= {BLOCKED_GOAL}x",
        ratio <= BLOCKED_GOAL,
        worst(ours, theirs),
    )


# -- d: write throughput ------------------------------------------------------------------------


def measure_write(meter: Meter, scratch: Path, state: State, reps: int, out: Out) -> None:
    """A synchronous local save (R=1) against the dd-style floor, same file system."""
    tiers = Tiered("write", scratch / "write", 1, scratch / "write.db")
    root = tiers.config("a").root("a")
    for node in NODES:
        tiers.config(node).root(node).mkdir(parents=True, exist_ok=True)
    config = TierConfig(
        local_dir=tiers.config("a").local_dir,
        node="a",
        nodes=NODES,
        replicas=1,
        keep_last=reps + 2,  # no eviction (unlinks, TRIM on this disk) inside a timed save
    )
    ours, floor = Series("local save R=1 (call to commit)"), Series("write + fsync files, dir")
    one_file = Series("one file: write + fsync, dir")
    with open_run(
        "write", db=tiers.db, store=scratch / "write-store", tiers=config, async_save=False
    ) as run:
        run.save(1, {"rank0": state})  # untimed: first-use costs; gives the object sizes
        check_equal("local save R=1", run.load(1).state, {"rank0": state})
        sizes = object_sizes(root)
        written = sum(sizes)
        for rep in range(reps):
            touch(state, 200 + rep)
            for name in rotated(["ours", "floor", "one file"], rep):
                if name == "ours":
                    meter(ours, lambda rep=rep: run.save(2 + rep, {"rank0": state}))
                elif name == "floor":
                    meter(floor, lambda rep=rep: write_floor(root / f"floor-{rep}", sizes, state))
                else:
                    one = root / f"one-file-{rep}"
                    meter(one_file, lambda one=one: write_floor(one, [written], state))
    rate, floor_rate = written / ours.median / MB, written / floor.median / MB
    print(f"\n[write] {written / GiB:.3f} GiB in {len(sizes)} objects; medians of {reps}")
    for s in (ours, floor, one_file):
        print(f"  {s.name:<36} {s.median:.3f} s {written / s.median / MB:7.0f} MB/s   {s.runs()}")
    ratio = rate / floor_rate
    out.say(
        f"local tier write: {rate:.0f} MB/s vs the floor {floor_rate:.0f} MB/s = {ratio:.3f}x "
        f"(goal >= {WRITE_GOAL}x)"
    )
    out.add(
        f"local tier write R=1 vs write+fsync floor, {written / GiB:.2f} GiB",
        rate,
        "dd-style write+fsync, same fs",
        floor_rate,
        "MB/s",
        f">= {WRITE_GOAL}x",
        ratio >= WRITE_GOAL,
        worst(ours, floor),
    )
    out.add(
        f"local tier write R=1 vs one file write+fsync, {written / GiB:.2f} GiB",
        rate,
        "one file of the same bytes, 1 thread",
        written / one_file.median / MB,
        "MB/s",
        other=worst(ours, one_file),
    )


# -- e: curves ----------------------------------------------------------------------------------


def replication_curve(meter: Meter, scratch: Path, state: State, reps: int, out: Out) -> None:
    """Local save wall time (call to commit) and blocked time for R = 1, 2, 3."""
    counts = [1, 2, 3]
    series = {r: Series(f"R={r}") for r in counts}
    with contextlib.ExitStack() as stack:
        runs = {}
        for r in counts:
            tiers = Tiered(f"R={r}", scratch / f"repl{r}", r, scratch / "repl.db")
            for node in NODES:
                tiers.config(node).root(node).mkdir(parents=True, exist_ok=True)
            # keep_last=2 (the default): each commit drops the copies of the checkpoint two
            # saves back, as in a trainer's steady state (inside the timed call to commit).
            config = TierConfig(
                local_dir=tiers.config("a").local_dir, node="a", nodes=NODES, replicas=r
            )
            runs[r] = stack.enter_context(
                open_run(f"repl{r}", db=tiers.db, store=scratch / "repl-store", tiers=config)
            )
            runs[r].save(1, {"rank0": state}).wait()  # untimed: buffers, threads
            check_equal(f"R={r}", runs[r].load(1).state, {"rank0": state})
        for rep in range(reps):
            touch(state, 300 + rep)
            for r in rotated(counts, rep):

                def save(r: int = r, rep: int = rep) -> float:
                    handle = runs[r].save(2 + rep, {"rank0": state})
                    handle.wait()
                    return float(handle.blocked_seconds)

                series[r].note("blocked", meter(series[r], save))
    size = state_bytes(state)
    print(
        f"\n[replication] local save of {size / GiB:.2f} GiB, call to commit (keep_last=2: "
        f"each commit drops the copies two saves back); medians of {reps}"
    )
    for r, s in series.items():
        print(
            f"  R={r}: {s.median:.3f} s ({size * r / s.median / MB:.0f} MB/s written in all), "
            f"blocked {s.extra_median('blocked'):.3f} s   runs {s.runs()}"
        )
    for r in counts[1:]:
        out.add(
            f"curve: local save R={r} wall (call to commit), {size / GiB:.2f} GiB",
            series[r].median,
            "R=1",
            series[1].median,
            "s",
            other=worst(series[r], series[1]),
        )
        out.add(
            f"curve: local save R={r} blocked",
            series[r].extra_median("blocked"),
            "R=1",
            series[1].extra_median("blocked"),
            "s",
        )


def drain_curve(
    remote: Remote, meter: Meter, scratch: Path, sizes: list[float], reps: int, out: Out
) -> None:
    """Drain time of a local checkpoint (R=1) of each size to the throttled store."""
    tiers = Tiered("drain", scratch / "drain", 1, scratch / "drain.db")
    for node in NODES:
        tiers.config(node).root(node).mkdir(parents=True, exist_ok=True)
    states = {
        s: random_state(s, min(64 * MiB, max(MiB, int(s) // 4)), 1000 + i)
        for i, s in enumerate(sizes)
    }
    series = {s: Series(f"{s / GiB:.3g} GiB") for s in sizes}
    step = iter(range(1, 10**6))
    with open_run(
        "drain", db=tiers.db, store=remote.store("drain"), tiers=tiers.config("a"), async_save=False
    ) as run:
        for rep in range(reps):
            for s in rotated(sizes, rep):
                touch(states[s], 400 + rep)  # new blobs: nothing in the store yet
                run.save(next(step), {"rank0": states[s]})
                report = meter(series[s], run.drain)
                if report is None or not report.drained or report.present_blobs:
                    raise SystemExit(f"drain of {s / GiB:.3g} GiB: {report}")
                series[s].note("bytes", report.uploaded_bytes)
    rate = remote.proxy.rate if remote.proxy is not None else None
    print(f"\n[drain] a local checkpoint (R=1) to the store; medians of {reps}")
    for ser in series.values():
        nbytes = ser.extra_median("bytes")
        print(
            f"  {ser.name:>9}: {ser.median:.3f} s, {nbytes / ser.median / MB:.0f} MB/s   "
            f"runs {ser.runs()}"
        )
        out.add(
            f"curve: drain {ser.name} to the store, achieved rate",
            nbytes / ser.median / MB,
            "throttle setting" if rate else "-",
            rate / MB if rate else nbytes / ser.median / MB,
            "MB/s",
            other=ser.other,
        )


# -- f: the reference trainer -------------------------------------------------------------------


@dataclass
class TrainerRun:
    #: Seconds between consecutive train steps' ends, steps 3..N.
    intervals: list[float]
    #: Seconds of each ``Controller._checkpoint`` call (training waits for it in every step).
    checkpoint_calls: list[float]
    wall: float
    #: CPU-seconds of this process over the whole run (every thread).
    cpu: float
    #: The manifest's ``blocked_seconds`` and ``save_seconds`` of each checkpoint.
    blocked: list[float]
    save_seconds: list[float]
    saved_bytes: float


def train_once(root: Path, overrides: dict[str, Any]) -> TrainerRun:
    """The reference trainer in this process; the times between consecutive steps' ends and
    of each checkpoint call."""
    from tests.trainer_helpers import small_config
    from trainer.controller import Controller

    cfg = small_config(root, **overrides)
    controller = Controller(cfg, time.time())
    ends: list[float] = []
    calls: list[float] = []
    train_on, checkpoint = controller._train_on, controller._checkpoint

    async def timed_step(chosen: Any, started: float) -> None:
        await train_on(chosen, started)
        ends.append(time.perf_counter())

    async def timed_checkpoint(metrics: dict[str, float]) -> str:
        began = time.perf_counter()
        try:
            return await checkpoint(metrics)
        finally:
            calls.append(time.perf_counter() - began)

    controller._train_on = timed_step  # type: ignore[method-assign]
    controller._checkpoint = timed_checkpoint  # type: ignore[method-assign]
    cpu = time.process_time()
    began = time.perf_counter()
    asyncio.run(controller.run_training())
    wall = time.perf_counter() - began
    cpu = time.process_time() - cpu
    controller.drain()
    intervals = [b - a for a, b in itertools.pairwise(ends[1:])]  # steps 3..N
    db = root / "manifest.db"
    found = db.exists()
    logical = checkpoint_column(db, "t", "logical_bytes") if found else []
    return TrainerRun(
        intervals,
        calls[2:],
        wall,
        cpu,
        checkpoint_column(db, "t", "blocked_seconds") if found else [],
        checkpoint_column(db, "t", "save_seconds") if found else [],
        statistics.median(logical) if logical else 0.0,
    )


def measure_trainer(
    meter: Meter,
    scratch: Path,
    config: dict[str, int],
    steps: int,
    reps: int,
    out: Out,
) -> None:
    """The reference trainer: a local checkpoint every step (tier on disk, on /dev/shm)
    against none, alternating; the mean time between steps."""
    shm = Path(tempfile.mkdtemp(prefix="bench-tiers-trainer-", dir="/dev/shm"))
    base: dict[str, Any] = {k.replace(".", "__"): v for k, v in config.items()}
    base["grpo__max_num_steps"] = steps
    every_step = {"checkpointing__local_period": 1, "checkpointing__save_period": 1000}
    contenders: dict[str, Callable[[Path], dict[str, Any]]] = {
        "off": lambda root: {"checkpointing__enabled": False},
        "tier on disk": lambda root: {
            "checkpointing__local_dir": str(root / "tier-{node}"),
            **every_step,
        },
        "tier on /dev/shm": lambda root: {
            "checkpointing__local_dir": str(shm / root.name / "tier-{node}"),
            **every_step,
        },
    }
    results: dict[str, list[TrainerRun]] = {n: [] for n in contenders}
    series = {n: Series(n) for n in contenders}
    try:
        for rep in range(reps):
            for name in rotated(list(contenders), rep):
                root = scratch / "trainer" / f"{name.replace(' ', '-').replace('/', '')}-{rep}"
                root.mkdir(parents=True)
                overrides = base | contenders[name](root)
                results[name].append(
                    meter(series[name], lambda o=overrides, r=root: train_once(r, o))
                )
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)

    def med(name: str, figure: Callable[[TrainerRun], float]) -> float:
        return statistics.median(figure(r) for r in results[name])

    def mean_step(name: str) -> float:
        return med(name, lambda r: statistics.fmean(r.intervals))

    off = mean_step("off")
    disk = mean_step("tier on disk")
    saves = steps  # one save per step
    saved = med("tier on disk", lambda r: r.saved_bytes)
    text = ", ".join(f"{k}={v}" for k, v in config.items())
    print(
        f"\n[trainer] backend=local, {text}, {steps} steps; a local checkpoint of "
        f"{saved / MiB:.1f} MiB every step; mean time between steps 3..N; medians of {reps} runs"
    )
    print(
        f"{'':<18}{'s/step':>8}{'x off':>7}{'ckpt call':>10}{'blocked':>9}{'save s':>8}"
        f"{'CPU-s/save':>11}{'run wall':>9}   s/step of each run"
    )
    cpu_off = med("off", lambda r: r.cpu)
    for name in contenders:
        step = mean_step(name)
        runs = " ".join(f"{statistics.fmean(r.intervals):.3f}" for r in results[name])
        if name == "off":
            call = blocked = save_s = extra_cpu = float("nan")
        else:
            call = med(name, lambda r: statistics.fmean(r.checkpoint_calls))
            blocked = med(name, lambda r: statistics.fmean(r.blocked))
            save_s = med(name, lambda r: statistics.fmean(r.save_seconds))
            extra_cpu = (med(name, lambda r: r.cpu) - cpu_off) / saves
        print(
            f"  {name:<16}{step:>8.3f}{step / off:>6.2f}x{call:>10.3f}{blocked:>9.3f}"
            f"{save_s:>8.3f}{extra_cpu:>11.3f}{med(name, lambda r: r.wall):>8.1f}s   {runs}"
        )
    print(
        "  ckpt call: the trainer's checkpoint call per step (training waits for it: the "
        "snapshot, and the wait for the previous save's commit); blocked, save s: the "
        "manifest's blocked_seconds and save_seconds per checkpoint; CPU-s/save: this "
        "process's CPU-seconds over the run, less the run without checkpoints, per save"
    )
    ratio = disk / off
    out.say(
        f"trainer: a local checkpoint every step costs {ratio - 1:+.1%} of the step time "
        f"({disk:.3f} vs {off:.3f} s; goal <= {TRAINER_GOAL - 1:.0%}); {text}"
    )
    out.add(
        f"trainer: step time, local ckpt every step ({saved / MiB:.0f} MiB, disk)",
        disk,
        "checkpointing.enabled=false",
        off,
        "s",
        f"<= {TRAINER_GOAL}x",
        ratio <= TRAINER_GOAL,
        worst(series["tier on disk"], series["off"]),
    )
    out.add(
        "trainer: step time, local ckpt every step (/dev/shm)",
        mean_step("tier on /dev/shm"),
        "checkpointing.enabled=false",
        off,
        "s",
        other=worst(series["tier on /dev/shm"], series["off"]),
    )
    out.add(
        "trainer: ckpt call per step (training-visible) / step time",
        med("tier on disk", lambda r: statistics.fmean(r.checkpoint_calls)),
        "mean step, checkpointing off",
        off,
        "s",
    )
    out.add(
        "trainer: blocked_seconds per save (manifest) / step time",
        med("tier on disk", lambda r: statistics.fmean(r.blocked)),
        "mean step, checkpointing off",
        off,
        "s",
    )


# -- main ---------------------------------------------------------------------------------------


OUT = Out()


#: Seconds each section took.
SECTIONS: dict[str, float] = {}


@contextlib.contextmanager
def section(name: str, scratch: Path) -> Iterator[Path]:
    """A section's own scratch folder, removed afterwards (the disk holds one section's files
    at a time); its seconds go to :data:`SECTIONS`."""
    began = time.perf_counter()
    where = scratch / name
    where.mkdir()
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)
        SECTIONS[name] = time.perf_counter() - began


def peak_rss_mib(pid: int | str | None = "self") -> float:
    """The peak resident memory (``VmHWM``) of process ``pid``, in MiB (nan if unknown)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib-per-rank", type=float, default=None, help="state per rank (1.0)")
    parser.add_argument("--rate-mbps", type=float, default=200.0, help="throttle, MB/s (200)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (3)")
    parser.add_argument("--quick", action="store_true", help="0.25 GiB per rank, fewer steps")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 1 rep: that it runs")
    parser.add_argument("--store", choices=["s3", "local"], default="s3")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["sanity", "recovery", "blocked", "write", "curves", "trainer"],
    )
    parser.add_argument("--trainer-steps", type=int, default=None, help="train steps (30)")
    parser.add_argument("--dir", type=Path, default=BENCH_DIR / "out", help="scratch parent")
    parser.add_argument("--json", type=Path, help="write the rows here (bench/suite.py)")
    args = parser.parse_args(argv)
    gib = args.gib_per_rank or (1 / 64 if args.smoke else 0.25 if args.quick else 1.0)
    reps = args.reps or (1 if args.smoke else 3)
    tensor_bytes = MiB if args.smoke else 64 * MiB
    steps = args.trainer_steps or (4 if args.smoke else 15 if args.quick else 30)
    trainer_config = SMOKE_TRAINER if args.smoke else TRAINER
    rate = args.rate_mbps * MB
    WARM[0] = not args.smoke
    only = set(args.only or ["sanity", "recovery", "blocked", "write", "curves", "trainer"])
    started, began = dt.datetime.now().astimezone(), time.perf_counter()
    busy0, own0 = cpu_seconds()
    own0 += children_cpu()
    print(machine())
    print(
        f"{started:%Y-%m-%d %H:%M:%S %Z}; memory: "
        + ("WARM before every timed call (1.25 GiB written and freed)" if WARM[0] else "not warmed")
        + f"; {gib:.3g} GiB per rank; store {args.store}"
        + (f", throttle {args.rate_mbps:.0f} MB/s per direction" if args.store == "s3" else "")
        + f"; reps {reps}"
    )
    args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir))
    server_cpu = server_peak = 0.0
    try:
        with Remote(scratch, args.store, rate) as remote:
            meter = Meter(remote.server_pid)
            if "sanity" in only and remote.proxy is not None:
                with section("sanity", scratch):
                    size = max(MiB, int(256 * MiB * min(1.0, gib)))
                    throttle_sanity(remote, meter, size, reps, OUT)
            if "recovery" in only:
                with section("recovery", scratch) as where:
                    states = {
                        f"rank{r}": random_state(gib * GiB, tensor_bytes, seed=r) for r in (0, 1)
                    }
                    rates = [rate / 2, rate, rate * 2] if "curves" in only else []
                    measure_recovery(remote, meter, where, states, reps, rates, OUT)
                    del states
                    gc.collect()
            state = random_state(gib * GiB, tensor_bytes, seed=7)
            if "blocked" in only:
                with section("blocked", scratch) as where:
                    measure_blocked(meter, where, state, reps, OUT)
            if "write" in only:
                with section("write", scratch) as where:
                    measure_write(meter, where, state, reps, OUT)
            if "curves" in only:
                with section("replication", scratch) as where:
                    replication_curve(meter, where, state, reps, OUT)
                with section("drain", scratch) as where:
                    del state
                    gc.collect()
                    sizes = [gib * GiB * f for f in (0.25, 0.5, 1.0)]
                    drain_curve(remote, meter, where, sizes, reps, OUT)
            if "trainer" in only:
                with section("trainer", scratch) as where:
                    measure_trainer(meter, where, trainer_config, steps, reps, OUT)
            server_cpu = process_cpu(remote.server_pid)
            server_peak = peak_rss_mib(remote.server_pid) if remote.server_pid else 0.0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - began
    busy1, own1 = cpu_seconds()
    own1 += children_cpu()
    other = max(0.0, (busy1 - busy0) - (own1 - own0) - server_cpu) / (wall * (os.cpu_count() or 1))
    print_table(OUT.rows)
    print()
    for note in OUT.notes:
        print(note)
    print("\nseconds per section: " + ", ".join(f"{k} {v:.0f}" for k, v in SECTIONS.items()))
    print(
        f"wall {wall:.0f} s; other processes {other:.0%} of the CPUs over the whole run "
        f"(this process and the S3 server excluded; the server used {server_cpu:.0f} CPU-s); "
        f"peak RSS of this process {peak_rss_mib():.0f} MiB, of the S3 server "
        f"{server_peak:.0f} MiB; load average at the end "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; ended "
        f"{dt.datetime.now().astimezone():%Y-%m-%d %H:%M:%S %Z}"
    )
    if args.json:
        args.json.write_text(json.dumps(OUT.rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
