"""Cost curves: how ckptstore's costs grow with ranks, chunks, checkpoints and blobs (issue 25).

Each section prints a table of cost against size with the per-item cost, on SQLite and (when
reachable) PostgreSQL where the manifest is involved:

1. ``commit``: one checkpoint committed from R rank receipts (``Run.save(receipts=...)``, what
   a controller does after N workers uploaded their shards), R = 1, 16, 128, 1,024 (16,384 with
   ``--full``). Each rank's receipt is a real ``ShardWriter.write`` of a small unique tensor (so
   every receipt names blobs of its own); the first commit of a set inserts its blob rows, the
   next three (the next steps, the same blobs) find and claim them (their median). The per-item
   cost is the slope from the previous size: what one more receipt costs. Goal: <= 0.2 s at
   1,024 on PostgreSQL and <= 0.1 ms per receipt.
2. ``dcp-metadata``: the DCP integration's metadata document for a state of C chunks (10^3 ...
   10^6), its encoded size per chunk, its parse time and the check of its locations every load
   makes next (one place per chunk and value), beside DCP's own pickled ``Metadata``
   of the same state and its unpickling time (the peer). Goal: no single document every rank
   must read grows past ~100 B per chunk.
   ``megatron-layout``: the Megatron integration's layout of S shards (10^3 ... 10^6), which
   every rank parses and checks (each tensor's shards tile it) before a load reads anything.
3. ``lookup``: ``latest()`` and a load's planning (the newest checkpoint and its components)
   with 100,000 checkpoints in the run and 1,000,000 blob rows in the manifest.
4. ``gc``: a mark-and-sweep ``collect_garbage`` over 10^4, 10^5 (10^6 with ``--full``) blob
   rows, of which a tenth are unreferenced (their objects exist on a local store and are
   deleted), then a pass with nothing to do. The report's phase times give rows marked per
   second (mark) and blobs removed per second (sweep); the orphan phase lists every object.
   ``--s3`` adds 10^4 rows on a SeaweedFS server (``tests/s3servers.py``). Goals: >= 20,000
   blobs removed per second on a local store, >= 2,000 on S3, 10^6 rows marked in < 60 s.
5. ``gc-history`` (with ``--full``, or asked for): the same over 2 x 10^4 rows with another
   run's 10^5 checkpoints (one component row each) in the manifest: deleting a blob row makes
   the database check ``components.index_digest`` (a foreign key) for it.

The manifests of sections 3 and 4 are filled with set-based inserts (the shapes a long run
leaves, without spending hours saving), then vacuumed and analyzed on PostgreSQL (as autovacuum
would have done over that long run), then measured through the public API.

Run: ``make bench-scale`` (= ``.venv/bin/python bench/bench_scale.py``), ``--only commit gc``,
``--full`` (the largest sizes: half an hour and several GB of disk here), ``--s3``, ``--pg URL``
('' to skip PostgreSQL), ``--json PATH``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckptstore import ShardReceipt, ShardWriter, open_run  # noqa: E402
from ckptstore.cas.digest import blob_key  # noqa: E402
from ckptstore.objectstore import LocalStore, ObjectStore  # noqa: E402

MiB = 1 << 20
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


def rank_receipts(store: LocalStore, ranks: int, tag: int = 0) -> list[ShardReceipt]:
    """One receipt per rank, each naming blobs of its own (a small tensor unique to the rank
    and ``tag``: sets of other tags name other blobs)."""
    writer = ShardWriter(store)

    def one(rank: int) -> ShardReceipt:
        state = {"weight": torch.full((64,), float(rank)), "rank": torch.tensor([rank, tag])}
        return writer.write(f"policy/rank-{rank:05d}", state)

    try:
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, range(ranks)))
    finally:
        writer.close()


def bench_commit(db: tuple[str, str], scratch: Path, sizes: list[int]) -> list[Row]:
    """Commit wall time for each R, in a run whose statements a warm-up commit has prepared
    (as in a controller that has been saving for a while): three commits of fresh receipt
    sets insert their blob rows ("new blobs", their median); three more (the next steps, the
    last set's blobs again) find and claim them ("same blobs", their median). Python's cyclic
    collector runs before each timed commit, so a collection of the bench's own heap (torch,
    the receipts) does not land in one of them."""
    label, url = db
    store = LocalStore(scratch / f"commit-store-{label}")
    rows: list[Row] = []
    for ranks in sizes:
        sets = [rank_receipts(store, ranks, tag) for tag in range(3)]
        warm = rank_receipts(store, 1, -1)
        with open_run(f"commit-{ranks}", db=url, store=store, async_save=False) as run:
            run.save(0, receipts=warm)
            new, same = [], []
            for step, receipts in enumerate(sets + [sets[-1]] * 3, start=1):
                gc.collect()
                started = time.perf_counter()
                run.save(step, receipts=receipts)
                (new if step <= len(sets) else same).append(time.perf_counter() - started)
        times = [statistics.median(new), *same]
        for phase, seconds in (
            ("new blobs", times[0]),
            ("same blobs", statistics.median(times[1:])),
        ):
            previous = next((r for r in reversed(rows) if r["phase"] == phase), None)
            rows.append(
                {
                    "section": "commit",
                    "db": label,
                    "size": ranks,
                    "phase": phase,
                    "seconds": seconds,
                    # What one more receipt costs: the slope from the previous size.
                    "per_item_ms": (
                        (seconds - previous["seconds"]) / (ranks - previous["size"]) * 1000
                        if previous
                        else seconds * 1000
                    ),
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
    """Encoded size per chunk and encode/parse seconds of the metadata document, beside the
    peer: torch DCP's own ``.metadata`` file, the same ``Metadata`` pickled (what
    ``FileSystemWriter`` writes and every rank unpickles at load; unpickled here only because
    this process just pickled it)."""
    import pickle

    from ckptstore.integrations.dcp._metadata import decode_metadata, encode_metadata
    from ckptstore.integrations.dcp._validate import expected_items

    rows = []
    for chunks in sizes:
        ranks = min(1024, chunks)
        metadata, locations = dcp_metadata(chunks, ranks)
        real = sum(len(md.chunks) for md in metadata.state_dict_metadata.values())
        digests = {r: "b3:" + f"{r:064x}" for r in range(ranks)}
        started = time.perf_counter()
        text = encode_metadata(metadata, locations, digests)
        encoded = time.perf_counter() - started
        started = time.perf_counter()
        stored = decode_metadata(text, "bench")
        parsed = time.perf_counter() - started
        started = time.perf_counter()
        expected_items(stored, "bench")  # what every load checks next: one place per item
        checked = time.perf_counter() - started
        del stored
        metadata.storage_data = locations  # as DCP stores it: the items' places in its files
        pickled = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        del metadata, locations
        gc.collect()
        started = time.perf_counter()
        pickle.loads(pickled)  # bytes this process made a line above, never read from storage
        unpickled = time.perf_counter() - started
        row = {
            "section": "dcp-metadata",
            "size": real,
            "bytes": len(text),
            "bytes_per_chunk": len(text) / real,
            "encode_seconds": encoded,
            "seconds": parsed,
            "per_item_ms": parsed / real * 1000,
            "check_seconds": checked,
            "peer_bytes": len(pickled),
            "peer_seconds": unpickled,
        }
        print(
            f"  DCP metadata, {real:,} chunks: {len(text) / 1e6:.1f} MB "
            f"({row['bytes_per_chunk']:.0f} B/chunk), encode {encoded:.2f} s, "
            f"parse {parsed:.2f} s, locations checked {checked:.2f} s; DCP's pickle "
            f"{len(pickled) / 1e6:.1f} MB, unpickled in {unpickled:.2f} s "
            f"({parsed / unpickled:.2f}x)",
            flush=True,
        )
        rows.append(row)
    return rows


def bench_megatron_layout(sizes: list[int]) -> list[Row]:
    """The Megatron integration's layout (every stored shard, read and checked by every rank
    at load) for S shards: tensors of 64 row-blocks each (tensor-parallel ranks), its size per
    shard, its parse and its sharding-integrity check."""
    from ckptstore.integrations._common.megatron_layout import Layout, TensorShard

    rows = []
    ranks = 64
    for shards in sizes:
        layout = Layout(
            tuple(
                TensorShard(
                    f"decoder.layers.{t}.mlp.linear_fc1.weight",
                    f"megatron/rank{r}",
                    f"t{t}",
                    "bfloat16",
                    (16 * ranks, 4096),
                    (16 * r, 0),
                    (16, 4096),
                )
                for t in range(max(1, shards // ranks))
                for r in range(ranks)
            )
        )
        text = layout.to_json()
        count = len(layout.tensors)
        del layout
        gc.collect()
        started = time.perf_counter()
        parsed = Layout.from_json(text, "bench")
        parse = time.perf_counter() - started
        started = time.perf_counter()
        parsed.check([f"megatron/rank{r}" for r in range(ranks)], "bench")
        checked = time.perf_counter() - started
        del parsed
        rows.append(
            {
                "section": "megatron-layout",
                "size": count,
                "bytes": len(text),
                "seconds": parse + checked,
                "per_item_ms": (parse + checked) / count * 1000,
                "parse_seconds": parse,
                "check_seconds": checked,
            }
        )
        print(
            f"  Megatron layout, {count:,} shards: {len(text) / 1e6:.1f} MB "
            f"({len(text) / count:.0f} B/shard), parse {parse:.2f} s, check {checked:.2f} s",
            flush=True,
        )
    return rows


# -- 3. lookups in a long run ---------------------------------------------------------------------


def blob_digest(run_name: str, i: int) -> str:
    """The ``i``-th made-up digest of a bench run (runs of one manifest never share one),
    spread over the digest space as real BLAKE3 digests are: a local store's ``cas/<2 hex>/``
    directories fill evenly, as in real use. (Digests that shared a prefix put every object of
    a run in one directory: listing it held all its names at once -- the +175 MiB of a GC pass
    at 10^6 blobs -- and eight threads' unlinks queued on that one directory.)"""
    return "b3:" + hashlib.blake2b(f"{run_name}/{i}".encode(), digest_size=32).hexdigest()


def fill(url: str, run_name: str, store: Path | ObjectStore, checkpoints: int, blobs: int) -> int:
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
        if db.engine.dialect.name == "postgresql":
            # What autovacuum has long done to a manifest that grew save by save: statistics
            # for the planner, and the visibility map that lets index-only scans skip the heap.
            with db.engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                    "VACUUM ANALYZE"
                )
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


def put_objects(store: ObjectStore, keys: list[str]) -> None:
    """One 1-byte object under each key, 16 requests at a time (a network store)."""
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda key: store.put(key, b"x"), keys))


def bench_gc(
    db: tuple[str, str],
    scratch: Path,
    sizes: list[int],
    store_kind: str = "local",
    history: int = 0,
) -> list[Row]:
    """GC over N blob rows, each with its object, a tenth of them unreferenced: the first pass
    condemns and deletes those (grace 0), the second finds nothing to do. The report's phase
    times give the rates: rows marked per second of the mark, blobs removed per second of the
    sweep; the orphan phase lists every object of the store. ``history``: another run of that
    many committed checkpoints (one component row each) is in the manifest too."""
    import datetime as dt

    from sqlalchemy import update

    from ckptstore.maintenance import collect_garbage
    from ckptstore.manifest.models import CheckpointRow

    label, url = db
    rows = []
    for blobs in sizes:
        root = scratch / f"gc-{label}-{store_kind}-{blobs}"
        with gc_store(store_kind, root) as store:
            name = f"gc-{store_kind}-{blobs}-{history}"
            if history:
                fill(url, f"history-{blobs}", store, history, history)
            run_id = fill(url, name, store, 10, blobs)
            started = time.perf_counter()
            keys = [blob_key(blob_digest(name, i)) for i in range(blobs)]
            if isinstance(store, LocalStore):  # straight to the files: faster than put()
                for key in keys:
                    path = store.root / key
                    path.parent.mkdir(exist_ok=True, parents=True)
                    path.write_bytes(b"x")
            else:
                put_objects(store, keys)
            # On disk, as a real GC finds blobs written long before: deleting a file whose
            # blocks are still being written back costs a fifth of one that reached the disk.
            os.sync()
            print(
                f"  stored {blobs:,} objects in {time.perf_counter() - started:.0f} s", flush=True
            )
            with open_run(name, db=url, store=store) as run:
                oldest = (
                    update(CheckpointRow)
                    .where(CheckpointRow.run_id == run_id, CheckpointRow.step == 0)
                    .values(status="deleted")
                    .execution_options(synchronize_session=False)
                )
                # the oldest checkpoint (a tenth of the blobs) was deleted
                run.db.write(lambda s, q=oldest: s.execute(q), what="deleting a bench checkpoint")
                for phase in ("removes a tenth", "nothing to do"):
                    gc.collect()
                    started = time.perf_counter()
                    with peak_rss_growth() as grown:
                        report = collect_garbage(run.db, run.store, grace=dt.timedelta(0))
                    seconds = time.perf_counter() - started
                    removed = report.swept + report.orphans
                    phases = report.seconds
                    row = {
                        "section": "gc",
                        "db": label,
                        "store": store_kind,
                        "history": history,
                        "phase": phase,
                        "size": blobs,
                        "removed": removed,
                        "seconds": seconds,
                        "per_item_ms": seconds / blobs * 1000,
                        "mark_seconds": phases["mark"],
                        "sweep_seconds": phases["sweep"],
                        "orphan_seconds": phases["orphans"],
                        "marked_per_s": (blobs + history) / phases["mark"],  # every row
                        "removed_per_s": report.swept / phases["sweep"] if report.swept else None,
                        "longest_batch_s": report.longest_batch_seconds,
                        "rss_growth_mib": grown[0] / MiB,
                    }
                    rows.append(row)
                    rate = f"{row['removed_per_s']:,.0f}/s" if report.swept else "-"
                    print(
                        f"  gc {label} {store_kind} {blobs:,} rows ({phase}): {seconds:.2f} s "
                        f"(mark {phases['mark']:.2f}, sweep {phases['sweep']:.2f}, orphans "
                        f"{phases['orphans']:.2f}), removed {removed:,} ({rate}); longest "
                        f"batch {report.longest_batch_seconds:.2f} s, RSS +{grown[0] / MiB:.0f} "
                        "MiB",
                        flush=True,
                    )
        shutil.rmtree(root, ignore_errors=True)
    return rows


@contextmanager
def peak_rss_growth(every: float = 0.02) -> Iterator[list[int]]:
    """The block's peak resident set growth over its start, in bytes (sampled from
    /proc/self/statm every ``every`` seconds; ``[0]`` of the yielded list, set at the end)."""
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base = rss()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(every):
            peak[0] = max(peak[0], rss())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    grown = [0]
    try:
        yield grown
    finally:
        done.set()
        thread.join()
        grown[0] = max(peak[0], rss()) - base


@contextmanager
def gc_store(kind: str, root: Path) -> Iterator[ObjectStore]:
    """A fresh local store under ``root``, or a bucket on a SeaweedFS server started there."""
    if kind == "local":
        with LocalStore(root / "store", fsync=False) as store:
            yield store
        return
    from ckptstore.objectstore import S3Store
    from tests.s3servers import plain_client, random_bucket_name, seaweed_server

    # SeaweedFS accepts any key; boto3 only needs one to sign with.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    with seaweed_server(root / "weed") as server:
        bucket = random_bucket_name("gc")
        plain_client(server.endpoint_url).create_bucket(Bucket=bucket)
        with S3Store(bucket, endpoint_url=server.endpoint_url) as store:
            yield store


# -- tables -------------------------------------------------------------------------------------


def print_rows(title: str, rows: list[Row], unit: str = "items") -> None:
    """One section's table: size, seconds, per-item cost, one line per measurement."""
    if not rows:
        return
    print(f"\n{title}")
    print(f"{'db':<11} {'phase':<16} {unit:>10} {'seconds':>9} {'per item':>12}")
    for row in rows:
        print(
            f"{row.get('db', '-'):<11} {row.get('phase', '-'):<16} {row['size']:>10,} "
            f"{row['seconds']:>9.3f} {row['per_item_ms']:>9.4f} ms"
        )


def print_gc_rows(rows: list[Row]) -> None:
    """The GC table: each phase's seconds and the rates the goals name."""
    if not rows:
        return
    print("\nmark-and-sweep GC, a tenth of the blob rows unreferenced")
    print(
        f"{'db':<11} {'store':<6} {'history':>7} {'phase':<16} {'rows':>10} {'total s':>8} "
        f"{'mark s':>7} "
        f"{'sweep s':>8} {'orphan s':>9} {'marked/s':>10} {'removed/s':>10} "
        f"{'batch<=s':>8} {'RSS+MiB':>8}"
    )
    for r in rows:
        removed = f"{r['removed_per_s']:,.0f}" if r["removed_per_s"] else "-"
        print(
            f"{r['db']:<11} {r['store']:<6} {r['history']:>7,} {r['phase']:<16} {r['size']:>10,} "
            f"{r['seconds']:>8.2f} {r['mark_seconds']:>7.2f} {r['sweep_seconds']:>8.2f} "
            f"{r['orphan_seconds']:>9.2f} {r['marked_per_s']:>10,.0f} {removed:>10} "
            f"{r['longest_batch_s']:>8.2f} {r['rss_growth_mib']:>8.0f}"
        )


def unlink_floor(root: Path, files: int = 20_000, threads: int = 8) -> float:
    """Files unlinked per second on ``threads`` threads in ``root``'s file system, of files
    written (in 256 directories, as the store's layout) and synced first: the most a local
    store's GC can remove there, whatever the manifest costs."""
    from concurrent.futures import ThreadPoolExecutor

    paths = []
    for i in range(files):
        path = root / "floor" / f"{i % 256:02x}" / f"{i:08d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        paths.append(str(path))
    os.sync()
    step = -(-files // threads)
    runs = [sorted(paths)[i : i + step] for i in range(0, files, step)]
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda run: [os.unlink(p) for p in run], runs))
    rate = files / (time.perf_counter() - started)
    shutil.rmtree(root / "floor")
    return rate


def gc_section(args: argparse.Namespace, wanted: set[str], scratch: Path) -> list[Row]:
    """Every GC case, each in fresh databases (a GC walks every blob row of its manifest, so
    the other sections' rows must not be there)."""
    cases: list[tuple[int, str, int]] = []
    if "gc" in wanted:
        cases += [(n, "local", 0) for n in [10_000, 100_000] + ([1_000_000] if args.full else [])]
    if "gc-history" in wanted:
        cases.append((20_000, "local", 10**5))
    if args.s3:  # 10^4: SeaweedFS stores a few hundred objects per second here
        cases.append((10_000, "s3", 0))
    rows: list[Row] = []
    for n, (blobs, store_kind, history) in enumerate(cases):
        where = scratch / f"gc-case-{n}"
        where.mkdir()
        with scratch_databases(args.pg, where) as databases:
            for db in databases:
                rows += bench_gc(db, where, [blobs], store_kind, history)
    print_gc_rows(rows)
    if any(store == "local" for _, store, _ in cases):
        floor = unlink_floor(scratch)
        print(f"floor: {floor:,.0f} files unlinked per second on 8 threads (synced files)")
        rows.append({"section": "gc", "floor": "unlink", "per_s": floor})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["commit", "dcp-metadata", "megatron-layout", "lookup", "gc", "gc-history"],
    )
    parser.add_argument("--full", action="store_true", help="the largest sizes too")
    parser.add_argument("--pg", default=DEFAULT_PG, help="PostgreSQL server URL; '' to skip")
    parser.add_argument(
        "--s3", action="store_true", help="GC on a SeaweedFS server too (tests/s3servers.py)"
    )
    parser.add_argument("--dir", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    everything = ["commit", "dcp-metadata", "megatron-layout", "lookup", "gc"] + (
        ["gc-history"] if args.full else []
    )
    wanted = set(args.only or everything)
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
            if "megatron-layout" in wanted:
                sizes = [1_000, 10_000, 100_000] + ([1_000_000] if args.full else [])
                layout_rows = bench_megatron_layout(sizes)
                print_rows("Megatron layout: parse + check per shard", layout_rows, "shards")
                rows += layout_rows
            if "lookup" in wanted:
                count, blobs = (100_000, 1_000_000) if args.full else (100_000, 200_000)
                lookup_rows = [
                    r for db in databases for r in bench_lookup(db, scratch, count, blobs)
                ]
                print_rows("lookups in a run of 100,000 checkpoints", lookup_rows, "ckpts")
                rows += lookup_rows
            if wanted & {"gc", "gc-history"}:
                rows += gc_section(args, wanted, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
