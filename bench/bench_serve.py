"""How fast ``ckptstore serve`` answers: its pages' server time as a run's history grows, and
how fast the server starts.

A SQLite manifest holds runs of 1,000, 10,000 (and with ``--big`` 100,000) checkpoints: one
real save per run (its components, blobs and indexes) and the rest as rows copied from it, with
metrics, timings, byte counts and a realistic mix of statuses (every 10th kept, the rest deleted
by retention, every 97th failed). Each page is rendered in-process through the server's router
(``App.handle``: the server's own time, SQL to HTML, no socket), in a process without torch as
the server runs, ``--reps`` times after one warm call; medians of wall and CPU time are printed
with the wall time per checkpoint (a flat per-item cost is a linear curve). One HTTP round
trip of the same page is shown beside it.

Goal (issue 28): the run page of a run with 10,000 checkpoints in under 300 ms of server time.
Start-up: ``ckptstore serve --port 0`` as a process, wall time until it prints its URL and
until its first page is answered (goal: well under a second to the URL).

Run: ``.venv/bin/python bench/bench_serve.py [--reps 7] [--big]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckptstore.manifest.serving import open_readonly  # noqa: E402
from ckptstore.manifest.statuses import Status  # noqa: E402
from ckptstore.web.data import Site  # noqa: E402
from ckptstore.web.routes import App, Request  # noqa: E402
from ckptstore.web.server import Server  # noqa: E402

GOAL_MS = 300.0
GOAL_START_S = 1.0
#: The ``ckptstore`` entry point, as the installed script runs it.
CLI = "import sys; from ckptstore.cli import main; sys.exit(main())"


def populate(db_path: str, store: str, run: str, count: int) -> int:
    """A run of ``count`` checkpoints: one real save, the others copies of its rows."""
    # Here, not at the top: the pages are measured in a process without torch, as the server
    # runs (torch's millions of objects would slow every garbage collection of the pages').
    import torch
    from sqlalchemy import insert, select

    from ckptstore import open_run
    from ckptstore.manifest import Database
    from ckptstore.manifest.models import CheckpointBlobRow, CheckpointRow, ComponentRow, utcnow

    with open_run(run, db=db_path, store=store, async_save=False) as opened:
        first = opened.save(
            0,
            {"policy": {"w": torch.randn(256, 256)}, "optimizer": {"m": torch.randn(256, 256)}},
            metrics={"train:loss": 1.0, "train:reward": 0.0},
            trigger="period",
        ).wait()
        run_id = opened.id
    db = Database(db_path)
    try:

        def fill(session: Any) -> None:
            parts = (
                session.execute(select(ComponentRow).where(ComponentRow.checkpoint_id == first.id))
                .scalars()
                .all()
            )
            refs = (
                session.execute(
                    select(CheckpointBlobRow.digest).where(
                        CheckpointBlobRow.checkpoint_id == first.id
                    )
                )
                .scalars()
                .all()
            )
            now = utcnow()
            rows = [_row(run_id, step, now) for step in range(1, count)]
            for i in range(0, len(rows), 5_000):
                session.execute(insert(CheckpointRow), rows[i : i + 5_000])
            ids = (
                session.execute(
                    select(CheckpointRow.id).where(
                        CheckpointRow.run_id == run_id, CheckpointRow.id != first.id
                    )
                )
                .scalars()
                .all()
            )
            components = [
                {**{c: getattr(p, c) for c in ("name", "kind", "index_digest", "logical_bytes",
                                                 "stored_bytes", "entries")}, "checkpoint_id": i}
                for i in ids
                for p in parts
            ]  # fmt: skip
            blobs = [{"checkpoint_id": i, "digest": d} for i in ids for d in refs]
            for batch in (components, blobs):
                model = ComponentRow if batch is components else CheckpointBlobRow
                for i in range(0, len(batch), 5_000):
                    session.execute(insert(model), batch[i : i + 5_000])

        db.write(fill, what="bench rows")
    finally:
        db.close()
    return run_id


def _row(run_id: int, step: int, now: Any) -> dict[str, Any]:
    """One checkpoint row of the copies (status, metrics, timings, bytes by step)."""
    status = (
        Status.FAILED if step % 97 == 0 else Status.COMMITTED if step % 10 == 0 else Status.DELETED
    )
    loss = 1.0 / (1 + step / 500)
    return {
        "run_id": run_id,
        "step": step,
        "status": status,
        "writer_epoch": 1,
        "trigger": "period",
        "created_at": now,
        "committed_at": None if status == Status.FAILED else now,
        "metrics": {"train:loss": loss, "train:reward": 1 - loss, "lr": 1e-4},
        "training_info": {"current_step": step},
        "logical_bytes": 524_288,
        "stored_bytes": 500_000,
        "uploaded_bytes": 262_144 if step % 3 else 0,
        "save_seconds": 0.2 + (step % 17) / 100,
        "blocked_seconds": 0.01 + (step % 5) / 1000,
        "error": "SaveError: injected" if status == Status.FAILED else None,
    }


def median_ms(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median wall and CPU milliseconds of ``fn`` after one warm call (on a shared machine the
    CPU time is the steadier figure: the wall time includes waiting for a core)."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        started, used = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - used)
    return statistics.median(wall) * 1000, statistics.median(cpu) * 1000


def page_times(app: App, server: Server, run: str, count: int, reps: int) -> list[str]:
    """One line per page: server time, per checkpoint, one HTTP round trip."""
    lines = []
    newest = app.site.db
    with newest.connect() as conn:
        top = conn.exec_driver_sql(
            "SELECT max(c.id) FROM checkpoints c JOIN runs r ON r.id = c.run_id "
            "WHERE r.name = ? AND c.status = 'committed'",
            (run,),
        ).scalar()
    pages = {
        "run page": ("runs", run),
        "run page, page 50": ("runs", run),
        "run history (API)": ("api", "runs", run, "history"),
        "runs page": (),
        "checkpoint page": ("checkpoints", str(top)),
        "changes (poll)": ("api", "runs", run, "changes"),
    }
    for label, segments in pages.items():
        query = {"page": "50"} if "page 50" in label else {}
        request = Request(tuple(segments), query)

        def call(request: Request = request) -> None:
            response = app.handle(request)
            assert response.status == 200, response.body[:200]

        ms, cpu_ms = median_ms(call, reps)
        path = "/" + "/".join(segments) + ("?page=50" if query else "")
        started = time.perf_counter()
        with urllib.request.urlopen(server.url.rstrip("/") + path) as answer:
            answer.read()
        http_ms = (time.perf_counter() - started) * 1000
        per = ms * 1000 / count
        lines.append(
            f"  {label:22s} {ms:8.1f} ms wall {cpu_ms:8.1f} ms CPU  {per:7.2f} us/ckpt  "
            f"(HTTP {http_ms:6.1f} ms)"
        )
        if label == "run page" and count == 10_000:
            verdict = "met" if ms < GOAL_MS else "NOT met"
            lines.append(
                f"  -> goal: run page < {GOAL_MS:.0f} ms at 10,000 checkpoints: {verdict} "
                f"(wall {ms:.0f} ms, CPU {cpu_ms:.0f} ms)"
            )
    return lines


def startup(db: str, store: str, reps: int) -> str:
    """Wall time of ``ckptstore serve`` to its URL line and to its first answered page."""
    to_url, to_page = [], []
    for _ in range(reps):
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-c", CLI, "--db", db, "--store", store, "serve", "--port", "0",
             "--json"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            url = json.loads(proc.stdout.readline())["url"]
            to_url.append(time.perf_counter() - started)
            with urllib.request.urlopen(url) as answer:
                answer.read()
            to_page.append(time.perf_counter() - started)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    url_s, page_s = statistics.median(to_url), statistics.median(to_page)
    verdict = "met" if url_s < GOAL_START_S else "NOT met"
    return (
        f"start-up: {url_s * 1000:.0f} ms to the URL, {page_s * 1000:.0f} ms to the first page "
        f"(median of {reps}; goal < {GOAL_START_S:.0f} s to the URL: {verdict})"
    )


def measure(db: str, store: str, sizes: list[int], reps: int) -> None:
    """Every page of every run, in this process (started without torch, as the server is)."""
    assert "torch" not in sys.modules, "the pages must be measured without torch loaded"
    site = Site(open_readonly(db), store, db_label=db)
    app = App(site)
    server = Server("127.0.0.1", 0, app)
    server.serve_in_thread()
    gc.freeze()  # as `ckptstore serve` does once it has started
    try:
        for count in sizes:
            print(f"run of {count:,} checkpoints (SQLite), median of {reps}:")
            print("\n".join(page_times(app, server, f"run-{count}", count, reps)), flush=True)
    finally:
        server.shutdown()
        server.server_close()
        site.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="Server time of ckptstore serve's pages.")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--big", action="store_true", help="also a run of 100,000 checkpoints")
    parser.add_argument("--measure", nargs=2, metavar=("DB", "STORE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [1_000, 10_000, *([100_000] if args.big else [])]
    if args.measure:
        measure(*args.measure, sizes, args.reps)
        return
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as scratch:
        db, store = f"{scratch}/manifest.db", f"{scratch}/store"
        for count in sizes:
            populate(db, store, f"run-{count}", count)
        command = [sys.executable, __file__, "--measure", db, store, "--reps", str(args.reps)]
        subprocess.run(command + (["--big"] if args.big else []), check=True)
        print(startup(db, store, max(3, args.reps // 2)))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
