"""bench/bench_tiers.py (issue 39's table) keeps running between full runs: its smoke mode (tiny
sizes, one repetition, no memory warming) on a local-directory store in the default run, and
with SeaweedFS behind the throttle and the reference trainer in the slow run; and
bench/throttle.py enforces its rate and counts what it forwards. Smoke tests of the scripts,
not measurements."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from throttle import Throttle, TokenBucket  # noqa: E402


def run_bench(tmp_path: Path, *extra: str, timeout: int) -> tuple[str, list[dict[str, object]]]:
    out = tmp_path / "rows.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    command = [sys.executable, str(ROOT / "bench" / "bench_tiers.py"), "--smoke"]
    command += [*extra, "--dir", str(scratch), "--json", str(out)]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(scratch.iterdir()) == []  # its scratch folder is gone
    return done.stdout, json.loads(out.read_text())


def by_work(rows: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    return {str(row["work"]): row for row in rows}


def test_the_tiers_bench_runs_on_a_local_store(tmp_path: Path) -> None:
    stdout, rows = run_bench(
        tmp_path, "--store", "local", "--only", "recovery", "blocked", "write", timeout=120
    )
    works = by_work(rows)
    for row in rows:
        assert set(row) == {
            "work",
            "ours",
            "peer",
            "peer_value",
            "unit",
            "ratio",
            "goal",
            "met",
            "other_cpu",
        }
    prefixes = [
        "recovery after node loss, tiered R=2 disk",
        "recovery after node loss, tiered R=1 disk",
        "recovery after node loss, tiered R=2 /dev/shm",
        "recovery tiered R=2 disk vs its floor",
        "restart: open_run + latest(), remote-only",
        "blocked: local save (R=2) vs async save to local dir",
        "local tier write R=1 vs write+fsync floor",
    ]
    for prefix in prefixes:
        assert any(work.startswith(prefix) for work in works), (prefix, list(works))
    goals = [row for row in rows if row["met"] is not None]
    assert {str(row["goal"]) for row in goals} == {"<= 0.1x", "== 1.0x", "<= 1.1x", ">= 0.8x"}
    # R=1: exactly the bytes of the blobs only the lost node held came from the store.
    exact = works["R=1: object-store bytes read vs blobs only node a held"]
    assert exact["met"] is True
    assert exact["ours"] == exact["peer_value"]
    assert float(exact["ours"]) > 0  # type: ignore[arg-type]
    assert "tiered R=2 (disk): object-store bytes read 0 (read_bytes)" in stdout
    assert "seconds per section: recovery" in stdout


@pytest.mark.slow
@pytest.mark.integration
def test_the_tiers_bench_runs_on_seaweedfs_through_the_throttle(tmp_path: Path) -> None:
    stdout, rows = run_bench(tmp_path, timeout=600)
    works = by_work(rows)
    assert any(w.startswith("throttle sanity: GET") for w in works)
    assert any(w.startswith("curve: recovery R=2 at 100 MB/s") for w in works)
    assert any(w.startswith("curve: drain") for w in works)
    assert any(w.startswith("curve: local save R=3 wall") for w in works)
    assert any(w.startswith("trainer: step time, local ckpt every step") for w in works)
    proxied = works["R=1: proxy bytes vs read_bytes['store'] (headers included)"]
    # What the proxy forwarded is what the load counted, plus HTTP headers.
    assert 1.0 <= float(proxied["ratio"]) < 1.01  # type: ignore[arg-type]
    assert "tiered R=2 (disk): object-store bytes read 0 (read_bytes), 0 through the proxy" in (
        stdout
    )


# -- bench/throttle.py ---------------------------------------------------------------------------


@contextmanager
def sink_and_source(payload: int) -> Iterator[tuple[int, dict[str, int]]]:
    """A TCP server on 127.0.0.1: each connection reads one line ``get`` or ``put N``; for
    ``get`` it sends ``payload`` bytes, for ``put N`` it reads N bytes and answers ``ok``.
    Yields its port and the bytes it received per connection."""
    server = socket.create_server(("127.0.0.1", 0))
    received: dict[str, int] = {"bytes": 0}
    stop = threading.Event()

    def handle(conn: socket.socket) -> None:
        with closing(conn), conn.makefile("rb") as f:
            line = f.readline().split()
            if line[0] == b"get":
                block = bytes(range(256)) * 256
                sent = 0
                while sent < payload:
                    n = min(len(block), payload - sent)
                    conn.sendall(block[:n])
                    sent += n
            else:
                want = int(line[1])
                while want:
                    got = f.read(min(want, 1 << 16))
                    want -= len(got)
                    received["bytes"] += len(got)
                conn.sendall(b"ok")

    def accept() -> None:
        server.settimeout(0.1)
        threads = []
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=handle, args=(conn,))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()

    acceptor = threading.Thread(target=accept)
    acceptor.start()
    try:
        yield server.getsockname()[1], received
    finally:
        stop.set()
        acceptor.join()
        server.close()


def fetch(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"get\n")
        parts = []
        while chunk := conn.recv(1 << 16):
            parts.append(chunk)
    return b"".join(parts)


def send(port: int, nbytes: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(f"put {nbytes}\n".encode())
        conn.sendall(b"x" * nbytes)
        return conn.recv(16)


def test_the_throttle_forwards_every_byte_at_its_rate_and_counts_them() -> None:
    size = 3 << 20
    block = bytes(range(256)) * 256
    expected = (block * (size // len(block) + 1))[:size]
    with sink_and_source(size) as (port, received):
        with Throttle("127.0.0.1", port, None) as free:
            assert fetch(free.port) == expected
            assert free.counts() == (4, size)  # "get\n" up, the payload down
        rate = 20e6  # 3 MiB takes ~0.16 s at this rate
        with Throttle("127.0.0.1", port, rate, burst=64 * 1024) as slow:
            started = time.perf_counter()
            assert fetch(slow.port) == expected
            down = time.perf_counter() - started
            slow.reset_counts()
            assert slow.counts() == (0, 0)
            started = time.perf_counter()
            assert send(slow.port, size) == b"ok"
            up = time.perf_counter() - started
            assert slow.to_server == size + len(f"put {size}\n")
            assert received["bytes"] == size
        with Throttle("127.0.0.1", port, rate, directions="up") as reads_free:
            started = time.perf_counter()
            assert fetch(reads_free.port) == expected
            unthrottled_down = time.perf_counter() - started
    assert down >= 0.9 * size / rate, down
    assert up >= 0.9 * size / rate, up
    assert unthrottled_down < 0.5 * size / rate, unthrottled_down


def test_the_token_bucket_spaces_reservations_at_its_rate() -> None:
    bucket = TokenBucket(1000.0, burst=100.0)
    assert bucket.delay(100, now=10.0) == 0.0  # within the burst
    assert bucket.delay(100, now=10.0) == pytest.approx(0.1)
    assert bucket.delay(500, now=10.0) == pytest.approx(0.6)
    assert bucket.delay(100, now=20.0) == 0.0  # idle: the bucket filled again
    assert TokenBucket(None).delay(1 << 30) == 0.0
    with pytest.raises(ValueError, match="directions"):
        Throttle("127.0.0.1", 1, 1.0, directions="sideways")
