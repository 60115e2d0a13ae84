"""Finding the newest checkpoint, and how long an async save blocks training.

1. ``latest()`` with 1,000 and 100,000 checkpoints in the manifest (SQLite, and PostgreSQL if
   reachable), side by side with the usual alternatives in the same run: the newest complete
   ``step_N`` directory among 1,000 on local disk, and an S3 LIST-based discovery over 1,000
   ``step_N/`` prefixes on a local SeaweedFS server.
2. Training time blocked by ``run.save()`` with ``async_save=True`` versus ``False`` for the
   same ~1 GiB state, and versus copying that state in memory (``clone``), warm memory.

Run: ``.venv/bin/python bench/bench_manifest.py [--size-gib 1.0] [--pg URL]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from sqlalchemy import insert, text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckptstore import open_run  # noqa: E402
from ckptstore.manifest.models import CheckpointRow, Status  # noqa: E402

WARM_BYTES = int(1.25 * (1 << 30))


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def populate(run_db: object, run_id: int, count: int) -> None:
    rows = [
        {
            "run_id": run_id,
            "step": step,
            "status": Status.COMMITTED if step % 7 else Status.FAILED,
            "writer_epoch": 1,
            "trigger": "period",
        }
        for step in range(count)
    ]

    def fill(session: object) -> None:
        for i in range(0, len(rows), 10_000):
            session.execute(insert(CheckpointRow), rows[i : i + 10_000])  # type: ignore[attr-defined]

    run_db.write(fill)  # type: ignore[attr-defined]


def bench_latest(db_url: str, label: str, scratch: Path, reps: int) -> list[tuple[str, float]]:
    out = []
    for count in (1_000, 100_000):
        name = f"bench-{count}-{uuid.uuid4().hex[:6]}"
        with open_run(name, db=db_url, store=scratch / "store") as run:
            populate(run.db, run.id, count)
            if run.db.dialect == "postgresql":
                with run.db.engine.begin() as conn:
                    conn.execute(text("ANALYZE checkpoints"))
            assert run.latest() is not None
            out.append((f"latest() {label}, {count:,} checkpoints", median_ms(run.latest, reps)))
    return out


def bench_directory_scan(scratch: Path, reps: int) -> tuple[str, float]:
    root = scratch / "dirs"
    for step in range(1000):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / ".complete").write_bytes(b"")

    def newest() -> int:
        steps = sorted(
            (int(p.name[5:]) for p in os.scandir(root) if p.name.startswith("step_")),
            reverse=True,
        )
        return next(s for s in steps if (root / f"step_{s}" / ".complete").exists())

    assert newest() == 999
    return ("newest step_N directory among 1,000 (local disk, warm cache)", median_ms(newest, reps))


def bench_s3_list(scratch: Path, reps: int) -> tuple[str, float] | None:
    try:
        import boto3

        from tests.s3servers import seaweed_server
    except ImportError:
        return None
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    with seaweed_server(scratch / "weed") as server:
        client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")
        client.create_bucket(Bucket="bench")
        for step in range(1000):
            client.put_object(Bucket="bench", Key=f"run/step_{step}/.metadata", Body=b"{}")

        def newest() -> int:
            steps: list[int] = []
            for page in client.get_paginator("list_objects_v2").paginate(
                Bucket="bench", Prefix="run/", Delimiter="/"
            ):
                steps += [int(p["Prefix"][9:-1]) for p in page.get("CommonPrefixes", [])]
            best = max(steps)
            client.head_object(Bucket="bench", Key=f"run/step_{best}/.metadata")
            return best

        assert newest() == 999
        return (
            "S3 LIST discovery over 1,000 step_N/ prefixes (SeaweedFS)",
            median_ms(newest, reps),
        )


def warm() -> None:
    buf = bytearray(WARM_BYTES)
    buf[::4096] = b"\x01" * len(range(0, WARM_BYTES, 4096))
    del buf


def make_state(size_gib: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    per = 16 << 20  # 16 MiB fp32 tensors
    count = max(1, int(size_gib * (1 << 30)) // per)
    return {f"layer.{i}.weight": torch.randn(per // 4, generator=gen) for i in range(count)}


def bench_blocking(size_gib: float, scratch: Path, reps: int) -> list[tuple[str, float]]:
    state = make_state(size_gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    results: dict[str, list[float]] = {"clone": [], "async": [], "sync": []}
    runs = {
        mode: open_run(
            f"block-{mode}",
            db=scratch / f"{mode}.db",
            store=scratch / f"{mode}-store",
            async_save=mode == "async",
        )
        for mode in ("async", "sync")
    }
    try:
        for step in range(reps + 1):
            for t in state.values():
                t.add_(1.0)  # new weights each step: nothing deduplicates
            warm()
            t0 = time.perf_counter()
            copies = {k: v.clone() for k, v in state.items()}
            clone = time.perf_counter() - t0
            del copies
            warm()
            handle = runs["async"].save(step, {"policy": state})
            blocked_async = handle.blocked_seconds
            handle.wait()
            warm()
            t0 = time.perf_counter()
            runs["sync"].save(step, {"policy": state})
            blocked_sync = time.perf_counter() - t0
            if step:  # the first save allocates the reusable snapshot buffers
                results["clone"].append(clone)
                results["async"].append(blocked_async)
                results["sync"].append(blocked_sync)
    finally:
        for run in runs.values():
            run.close()
    gib = nbytes / (1 << 30)
    return [
        (
            f"copy the {gib:.2f} GiB state in memory (clone)",
            statistics.median(results["clone"]) * 1000,
        ),
        (
            f"training blocked by async save ({gib:.2f} GiB)",
            statistics.median(results["async"]) * 1000,
        ),
        (
            f"training blocked by sync save ({gib:.2f} GiB)",
            statistics.median(results["sync"]) * 1000,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=200, help="repetitions of each lookup")
    parser.add_argument("--save-reps", type=int, default=3)
    parser.add_argument(
        "--pg",
        default=os.environ.get("CKPTSTORE_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/"),
        help="PostgreSQL server URL (a scratch database is created and dropped); '' to skip",
    )
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=ROOT / "bench" / "out"))
    rows: list[tuple[str, float]] = []
    try:
        rows += bench_latest(str(scratch / "manifest.db"), "SQLite", scratch, args.reps)
        if args.pg:
            rows += bench_pg(args.pg, scratch, args.reps)
        rows.append(bench_directory_scan(scratch, args.reps))
        listed = bench_s3_list(scratch, min(args.reps, 50))
        if listed:
            rows.append(listed)
        rows += bench_blocking(args.size_gib, scratch, args.save_reps)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    width = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{width}}  median ms")
    for label, ms in rows:
        print(f"{label:<{width}}  {ms:10.3f}")


def bench_pg(server: str, scratch: Path, reps: int) -> list[tuple[str, float]]:
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    base = make_url(server.replace("postgresql://", "postgresql+psycopg://", 1))
    name = f"ckpt_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(base.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name}"))
    except OperationalError as exc:
        print(f"PostgreSQL skipped: {exc.orig}")
        return []
    try:
        url = base.set(database=name).render_as_string(hide_password=False)
        return bench_latest(url, "PostgreSQL", scratch, reps)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()


if __name__ == "__main__":
    main()
