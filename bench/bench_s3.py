"""S3 throughput and client CPU: ckptstore against boto3's transfer manager on SeaweedFS.

Issue 13, item 5: an S3 save and load through ckptstore should be at least as fast as boto3's
``upload_fileobj`` / ``download_fileobj`` of the same bytes, with less client CPU. On these
2-core machines the SeaweedFS server needs most of a core and a half during an upload, so the
client's CPU per GiB decides the throughput.

Contenders, on one SeaweedFS server (``weed mini`` on 127.0.0.1, started by
``tests/s3servers.py``) and the same bytes (``bench_store.transformer_state``: a GPT-like fp32
state dict of ``--size-gib``, 340 tensors):

- **ours**: ``Run.save(step, {"model": state})`` of a run opened with ``async_save=False`` on an
  ``S3Store`` with its defaults (returns after every blob is stored and the commit is made),
  then ``Run.load(step)`` (every blob's BLAKE3 digest verified). Compression is the library's
  default, ``auto`` (``--compression never`` sends the same raw bytes as boto3): on S3 it
  byte-groups and zstd-compresses the chunks where that saves enough, which these weights
  allow (their exponent bytes compress), so ours may send fewer bytes than boto3;
- **boto3**: the same bytes cut into 8 objects (128 MiB each for 1 GiB), each sent by its own
  thread with ``upload_fileobj`` from a ``BytesIO`` and read back by ``download_fileobj`` into
  a preallocated buffer; one client shared by the 8 threads, botocore's default checksum and
  signing settings (what a user gets), ``TransferConfig`` at its defaults (8 MiB parts, 10
  threads per transfer) and a connection pool big enough for all 80 transfer threads, so
  nothing waits for a connection.

Each repetition runs every contender's save, then every contender's load, the order rotating
from one repetition to the next; before every timed call the allocator is warmed the same way
(1.25 GiB written and freed; /work/shared/ENVIRONMENT.md). Each repetition stores into fresh
keys (ours: a fresh manifest and prefix) and deletes them afterwards, untimed, so nothing
deduplicates. Reported per operation: median wall seconds (and the range), this process's
CPU-seconds (user + system, all threads) per GiB, the SeaweedFS server's CPU-seconds per GiB,
and the share of the machine's CPUs that other processes used meanwhile (high means noise).

Run: ``.venv/bin/python bench/bench_s3.py [--size-gib 1.0] [--reps 3] [--json PATH]``.
``--json`` writes rows ``{"work", "ours", "peer", "peer_value", "unit", "ratio", "goal",
"met"}`` for the bench suite. Scratch files (the server's data, the manifests) live under
``--dir`` (default ``bench/out/``) and are removed at the end.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import psutil
import torch
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH_DIR))

from bench_store import state_bytes, transformer_state, warm_memory  # noqa: E402

from ckptstore import S3Store, open_run  # noqa: E402
from ckptstore.cas import WriterOptions  # noqa: E402
from tests.s3servers import SeaweedServer, seaweed_server  # noqa: E402

GiB = 1 << 30
BUCKET = "bench"
PEER_OBJECTS = 8
PEER_TRANSFER = TransferConfig()
#: One connection per transfer thread: 8 transfers x TransferConfig's 10 threads.
PEER_POOL = PEER_OBJECTS * PEER_TRANSFER.max_request_concurrency
GOAL = 1.0


@dataclass
class Sample:
    """One timed call: wall seconds and CPU-seconds of this process, the server and the rest."""

    wall: float
    own_cpu: float
    server_cpu: float
    other_cpu: float


@dataclass
class Op:
    """Every sample of one contender's operation."""

    name: str
    samples: list[Sample] = field(default_factory=list)

    def median(self, attr: str) -> float:
        return statistics.median(getattr(s, attr) for s in self.samples)

    def spread(self, attr: str, scale: float = 1.0) -> str:
        values = [getattr(s, attr) * scale for s in self.samples]
        return f"{min(values):.2f}-{max(values):.2f}"


class CpuMeter:
    """CPU-seconds so far of this process, of the server (with its children) and of the
    machine's user space."""

    def __init__(self, server: SeaweedServer) -> None:
        assert server.process is not None
        self._server = psutil.Process(server.process.pid)

    def read(self) -> tuple[float, float, float]:
        own = os.times()
        procs = [self._server, *self._server.children(recursive=True)]
        server = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
        busy = psutil.cpu_times()
        machine = busy.user + busy.system + busy.nice + busy.irq + busy.softirq
        return own.user + own.system, server, machine


def timed(meter: CpuMeter, fn: Callable[[], Any]) -> tuple[Sample, Any]:
    """``fn()`` after warming memory: who used how much CPU meanwhile, and its result."""
    gc.collect()
    warm_memory()
    own0, server0, machine0 = meter.read()
    started = time.perf_counter()
    result = fn()
    wall = time.perf_counter() - started
    own1, server1, machine1 = meter.read()
    own, server = own1 - own0, server1 - server0
    other = max(0.0, (machine1 - machine0) - own - server) / (wall * (os.cpu_count() or 1))
    return Sample(wall, own, server, other), result


# -- contenders ---------------------------------------------------------------------------------


class Ours:
    """ckptstore: ``Run.save`` / ``Run.load`` on an ``S3Store`` with its defaults."""

    name = "ckptstore"

    def __init__(
        self, endpoint: str, state: dict[str, torch.Tensor], scratch: Path, compression: str
    ) -> None:
        self.store = S3Store(BUCKET, "ours", endpoint_url=endpoint, region_name="us-east-1")
        self.options = WriterOptions(compression=compression)
        self.state = state
        self.scratch = scratch
        self.run: Any = None
        #: Bytes the last save uploaded (less than the state's when compression paid).
        self.uploaded = 0

    def begin(self, rep: int) -> None:
        """A fresh manifest, so the run knows of no stored blob."""
        self.run = open_run(
            f"rep{rep}",
            db=self.scratch / f"manifest-{rep}.db",
            store=self.store,
            writer_options=self.options,
            async_save=False,
        )

    def save(self) -> None:
        self.uploaded = self.run.save(1, {"model": self.state}).wait().uploaded_bytes

    def load(self) -> Any:
        return self.run.load(1).state

    def end(self) -> None:
        self.run.close()
        self.store.delete(info.key for info in self.store.list())


class _BufferFile(io.RawIOBase):
    """A preallocated buffer that ``download_fileobj`` fills at the offsets it seeks to."""

    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)
        self._view = memoryview(self.buffer)
        self._pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = offset if whence == io.SEEK_SET else self._pos + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        n = len(data)
        self._view[self._pos : self._pos + n] = data
        self._pos += n
        return n


class Boto3Peer:
    """boto3 ``upload_fileobj`` / ``download_fileobj`` of 8 objects, one thread each."""

    name = "boto3"

    def __init__(self, endpoint: str, state: dict[str, torch.Tensor]) -> None:
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            config=Config(max_pool_connections=PEER_POOL),
        )
        whole = b"".join(memoryview(t.numpy()).cast("B") for t in state.values())
        step = -(-len(whole) // PEER_OBJECTS)
        self.objects = [whole[i : i + step] for i in range(0, len(whole), step)]
        self.pool = ThreadPoolExecutor(PEER_OBJECTS, thread_name_prefix="bench-boto3")
        self.prefix = ""

    def begin(self, rep: int) -> None:
        self.prefix = f"boto3/{rep}"

    def save(self) -> None:
        def upload(i: int) -> None:
            body = io.BytesIO(self.objects[i])
            self.client.upload_fileobj(body, BUCKET, f"{self.prefix}/{i}", Config=PEER_TRANSFER)

        list(self.pool.map(upload, range(len(self.objects))))

    def load(self) -> list[bytearray]:
        def download(i: int) -> bytearray:
            out = _BufferFile(len(self.objects[i]))
            self.client.download_fileobj(BUCKET, f"{self.prefix}/{i}", out, Config=PEER_TRANSFER)
            return out.buffer

        return list(self.pool.map(download, range(len(self.objects))))

    def end(self) -> None:
        keys = [{"Key": f"{self.prefix}/{i}"} for i in range(len(self.objects))]
        self.client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


# -- the run ------------------------------------------------------------------------------------


def measure(
    contenders: list[Any], meter: CpuMeter, reps: int, check: Callable[[Any, Any], None]
) -> dict[str, Op]:
    names = [f"{c.name} {what}" for what in ("save", "load") for c in contenders]
    ops = {name: Op(name) for name in names}
    for rep in range(reps):
        order = contenders[rep % len(contenders) :] + contenders[: rep % len(contenders)]
        for contender in order:
            contender.begin(rep)
        for contender in order:
            sample, _ = timed(meter, contender.save)
            ops[f"{contender.name} save"].samples.append(sample)
        for contender in order:
            sample, loaded = timed(meter, contender.load)
            ops[f"{contender.name} load"].samples.append(sample)
            check(contender, loaded)
            del loaded
        for contender in order:
            contender.end()
        print(f"  rep {rep + 1}/{reps} done", flush=True)
    return ops


def checker(state: dict[str, torch.Tensor], peer: Boto3Peer) -> Callable[[Any, Any], None]:
    """Fails the benchmark if a contender's load did not give back the saved bytes."""

    def check(contender: Any, loaded: Any) -> None:
        if isinstance(contender, Ours):
            same = all(torch.equal(loaded["model"][k], v) for k, v in state.items())
        else:
            same = all(bytes(a) == b for a, b in zip(loaded, peer.objects, strict=True))
        if not same:
            raise SystemExit(f"{contender.name}: the loaded bytes differ from the saved ones")

    return check


def report(ops: dict[str, Op], nbytes: int, size_gib: float) -> list[dict[str, Any]]:
    gib = nbytes / GiB
    print(
        f"\n{'operation':<16}{'wall s':>8}{'range':>12}{'MB/s':>7}{'client CPU-s/GiB':>18}"
        f"{'range':>12}{'server CPU-s/GiB':>18}{'others':>8}"
    )
    for op in ops.values():
        wall, own, server = op.median("wall"), op.median("own_cpu"), op.median("server_cpu")
        print(
            f"{op.name:<16}{wall:>8.2f}{op.spread('wall'):>12}{nbytes / wall / 1e6:>7.0f}"
            f"{own / gib:>18.2f}{op.spread('own_cpu', 1 / gib):>12}{server / gib:>18.2f}"
            f"{op.median('other_cpu'):>8.0%}"
        )
    peers = {
        "save": f"boto3 upload_fileobj x{PEER_OBJECTS} (TransferConfig default)",
        "load": f"boto3 download_fileobj x{PEER_OBJECTS} into preallocated buffers",
    }
    rows = []
    for what, peer in peers.items():
        ours, theirs = ops[f"ckptstore {what}"], ops[f"boto3 {what}"]
        for metric, unit, scale in (("wall", "s", 1.0), ("own_cpu", "CPU-s/GiB", 1 / gib)):
            a, b = ours.median(metric) * scale, theirs.median(metric) * scale
            label = "" if metric == "wall" else " client CPU"
            rows.append(
                {
                    "work": f"S3 {what} {size_gib:g} GiB fp32 (SeaweedFS, loopback){label}",
                    "ours": round(a, 3),
                    "peer": peer,
                    "peer_value": round(b, 3),
                    "unit": unit,
                    "ratio": round(a / b, 3),
                    "goal": f"<= {GOAL:.1f}x",
                    "met": a / b <= GOAL,
                }
            )
    print(f"\n{'ours / boto3':<50}{'ratio':>7}  goal")
    for row in rows:
        met = "met" if row["met"] else "NOT met"
        print(f"{row['work']:<50}{row['ratio']:>6.2f}x  {row['goal']} {met}")
    return rows


@contextmanager
def server_and_bucket(scratch: Path) -> Iterator[SeaweedServer]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    with seaweed_server(scratch / "weed") as server:
        client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        client.close()
        yield server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="state size (default 1.0)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (>= 3); medians")
    parser.add_argument(
        "--compression",
        choices=["auto", "never"],
        default="auto",
        help="ckptstore's WriterOptions.compression (default auto, the library default)",
    )
    parser.add_argument("--json", type=Path, help="also write the result rows here")
    parser.add_argument(
        "--dir", type=Path, default=BENCH_DIR / "out", help="parent of the scratch folder"
    )
    args = parser.parse_args(argv)
    if args.reps < 3 or args.size_gib <= 0:
        parser.error("--reps must be >= 3 and --size-gib > 0")
    state = transformer_state(args.size_gib)
    nbytes = state_bytes(state)
    scratch = args.dir.resolve() / f"bench-s3-{os.getpid()}"
    scratch.mkdir(parents=True)
    try:
        with server_and_bucket(scratch) as server:
            ours = Ours(server.endpoint_url, state, scratch, args.compression)
            peer = Boto3Peer(server.endpoint_url, state)
            print(
                f"state: {len(state)} fp32 tensors, {nbytes / GiB:.3f} GiB; SeaweedFS at "
                f"{server.endpoint_url}; ckptstore compression {args.compression}; "
                f"{args.reps} reps, medians; {os.cpu_count()} CPUs, "
                f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
                flush=True,
            )
            try:
                ops = measure([ours, peer], CpuMeter(server), args.reps, checker(state, peer))
                print(
                    f"ckptstore uploaded {ours.uploaded / GiB:.3f} GiB per save "
                    f"(compression {args.compression}), boto3 {nbytes / GiB:.3f} GiB"
                )
            finally:
                ours.store.close()
                peer.pool.shutdown()
                peer.client.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = report(ops, nbytes, args.size_gib)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
