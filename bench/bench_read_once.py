"""Read once, share: a replicated DCP checkpoint loaded by R ranks, each blob read from the
store by one rank and sent to the others (``CkptStoreReader.share``, the default), against
every rank reading its own copy (``share = False``), for R = 1, 2, 4 on this machine.

One checkpoint of ``--size-mib`` of fp32 tensors (16 MiB each, one blob each) is saved through
``ckptstore.integrations.dcp`` to a local store, or with ``--s3`` to a SeaweedFS server this
run starts (S3 over loopback; untimed). Per repetition and R, in an order
that alternates, R gloo processes (this file with ``--child``, ``OMP_NUM_THREADS=1``) load it
into zeroed tensors, with the store's files evicted from the page cache first (a cold store,
as a resume after a failure finds it) and again hot; each rank times its load from a barrier
to a barrier and counts the bytes it read from the store. Every load is compared bit for bit
with the saved tensors (exit 1 on a difference).

Reported, medians: seconds (the slowest rank), the store bytes all ranks read together over
one replica's (1.00x: each byte read once), and the ratio shared / alone. The model for R
ranks beyond this machine, with the constants measured here, is printed last (see
bench/RESULTS.md).

Run: ``.venv/bin/python bench/bench_read_once.py [--size-mib 256] [--reps 3]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))  # tests.s3servers
MiB = 1 << 20
TENSOR_MIB = 16


def saved(size_mib: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    n = max(1, size_mib // TENSOR_MIB)
    return {f"w{i}": torch.randn(TENSOR_MIB * MiB // 4, generator=gen) for i in range(n)}


def child(rank: int, world: int, root: Path, size_mib: int, share: bool, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint import load as dcp_load

    from ckptstore.integrations.dcp import CkptStoreReader, LoadPlan, NoPickleLoadPlanner
    from ckptstore.objectstore import open_store

    url = os.environ.get("BENCH_S3_URL")
    store = (
        open_store(url, endpoint_url=os.environ["BENCH_S3_ENDPOINT"], create=False)
        if url
        else open_store(root / "store", create=False)
    )
    counted = [0]
    plain_get_view = store.get_view

    def get_view(key: str) -> memoryview:  # every blob read goes through get_view
        view = plain_get_view(key)
        counted[0] += view.nbytes
        return view

    store.get_view = get_view  # type: ignore[method-assign]

    dist.init_process_group(
        "gloo", rank=rank, world_size=world, init_method=f"file://{out}.rendezvous"
    )
    expected = saved(size_mib)
    state = {k: torch.zeros_like(v) for k, v in expected.items()}
    reader = CkptStoreReader.for_plan(store, LoadPlan.from_json((root / "plan.json").read_text()))
    reader.share = share
    dist.barrier()
    start = time.perf_counter()
    dcp_load(state, storage_reader=reader, planner=NoPickleLoadPlanner())
    dist.barrier()
    seconds = time.perf_counter() - start
    exact = all(torch.equal(state[k], v) for k, v in expected.items())
    Path(f"{out}.{rank}").write_text(json.dumps({"s": seconds, "read": counted[0], "ok": exact}))
    dist.destroy_process_group()


def evict(root: Path) -> None:
    for dirpath, _, names in os.walk(root):
        for name in names:
            if not (Path(dirpath) / name).is_file():  # the server's sockets
                continue
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def launch(root: Path, world: int, size_mib: int, share: bool, tag: str) -> dict[str, Any]:
    out = root / f"out-{tag}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    args = [str(root), str(size_mib), str(int(share)), str(out)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", str(rank), str(world), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(world)
    ]
    for rank, proc in enumerate(procs):
        text = proc.communicate(timeout=600)[0].decode(errors="replace")
        if proc.returncode != 0:
            raise SystemExit(f"rank {rank} of {tag} exited {proc.returncode}:\n{text[-3000:]}")
    results = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]
    if not all(r["ok"] for r in results):
        raise SystemExit(f"{tag}: a rank loaded other bytes than were saved")
    return {"s": max(r["s"] for r in results), "read": sum(r["read"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--s3", action="store_true", help="the store on a SeaweedFS server")
    parser.add_argument("--json", type=Path, help="write the goal rows here (bench/suite.py)")
    parser.add_argument("--child", nargs=6, metavar="ARG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rank, world, root, size, share, out = args.child
        child(int(rank), int(world), Path(root), int(size), share == "1", Path(out))
        return
    import warnings

    from ckptstore.checkpointer import open_run
    from ckptstore.integrations import dcp as ckpt_dcp

    warnings.simplefilter("ignore", UserWarning)
    root = Path(tempfile.mkdtemp(dir=BENCH_DIR / "out" if (BENCH_DIR / "out").is_dir() else None))
    with contextlib.ExitStack() as stack:
        store: Any = root / "store"
        if args.s3:
            store = stack.enter_context(s3_store(root))
        with open_run("read-once", db=root / "m.db", store=store, async_save=False) as run:
            ckpt_dcp.save(saved(args.size_mib), run, 1)
            (root / "plan.json").write_text(ckpt_dcp.plan_load(run, 1).to_json())
            replica = sum(o.size for o in run.store.list("cas/") if o.key.startswith("cas/"))
        rows = measure(args, root, replica)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


@contextlib.contextmanager
def s3_store(root: Path) -> Iterator[Any]:
    """A SeaweedFS server and a bucket on it; the store, and the children told where it is."""
    import boto3

    from ckptstore.objectstore import open_store
    from tests.s3servers import seaweed_server

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    with seaweed_server(root / "weed") as server:
        client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")
        client.create_bucket(Bucket="read-once")
        client.close()
        os.environ["BENCH_S3_URL"] = "s3://read-once/ckpt"
        os.environ["BENCH_S3_ENDPOINT"] = server.endpoint_url
        with open_store(os.environ["BENCH_S3_URL"], endpoint_url=server.endpoint_url) as store:
            yield store


def measure(args: argparse.Namespace, root: Path, replica: int) -> list[dict[str, Any]]:
    """Time every R and mode, print the table; the rows for ``bench/suite.py``."""
    ranks = [int(r) for r in args.ranks.split(",")]
    print(
        f"{sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; one replica: "
        f"{replica / MiB:.0f} MiB in the store; reps {args.reps}; medians"
    )
    where = "S3 (SeaweedFS)" if args.s3 else "local dir"
    rows: list[dict[str, Any]] = []
    times: dict[tuple[str, int, bool], list[float]] = {}
    reads: dict[tuple[int, bool], int] = {}
    for rep in range(args.reps):
        for world in ranks:
            modes = [True, False] if (rep + world) % 2 == 0 else [False, True]
            for share in modes if world > 1 else [True]:
                for cache in ("evicted", "hot"):
                    if cache == "evicted":
                        evict(root)
                    tag = f"{rep}-{world}-{int(share)}-{cache}"
                    got = launch(root, world, args.size_mib, share, tag)
                    times.setdefault((cache, world, share), []).append(got["s"])
                    reads[(world, share)] = got["read"]
    print(f"{'cache':8} {'ranks':>5} {'mode':8} {'seconds':>8} {'store read':>11} {'vs alone':>8}")
    for cache in ("evicted", "hot"):
        for world in ranks:
            for share in [True, False] if world > 1 else [True]:
                median = statistics.median(times[(cache, world, share)])
                alone = statistics.median(times.get((cache, world, False), [median]))
                ratio = f"{median / alone:.2f}x" if world > 1 else ""
                print(
                    f"{cache:8} {world:5d} {'shared' if share else 'alone':8} {median:8.3f} "
                    f"{reads[(world, share)] / replica:10.2f}x {ratio:>8}"
                )
                if share and world > 1:
                    rows.append(row(f"read once, {world} ranks, {cache}, {where}", median, alone))
    for world in ranks:
        if world > 1:
            rows.append(
                {
                    "work": f"store bytes read by {world} replicas sharing, {where}",
                    "ours": reads[(world, True)] / replica,
                    "peer": "one replica's bytes",
                    "peer_value": 1.0,
                    "unit": "x",
                    "ratio": reads[(world, True)] / replica,
                    # Each rank reads the metadata and index blobs itself (a few KiB).
                    "goal": "<= 1.02x",
                    "met": reads[(world, True)] <= 1.02 * replica,
                }
            )
    # The model: a cold load by R replicas is bound by the store serving bytes (B_store, what
    # one reader gets from it), the ranks' verification (B_verify per rank) and, shared, the
    # sends: one copy of the state leaves its owners, R-1 copies arrive (B_link per rank).
    one = statistics.median(times[("evicted", 1, True)])
    hot = statistics.median(times[("hot", 1, True)])
    b_store = replica / one
    b_verify = replica / hot
    print(
        f"measured: one rank, cold {b_store / MiB:.0f} MiB/s (store + verify), hot "
        f"{b_verify / MiB:.0f} MiB/s (verify); model for R replicas of S bytes against a store "
        "serving B_total in all: alone max(R*S/B_total, S/B_store); shared max(S/B_total, "
        "S/B_verify, S/B_link)"
    )
    return rows


def row(work: str, shared: float, alone: float) -> dict[str, Any]:
    """An information row: the shared load's seconds against every rank reading alone."""
    return {
        "work": work,
        "ours": shared,
        "peer": "every rank reads its own copy",
        "peer_value": alone,
        "unit": "s",
        "ratio": shared / alone,
        "goal": "info",
        "met": None,
    }


if __name__ == "__main__":
    main()
