"""Cost curves: how ckptstore's costs grow with ranks, chunks, checkpoints and blobs (issue 25).

Each section prints a table of cost against size with the per-item cost, on SQLite and (when
reachable) PostgreSQL where the manifest is involved:

1. ``commit``: one checkpoint committed from R rank receipts (``Run.save(receipts=...)``, what
   a controller does after N workers uploaded their shards), R = 1, 16, 128, 1,024 (16,384 with
   ``--full``). Each rank's receipt is a real ``ShardWriter.write`` of a small unique tensor (so
   every receipt names blobs of its own); the first commit of a set inserts its blob rows, the
   second one (the next step, the same blobs) finds them. Goal: <= 0.2 s at 1,024 on
   PostgreSQL and <= 0.1 ms per receipt.
2. ``dcp-metadata``: the DCP integration's metadata document for a state of C chunks (10^3 ...
   10^6), its encoded size per chunk and its parse time. Goal: no single document every rank
   must read grows past ~100 B per chunk.
3. ``lookup``: ``latest()`` and a load's planning (the newest checkpoint and its components)
   with 100,000 checkpoints in the run and 1,000,000 blob rows in the manifest.
4. ``gc``: a mark-and-sweep ``collect_garbage`` over 10^4, 10^5 (10^6 with ``--full``) blob
   rows, of which a tenth are unreferenced (their objects exist on a local store and are
   deleted): blobs removed per second and rows marked per second. Goals: >= 20,000 blobs
   removed per second on a local store, 10^6 rows marked in < 60 s.

The manifests of sections 3 and 4 are filled with set-based inserts (the shapes a long run
leaves, without spending hours saving), then measured through the public API.

Run: ``make bench-scale`` (= ``.venv/bin/python bench/bench_scale.py``), ``--only commit gc``,
``--full`` (the largest sizes: minutes and several GB of disk), ``--pg URL`` ('' to skip
PostgreSQL), ``--json PATH``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckptstore import ShardReceipt, ShardWriter, open_run  # noqa: E402
from ckptstore.objectstore import LocalStore  # noqa: E402

DEFAULT_PG = os.environ.get("CKPTSTORE_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/")

Row = dict[str, Any]


# -- databases ----------------------------------------------------------------------------------


@contextmanager
def scratch_databases(pg: str, scratch: Path) -> Iterator[list[tuple[str, str]]]:
    """(label, URL) of a fresh SQLite file and, if the server answers, a scratch PostgreSQL
    database dropped at the end."""
    databases = [("SQLite", str(scratch / "manifest.db"))]
    admin = name = None
    if pg:
        from sqlalchemy import create_engine, text
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import OperationalError

        base = make_url(pg.replace("postgresql://", "postgresql+psycopg://", 1))
        name = f"ckpt_scale_{uuid.uuid4().hex[:8]}"
        admin = create_engine(base.set(database="postgres"), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text(f"CREATE DATABASE {name}"))
            url = base.set(database=name).render_as_string(hide_password=False)
            databases.append(("PostgreSQL", url))
        except OperationalError as exc:
            print(f"PostgreSQL skipped: {exc.orig}")
            admin.dispose()
            admin = None
    try:
        yield databases
    finally:
        if admin is not None:
            from sqlalchemy import text

            with admin.connect() as conn:
                conn.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
            admin.dispose()


# -- 1. commit of R receipts --------------------------------------------------------------------


def rank_receipts(store: LocalStore, ranks: int) -> list[ShardReceipt]:
    """One receipt per rank, each naming blobs of its own (a small tensor unique to the rank)."""
    writer = ShardWriter(store)

    def one(rank: int) -> ShardReceipt:
        state = {"weight": torch.full((64,), float(rank)), "rank": torch.tensor([rank])}
        return writer.write(f"policy/rank-{rank:05d}", state)

    try:
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, range(ranks)))
    finally:
        writer.close()


def bench_commit(db: tuple[str, str], scratch: Path, sizes: list[int]) -> list[Row]:
    """Commit wall time for each R, first (new blob rows) and second (the same blobs)."""
    label, url = db
    store = LocalStore(scratch / f"commit-store-{label}")
    rows = []
    for ranks in sizes:
        receipts = rank_receipts(store, ranks)
        with open_run(f"commit-{ranks}", db=url, store=store, async_save=False) as run:
            for step, phase in ((1, "new blobs"), (2, "same blobs")):
                started = time.perf_counter()
                run.save(step, receipts=receipts)
                seconds = time.perf_counter() - started
                rows.append(
                    {
                        "section": "commit",
                        "db": label,
                        "size": ranks,
                        "phase": phase,
                        "seconds": seconds,
                        "per_item_ms": seconds / ranks * 1000,
                    }
                )
                print(f"  commit {label} R={ranks} ({phase}): {seconds * 1000:.0f} ms", flush=True)
    return rows


# -- 2. the DCP metadata document ---------------------------------------------------------------


def dcp_metadata(chunks: int, ranks: int) -> tuple[Any, dict[Any, Any]]:
    """DCP ``Metadata`` of ``chunks`` chunks: tensors of ``ranks`` row-blocks each (an FSDP
    layout), one chunk per rank per tensor, and each chunk's location."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ckptstore.integrations.dcp._metadata import Location

    tensors = max(1, chunks // ranks)
    state, locations = {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t // 8}.mlp.experts.w{t % 8}.weight"
        rows = 16 * ranks
        blocks = [
            ChunkStorageMetadata(offsets=torch.Size([16 * r, 0]), sizes=torch.Size([16, 4096]))
            for r in range(ranks)
        ]
        state[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16), torch.Size([rows, 4096]), blocks
        )
        for r, block in enumerate(blocks):
            locations[MetadataIndex(fqn, block.offsets)] = Location(r, t)
    return Metadata(state_dict_metadata=state), locations


def bench_dcp_metadata(sizes: list[int]) -> list[Row]:
    """Encoded size per chunk and encode/parse seconds of the metadata document."""
    from ckptstore.integrations.dcp._metadata import decode_metadata, encode_metadata

    rows = []
    for chunks in sizes:
        ranks = min(1024, chunks)
        metadata, locations = dcp_metadata(chunks, ranks)
        digests = {r: "b3:" + f"{r:064x}" for r in range(ranks)}
        started = time.perf_counter()
        text = encode_metadata(metadata, locations, digests)
        encoded = time.perf_counter() - started
        started = time.perf_counter()
        decode_metadata(text, "bench")
        parsed = time.perf_counter() - started
        real = sum(len(md.chunks) for md in metadata.state_dict_metadata.values())
        row = {
            "section": "dcp-metadata",
            "size": real,
            "bytes": len(text),
            "bytes_per_chunk": len(text) / real,
            "encode_seconds": encoded,
            "seconds": parsed,
            "per_item_ms": parsed / real * 1000,
        }
        print(
            f"  DCP metadata, {real:,} chunks: {len(text) / 1e6:.1f} MB "
            f"({row['bytes_per_chunk']:.0f} B/chunk), encode {encoded:.2f} s, parse {parsed:.2f} s",
            flush=True,
        )
        rows.append(row)
    return rows


# -- 3. lookups in a long run ---------------------------------------------------------------------


def blob_digest(run_name: str, i: int) -> str:
    """The ``i``-th made-up digest of a bench run (runs of one manifest never share one)."""
    salt = hashlib.sha256(run_name.encode()).hexdigest()[:8]
    return f"b3:{salt}{i:056x}"


def fill(url: str, run_name: str, store: Path, checkpoints: int, blobs: int) -> int:
    """A run of ``checkpoints`` committed checkpoints (one component each) and ``blobs`` blob
    rows referenced round-robin, by set-based inserts; returns the run's id."""
    from sqlalchemy import insert

    from ckptstore.manifest.models import (
        BlobRow,
        CheckpointBlobRow,
        CheckpointRow,
        ComponentRow,
        utcnow,
    )

    with open_run(run_name, db=url, store=store) as run:
        run_id, db = run.id, run.db
        now = utcnow()
        digests = [blob_digest(run_name, i) for i in range(blobs)]

        def write(session: Any) -> None:
            for i in range(0, blobs, 50_000):
                session.execute(
                    insert(BlobRow.__table__),
                    [
                        {
                            "digest": d,
                            "kind": "chunk",
                            "logical_bytes": 1 << 20,
                            "stored_bytes": 1 << 20,
                            "codec": "raw",
                            "created_at": now,
                            "last_claimed_at": now,
                            "state": "live",
                        }
                        for d in digests[i : i + 50_000]
                    ],
                )
            for i in range(0, checkpoints, 50_000):
                session.execute(
                    insert(CheckpointRow.__table__),
                    [
                        {
                            "run_id": run_id,
                            "step": s,
                            "status": "committed",
                            "writer_epoch": 1,
                            "trigger": "period",
                            "created_at": now,
                            "committed_at": now,
                            "logical_bytes": 0,
                            "stored_bytes": 0,
                            "uploaded_bytes": 0,
                        }
                        for s in range(i, min(checkpoints, i + 50_000))
                    ],
                )

        db.write(write, what="filling the bench manifest")

        def refer(session: Any) -> None:
            from sqlalchemy import select

            ids = list(
                session.scalars(select(CheckpointRow.id).where(CheckpointRow.run_id == run_id))
            )
            per = max(1, blobs // len(ids))
            refs = [
                {"checkpoint_id": cid, "digest": digests[(n * per + k) % blobs]}
                for n, cid in enumerate(ids)
                for k in range(per)
            ]
            for i in range(0, len(refs), 50_000):
                session.execute(insert(CheckpointBlobRow.__table__), refs[i : i + 50_000])
            comps = [
                {
                    "checkpoint_id": cid,
                    "name": "policy",
                    "kind": "state",
                    "index_digest": digests[(n * per) % blobs],
                    "logical_bytes": 0,
                    "stored_bytes": 0,
                    "entries": 1,
                }
                for n, cid in enumerate(ids)
            ]
            for i in range(0, len(comps), 50_000):
                session.execute(insert(ComponentRow.__table__), comps[i : i + 50_000])

        db.write(refer, what="referencing the bench blobs")
        return run_id


def bench_lookup(db: tuple[str, str], scratch: Path, checkpoints: int, blobs: int) -> list[Row]:
    """``latest()`` and a load's planning (the newest committed checkpoint with its components,
    then the recorded index lengths) in a run of ``checkpoints`` with ``blobs`` blob rows."""
    from ckptstore.manifest import reading

    label, url = db
    store = scratch / f"lookup-store-{label}"
    started = time.perf_counter()
    fill(url, "long-run", store, checkpoints, blobs)
    print(
        f"  filled {label}: {checkpoints:,} checkpoints, {blobs:,} blobs in "
        f"{time.perf_counter() - started:.0f} s",
        flush=True,
    )
    rows = []
    with open_run("long-run", db=url, store=store, writable=False) as run:
        if label == "PostgreSQL":
            from sqlalchemy import text

            with run.db.engine.begin() as conn:
                conn.execute(text("ANALYZE"))

        def plan() -> None:
            info = run.latest()
            assert info is not None
            reading.index_lengths(run.db, [c.index_digest for c in info.components])

        for what, fn in (("latest()", run.latest), ("load() planning", plan)):
            fn()
            times = []
            for _ in range(50):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times)
            rows.append(
                {
                    "section": "lookup",
                    "db": label,
                    "phase": what,
                    "size": checkpoints,
                    "blobs": blobs,
                    "seconds": seconds,
                    "per_item_ms": seconds * 1000,
                }
            )
            print(f"  {what} {label}: {seconds * 1000:.2f} ms", flush=True)
    return rows


# -- 4. garbage collection ----------------------------------------------------------------------


def bench_gc(db: tuple[str, str], scratch: Path, sizes: list[int]) -> list[Row]:
    """GC over N blob rows with objects on a local store, a tenth of them unreferenced: the
    first pass condemns and deletes those (grace 0), the second finds nothing to do (the cost of
    marking N rows and listing N objects)."""
    import datetime as dt

    from sqlalchemy import update

    from ckptstore.maintenance import collect_garbage
    from ckptstore.manifest.models import CheckpointRow

    label, url = db
    rows = []
    for blobs in sizes:
        root = scratch / f"gc-{label}-{blobs}"
        store_dir = root / "store"
        run_id = fill(url, f"gc-{blobs}", store_dir, 10, blobs)
        for i in range(blobs):  # every blob row has its object
            key = blob_digest(f"gc-{blobs}", i)[3:]
            path = store_dir / "cas" / key[:2] / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
        with open_run(f"gc-{blobs}", db=url, store=store_dir) as run:
            oldest = (
                update(CheckpointRow)
                .where(CheckpointRow.run_id == run_id, CheckpointRow.step == 0)
                .values(status="deleted")
                .execution_options(synchronize_session=False)
            )
            # the oldest checkpoint (a tenth of the blobs) was deleted
            run.db.write(lambda s, q=oldest: s.execute(q), what="deleting a bench checkpoint")
            for phase in ("removes a tenth", "nothing to do"):
                started = time.perf_counter()
                report = collect_garbage(run.db, run.store, grace=dt.timedelta(0))
                seconds = time.perf_counter() - started
                removed = report.swept + report.orphans
                rows.append(
                    {
                        "section": "gc",
                        "db": label,
                        "phase": phase,
                        "size": blobs,
                        "removed": removed,
                        "seconds": seconds,
                        "per_item_ms": seconds / blobs * 1000,
                        "removed_per_s": removed / seconds if removed else None,
                    }
                )
                print(
                    f"  gc {label} {blobs:,} rows ({phase}): {seconds:.2f} s, removed {removed:,}",
                    flush=True,
                )
        shutil.rmtree(root, ignore_errors=True)
    return rows


# -- tables -------------------------------------------------------------------------------------


def print_rows(title: str, rows: list[Row], unit: str = "items") -> None:
    """One section's table: size, seconds, per-item cost, one line per measurement."""
    if not rows:
        return
    print(f"\n{title}")
    print(f"{'db':<11} {'phase':<12} {unit:>10} {'seconds':>9} {'per item':>12}")
    for row in rows:
        print(
            f"{row.get('db', '-'):<11} {row.get('phase', '-'):<12} {row['size']:>10,} "
            f"{row['seconds']:>9.3f} {row['per_item_ms']:>9.4f} ms"
        )


SECTIONS: dict[str, Callable[..., list[Row]]] = {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=["commit", "dcp-metadata", "lookup", "gc"])
    parser.add_argument("--full", action="store_true", help="the largest sizes too")
    parser.add_argument("--pg", default=DEFAULT_PG, help="PostgreSQL server URL; '' to skip")
    parser.add_argument("--dir", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    wanted = set(args.only or ["commit", "dcp-metadata", "lookup", "gc"])
    args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="scale-", dir=args.dir))
    rows: list[Row] = []
    try:
        with scratch_databases(args.pg, scratch) as databases:
            if "commit" in wanted:
                sizes = [1, 16, 128, 1024] + ([16384] if args.full else [])
                commit_rows = [r for db in databases for r in bench_commit(db, scratch, sizes)]
                print_rows("commit of one checkpoint from R rank receipts", commit_rows, "R")
                rows += commit_rows
            if "dcp-metadata" in wanted:
                sizes = [1_000, 10_000, 100_000] + ([1_000_000] if args.full else [])
                meta_rows = bench_dcp_metadata(sizes)
                print_rows("DCP metadata document: parse time per chunk", meta_rows, "chunks")
                rows += meta_rows
            if "lookup" in wanted:
                count, blobs = (100_000, 1_000_000) if args.full else (100_000, 200_000)
                lookup_rows = [
                    r for db in databases for r in bench_lookup(db, scratch, count, blobs)
                ]
                print_rows("lookups in a run of 100,000 checkpoints", lookup_rows, "ckpts")
                rows += lookup_rows
            if "gc" in wanted:
                sizes = [10_000, 100_000] + ([1_000_000] if args.full else [])
                gc_rows = [r for db in databases for r in bench_gc(db, scratch, sizes)]
                print_rows(
                    "mark-and-sweep GC, a tenth of the blob rows unreferenced", gc_rows, "rows"
                )
                rows += gc_rows
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
