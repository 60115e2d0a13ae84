"""DCP save and load over S3: ckptstore's DCP integration against AWS's s3torchconnector and a
plain boto3 baseline, side by side in one run on one SeaweedFS server (issue 43).

Contenders, one process (no process group: DCP's single-process path), the same fp32 state
(``bench_store.transformer_state``: a GPT-like state dict of ``--size-gib``, 340 tensors), each
repetition saving into fresh keys of one bucket on one ``weed mini`` server on 127.0.0.1
(started by ``tests/s3servers.py``), then loading into preallocated tensors:

- **ckptstore**: ``ckptstore.integrations.dcp.save(state, run, step)`` with a writable run over a
  fresh SQLite manifest and an ``S3Store`` with its defaults (compression ``auto``, the library
  default: it byte-groups and zstd-compresses chunks where that saves enough, so it may send
  fewer bytes; ``--compression never`` sends the raw bytes), then
  ``ckptstore.integrations.dcp.load(dest, read_only_run, step)`` (every blob's digest checked);
- **s3torchconnector**: ``dcp.save(state, storage_writer=S3StorageWriter(region, s3://...,
  thread_count=--s3tc-threads))`` and ``dcp.load(dest, storage_reader=S3StorageReader(...))``
  (its default ``dcp_optimized`` reader). Its writer and reader take no endpoint, so the bench
  swaps in an ``S3FileSystem`` over ``S3Client(region, endpoint=..., s3client_config=
  S3ClientConfig(force_path_style=True))`` after building them (the same client, pointed at
  SeaweedFS);
- **boto3**: one ``s3transfer`` ``TransferManager`` with ``TransferConfig(max_concurrency=8)``
  (8 threads) uploading every tensor's bytes as one object (``upload``) and downloading each
  into its preallocated tensor (``download``); botocore's default signing and checksums (what a
  user gets);
- **ckptstore+obstore** (prototype, ``--no-obstore`` leaves it out): ckptstore's DCP save and
  load as above over a subclass of ``S3Store``, defined in this file only, whose data path (PUT,
  whole GET, streamed ranged GET) goes through ``obstore`` (Rust ``object_store``) instead of
  boto3; HEAD, LIST and DELETE stay boto3's. It answers "would ckptstore be faster on S3 with a
  Rust client for the bytes", measured in the same run; the library is unchanged.

Per repetition every contender saves, then every contender loads, in an order that rotates from
one repetition to the next; before each timed call the allocator is warmed the same way (1.25
GiB touched and freed; /work/shared/ENVIRONMENT.md: WARM memory). Loads go into one set of
preallocated tensors, zeroed (untimed) before each load and compared bit for bit with the saved
state after it (untimed; exit status 1 on any difference). Each repetition's keys are deleted
afterwards, untimed, so nothing deduplicates across repetitions. Reported: median seconds (and
range), GB/s (state bytes / median seconds), this process's CPU-seconds (user + system, every
thread: Python, CRT and tokio threads alike), the SeaweedFS server's CPU-seconds, the share of
the machine's CPUs other processes used meanwhile, and the ratio ckptstore / best peer
(s3torchconnector or boto3) for save and load; goal <= 1.0x.

``--profile`` instead runs one ckptstore save and load (after an untimed warm-up) under a
cProfile in every thread (a ``threading.setprofile`` hook set just before each profiled call:
the DCP reader's and ckptstore's writer pools start their threads per call, so every worker is
covered) and prints the merged top functions by own time and by cumulative time: where
ckptstore's time goes on S3.

The first runs of this bench found a library bug, since fixed (68d6c9d): a DCP load's
``BlobCache.read`` took and released a read-only (decompressed) blob twice per read, so the blob
was dropped half-way and every later read fetched and decoded it again (bench/RESULTS.md).

Run (no Makefile needed)::

    .venv/bin/python bench/bench_s3_dcp.py --size-gib 1 --reps 3
    .venv/bin/python bench/bench_s3_dcp.py --size-gib 1 --profile

Needs ``s3torchconnector`` with its DCP extra (``.venv/bin/python -m pip install
's3torchconnector[dcp]' 'torch==2.13.0'``; without the extra ``import s3torchconnector.dcp``
fails on ``tenacity``) and ``obstore`` for the prototype; ``--no-s3tc`` / ``--no-obstore``
leave either out.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import torch
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH_DIR))

from bench_s3 import BUCKET, CpuMeter, Op, timed  # noqa: E402
from bench_s3 import server_and_bucket as _server_and_bucket  # noqa: E402
from bench_store import state_bytes, transformer_state  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore import S3Store  # noqa: E402
from ckptstore.cas import WriterOptions  # noqa: E402
from ckptstore.integrations import dcp as ckpt_dcp  # noqa: E402
from ckptstore.objectstore.base import ObjectReader, PutData, as_parts  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
REGION = "us-east-1"
BOTO3_THREADS = 8
GOAL = 1.0
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
State = dict[str, torch.Tensor]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def delete_prefix(client: Any, prefix: str) -> None:
    """Delete every key under ``prefix`` of the bucket (untimed cleanup)."""
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


# -- ckptstore, over boto3 (the library) or over the obstore prototype -------------------------


class Ckptstore:
    """``ckptstore.integrations.dcp`` save/load over an S3Store (or the obstore prototype)."""

    def __init__(
        self,
        name: str,
        store: S3Store,
        scratch: Path,
        compression: str,
        prefix: str,
    ) -> None:
        self.name = name
        self.store = store
        self.scratch = scratch
        self.options = WriterOptions(compression=compression)
        self.prefix = prefix
        self.run: Any = None
        self.db = ""
        self.uploaded = 0

    def begin(self, rep: int) -> None:
        """A fresh manifest, so the run knows of no stored blob (untimed)."""
        self.db = str(self.scratch / f"{self.prefix}-manifest-{rep}.db")
        self.run = ckptstore.open_run(
            f"rep{rep}",
            db=self.db,
            store=self.store,
            writer_options=self.options,
            async_save=False,
        )

    def save(self, state: State) -> None:
        info = ckpt_dcp.save(state, self.run, 1, writer_options=self.options)
        assert isinstance(info, ckptstore.CheckpointInfo)
        self.uploaded = info.uploaded_bytes

    def load(self, dest: State) -> None:
        reader = ckptstore.open_run(self.run.name, db=self.db, store=self.store, writable=False)
        try:
            ckpt_dcp.load(dest, reader, 1)
        finally:
            reader.close()

    def end(self, client: Any) -> None:
        self.run.close()
        delete_prefix(client, self.prefix + "/")


class _ObstoreReader:
    """One object read at any offset (``ObjectReader``): one HEAD for its size, then one streamed
    ranged GET from the first offset read, which later reads in order continue (a read that
    goes elsewhere starts a new one) -- the access pattern of ckptstore's ``S3ObjectReader``."""

    def __init__(self, obs: Any, store: Any, path: str) -> None:
        self._obs, self._store, self._path = obs, store, path
        self.size = int(obs.head(store, path)["size"])
        self._stream: Iterator[Any] | None = None
        self._chunk = memoryview(b"")
        self._position = 0  # object offset of self._chunk's first byte

    def read_into(self, offset: int, view: memoryview) -> None:
        if offset + view.nbytes > self.size:
            raise ValueError(f"{self._path}: [{offset}, {offset + view.nbytes}) past {self.size}")
        if self._stream is None or offset != self._position:
            result = self._obs.get(self._store, self._path, options={"range": {"offset": offset}})
            self._stream = iter(result.stream(min_chunk_size=MiB))
            self._chunk, self._position = memoryview(b""), offset
        done = 0
        while done < view.nbytes:
            if not self._chunk.nbytes:
                self._chunk = memoryview(next(self._stream)).cast("B")
            n = min(self._chunk.nbytes, view.nbytes - done)
            view[done : done + n] = self._chunk[:n]
            self._chunk = self._chunk[n:]
            self._position += n
            done += n

    def close(self) -> None:
        self._stream, self._chunk = None, memoryview(b"")


class ObstoreS3Store(S3Store):
    """PROTOTYPE, bench only: an S3Store whose bytes go through obstore (PUT with
    ``mode="create"`` -- S3's ``If-None-Match: *`` -- whole and ranged GETs) while HEAD, LIST,
    DELETE stay boto3's. No retries or error translation on the obstore calls: it measures the
    data path, it is not a store to use."""

    def __init__(self, bucket: str, prefix: str, *, endpoint_url: str) -> None:
        import obstore
        from obstore.store import S3Store as ObsS3Store

        super().__init__(bucket, prefix, endpoint_url=endpoint_url, region_name=REGION)
        self._obs = obstore
        self._ostore = ObsS3Store(
            bucket,
            endpoint=endpoint_url,
            region=REGION,
            access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
            secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
            virtual_hosted_style_request=False,
            client_options={"allow_http": True},
        )

    def put(self, key: str, data: PutData) -> bool:
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        parts = as_parts(data)
        body: Any = parts[0] if len(parts) == 1 else b"".join(parts)
        try:
            self._obs.put(self._ostore, self._key(key), body, mode="create", use_multipart=False)
        except (AlreadyExistsError, PreconditionError):
            return False
        return True

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        if byte_range is None:
            return bytearray(memoryview(self._obs.get(self._ostore, self._key(key)).bytes()))
        if byte_range[0] == byte_range[1]:
            return bytearray()
        got = self._obs.get_range(
            self._ostore, self._key(key), start=byte_range[0], end=byte_range[1]
        )
        return bytearray(memoryview(got))

    def get_view(self, key: str) -> memoryview:
        return memoryview(self._obs.get(self._ostore, self._key(key)).bytes()).cast("B")

    @contextlib.contextmanager
    def open_reader(self, key: str) -> Iterator[ObjectReader]:
        reader = _ObstoreReader(self._obs, self._ostore, self._key(key))
        try:
            yield reader
        finally:
            reader.close()


# -- the peers ----------------------------------------------------------------------------------


class S3tc:
    """s3torchconnector's DCP ``S3StorageWriter`` / ``S3StorageReader``."""

    name = "s3torchconnector"

    def __init__(self, endpoint: str, threads: int) -> None:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client

        self.endpoint = endpoint
        self.threads = threads
        self.config = S3ClientConfig(force_path_style=True)
        self.client = S3Client(REGION, endpoint=endpoint, s3client_config=self.config)
        self.path = ""

    def _fs(self, reader_constructor: Any = None) -> Any:
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        return S3FileSystem(REGION, s3_client=self.client, reader_constructor=reader_constructor)

    def begin(self, rep: int) -> None:
        self.path = f"s3://{BUCKET}/s3tc/{rep}"

    def save(self, state: State) -> None:
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter(REGION, self.path, self.config, thread_count=self.threads)
        writer.fs = self._fs()  # the same client, pointed at the endpoint
        writer.path = writer.fs.init_path(self.path)
        dcp_save(state, storage_writer=writer)

    def load(self, dest: State) -> None:
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader(REGION, self.path, self.config)
        reader.fs = self._fs(reader._reader_constructor)
        reader.path = reader.fs.init_path(self.path)
        dcp_load(dest, storage_reader=reader)

    def end(self, client: Any) -> None:
        delete_prefix(client, f"s3tc/{self.path.rsplit('/', 1)[1]}/")


class _TensorFile(io.RawIOBase):
    """A tensor's bytes as a seekable file: read for uploads, written at offsets by downloads."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._view = memoryview(tensor.numpy()).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self._view.nbytes - self._pos))
        buf[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def write(self, data: Any) -> int:
        n = len(data)
        self._view[self._pos : self._pos + n] = data
        self._pos += n
        return n


class Boto3:
    """A plain baseline: one TransferManager, 8 threads, one object per tensor."""

    name = "boto3"

    def __init__(self, client: Any) -> None:
        self.config = TransferConfig(max_concurrency=BOTO3_THREADS)
        self.manager = create_transfer_manager(client, self.config)
        self.prefix = ""

    def begin(self, rep: int) -> None:
        self.prefix = f"boto3/{rep}"

    def save(self, state: State) -> None:
        futures = [
            self.manager.upload(_TensorFile(t), BUCKET, f"{self.prefix}/{name}")
            for name, t in state.items()
        ]
        for f in futures:
            f.result()

    def load(self, dest: State) -> None:
        futures = [
            self.manager.download(BUCKET, f"{self.prefix}/{name}", _TensorFile(t))
            for name, t in dest.items()
        ]
        for f in futures:
            f.result()

    def end(self, client: Any) -> None:
        delete_prefix(client, self.prefix + "/")


# -- the run ------------------------------------------------------------------------------------


def measure(
    contenders: list[Any], meter: CpuMeter, reps: int, state: State, dest: State, client: Any
) -> tuple[dict[str, Op], list[str]]:
    ops = {f"{c.name} {w}": Op(f"{c.name} {w}") for w in ("save", "load") for c in contenders}
    bad: list[str] = []
    for rep in range(reps):
        k = rep % len(contenders)
        order = contenders[k:] + contenders[:k]
        for c in order:
            c.begin(rep)
        for c in order:
            sample, _ = timed(meter, lambda c=c: c.save(state))
            ops[f"{c.name} save"].samples.append(sample)
        for c in order:
            for t in dest.values():
                t.zero_()
            sample, _ = timed(meter, lambda c=c: c.load(dest))
            ops[f"{c.name} load"].samples.append(sample)
            bad += [
                f"rep {rep + 1} {c.name}: {n}" for n in state if not torch.equal(state[n], dest[n])
            ]
        for c in order:
            c.end(client)
        print(f"  rep {rep + 1}/{reps} done (load average {load_average()})", flush=True)
    return ops, bad


def report(ops: dict[str, Op], nbytes: int, names: list[str]) -> list[dict[str, Any]]:
    """Print the table and the ratios; the goal rows for ``bench/suite.py``."""
    gib = nbytes / GiB
    rows: list[dict[str, Any]] = []
    print(
        "\n| operation | median s | range s | GB/s | client CPU-s | CPU-s/GiB | server CPU-s "
        "| others |\n|---|--:|--:|--:|--:|--:|--:|--:|"
    )
    for what in ("save", "load"):
        for name in names:
            op = ops[f"{name} {what}"]
            wall, own = op.median("wall"), op.median("own_cpu")
            print(
                f"| {op.name} | {wall:.2f} | {op.spread('wall')} | {nbytes / wall / 1e9:.2f} | "
                f"{own:.2f} | {own / gib:.2f} | {op.median('server_cpu'):.2f} | "
                f"{op.median('other_cpu'):.0%} |"
            )
    print()
    for what in ("save", "load"):
        peers = [n for n in names if n in ("s3torchconnector", "boto3")]
        best = min(peers, key=lambda n: ops[f"{n} {what}"].median("wall"))
        ours = ops[f"ckptstore {what}"].median("wall")
        theirs = ops[f"{best} {what}"].median("wall")
        met = "met" if ours / theirs <= GOAL else "NOT met"
        rows.append(
            {
                "work": f"DCP {what} {gib:.2f} GiB over S3 (SeaweedFS, loopback)",
                "ours": ours,
                "peer": f"{best} (DCP {'writer' if what == 'save' else 'reader'})"
                if best == "s3torchconnector"
                else f"{best} x{BOTO3_THREADS} threads",
                "peer_value": theirs,
                "unit": "s",
                "ratio": ours / theirs,
                "goal": f"<= {GOAL:.1f}x",
                "met": ours / theirs <= GOAL,
            }
        )
        cpu = ops[f"ckptstore {what}"].median("own_cpu") / ops[f"{best} {what}"].median("own_cpu")
        print(
            f"{what}: ckptstore / best peer ({best}) = {ours / theirs:.2f}x wall "
            f"(goal <= {GOAL:.1f}x: {met}), {cpu:.2f}x client CPU"
        )
        for peer in peers:
            if peer != best:
                r = ours / ops[f"{peer} {what}"].median("wall")
                print(f"{what}: ckptstore / {peer} = {r:.2f}x wall")
        for variant in ("ckptstore+obstore",):
            if variant not in names:
                continue
            proto = ops[f"{variant} {what}"]
            print(
                f"{what}: {variant} (prototype) / ckptstore = "
                f"{proto.median('wall') / ours:.2f}x wall, "
                f"{proto.median('own_cpu') / ops[f'ckptstore {what}'].median('own_cpu'):.2f}x "
                f"client CPU; / best peer = {proto.median('wall') / theirs:.2f}x wall"
            )
    return rows


def profile(ours: Ckptstore, state: State, dest: State, client: Any, top: int) -> None:
    """One ckptstore save and load with a cProfile in every thread; merged stats printed."""
    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()

    def start_in_thread(*_: Any) -> None:
        sys.setprofile(None)
        prof = cProfile.Profile()
        with lock:
            profiles.append(prof)
        prof.enable()

    for what, fn in (("save", lambda: ours.save(state)), ("load", lambda: ours.load(dest))):
        profiles.clear()
        threading.setprofile(start_in_thread)
        main = cProfile.Profile()
        t0, c0 = time.perf_counter(), os.times()
        main.enable()
        fn()
        main.disable()
        wall, c1 = time.perf_counter() - t0, os.times()
        threading.setprofile(None)  # type: ignore[arg-type]
        for p in profiles:
            with contextlib.suppress(ValueError):
                p.disable()
        cpu = (c1.user + c1.system) - (c0.user + c0.system)
        print(
            f"\n=== ckptstore {what}: {wall:.2f} s wall, {cpu:.2f} CPU-s, "
            f"{len(profiles)} worker threads profiled (times are summed over threads: "
            f"a thread blocked in a socket counts its wait) ==="
        )
        stats = pstats.Stats(main)
        for p in profiles:
            with contextlib.suppress(TypeError):
                stats.add(p)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
    ours.end(client)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="state size (default 1)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (>= 3); medians")
    parser.add_argument("--compression", choices=["auto", "never"], default="auto")
    parser.add_argument("--s3tc-threads", type=int, default=8, help="S3StorageWriter thread_count")
    parser.add_argument("--no-s3tc", action="store_true", help="leave s3torchconnector out")
    parser.add_argument("--no-obstore", action="store_true", help="leave the prototype out")
    parser.add_argument("--profile", action="store_true", help="profile ckptstore instead")
    parser.add_argument("--top", type=int, default=30, help="rows per profile listing")
    parser.add_argument("--dir", type=Path, default=BENCH_DIR / "out", help="scratch parent")
    parser.add_argument("--json", type=Path, help="write the goal rows here (bench/suite.py)")
    args = parser.parse_args(argv)
    if (args.reps < 3 and not args.profile) or args.size_gib <= 0:
        parser.error("--reps must be >= 3 and --size-gib > 0")
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPUs; "
        f"load average {load_average()}; torch {torch.__version__}",
        flush=True,
    )
    state = transformer_state(args.size_gib)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    nbytes = state_bytes(state)
    scratch = args.dir.resolve() / f"bench-s3-dcp-{os.getpid()}"
    scratch.mkdir(parents=True)
    bad: list[str] = []
    try:
        with _server_and_bucket(scratch) as server:
            url = server.endpoint_url
            client = boto3.client(
                "s3",
                endpoint_url=url,
                region_name=REGION,
                config=Config(max_pool_connections=4 * BOTO3_THREADS),
            )
            store = S3Store(BUCKET, "ck", endpoint_url=url, region_name=REGION)
            ours = Ckptstore("ckptstore", store, scratch, args.compression, "ck")
            if args.profile:
                ours.begin(100)  # an untimed warm-up first
                ours.save(state)
                ours.load(dest)
                ours.end(client)
                ours.begin(101)
                profile(ours, state, dest, client, args.top)
                store.close()
                return 0
            contenders: list[Any] = [ours, Boto3(client)]
            if not args.no_s3tc:
                contenders.insert(1, S3tc(url, args.s3tc_threads))
            proto = None
            if not args.no_obstore:
                proto = ObstoreS3Store(BUCKET, "ob", endpoint_url=url)
                contenders.append(
                    Ckptstore("ckptstore+obstore", proto, scratch, args.compression, "ob")
                )
            names = [c.name for c in contenders]
            print(
                f"state: {len(state)} fp32 tensors, {nbytes / GiB:.3f} GiB; SeaweedFS at {url}; "
                f"ckptstore compression {args.compression}; s3torchconnector thread_count "
                f"{args.s3tc_threads}; boto3 {BOTO3_THREADS} threads; {args.reps} reps, "
                "medians; memory WARM (1.25 GiB touched and freed before every timed call)",
                flush=True,
            )
            # Untimed first calls (imports, clients, thread pools) on a tiny state.
            tiny = {"w": torch.ones(1024)}
            back = {"w": torch.zeros(1024)}
            for c in contenders:
                c.begin(99)
                c.save(tiny)
                c.load(back)
                c.end(client)
            ops, bad = measure(
                contenders, meter := CpuMeter(server), args.reps, state, dest, client
            )
            del meter
            uploaded = {c.name: c.uploaded for c in contenders if isinstance(c, Ckptstore)}
            store.close()
            if proto is not None:
                proto.close()
            client.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = report(ops, nbytes, names)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    for name, n in uploaded.items():
        print(
            f"{name} uploaded {n / GiB:.3f} GiB per save (compression {args.compression}); "
            f"the peers {nbytes / GiB:.3f} GiB"
        )
    print(f"load average at the end: {load_average()}")
    if bad:
        print("LOAD MISMATCHES:\n  " + "\n  ".join(bad[:20]))
        return 1
    print("every load was bit-identical to the saved state (every contender, every repetition)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
