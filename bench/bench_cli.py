"""How fast the command line starts: ``ckptstore latest RUN`` and the other read commands.

Each command runs as its own process, as a user or a script runs it (``$(ckptstore latest
RUN)``), on a SQLite manifest of ``--checkpoints`` committed checkpoints (default 1,000, one
small component each), with its wall time and peak RSS (``wait4``'s ``ru_maxrss``, from a small
spawner process). Side by side, in the same rounds (every contender once per round, the order
rotated from round to round, medians over ``--reps`` rounds, default 15):

- the peer: a Python process that runs the same lookup with the standard library's ``sqlite3``
  and prints the same thing -- what the command would cost without ckptstore and SQLAlchemy;
- the floor: ``python -c pass``, the interpreter alone.

The goal is absolute: ``ckptstore latest RUN`` in under 0.5 s of wall time on this (shared,
2-core) machine. The load average is printed before and after, as timings move with it.

Run: ``.venv/bin/python bench/bench_cli.py [--checkpoints 1000] [--reps 15] [--json PATH]``.
``--json`` writes one row per command ``{"work", "ours", "peer", "peer_value", "unit", "ratio",
"goal", "met"}`` (wall seconds; ``met``: under 0.5 s) for the bench suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckptstore import open_run  # noqa: E402

GOAL_S = 0.5
RUN = "bench"
#: The peer's lookups: the statements ckptstore issues for each command, through sqlite3.
PEER_SQL = {
    "latest": """
        SELECT c.step FROM checkpoints c JOIN runs r ON r.id = c.run_id
        WHERE r.name = ? AND c.status = 'committed' ORDER BY c.step DESC, c.id DESC LIMIT 1""",
    "runs": "SELECT * FROM run_summary ORDER BY run",
    "ls": """
        SELECT c.*, p.* FROM checkpoints c JOIN runs r ON r.id = c.run_id
        LEFT JOIN components p ON p.checkpoint_id = c.id
        WHERE r.name = ? AND c.status != 'deleted' ORDER BY c.step, c.id, p.name""",
    "show": """
        SELECT c.*, p.* FROM checkpoints c JOIN runs r ON r.id = c.run_id
        LEFT JOIN components p ON p.checkpoint_id = c.id
        WHERE r.name = ? AND c.step = ? AND c.status = 'committed' ORDER BY p.name""",
}
PEER = """
import sqlite3, sys
conn = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True)
for row in conn.execute(sys.argv[2], sys.argv[3:]):
    print(*row)
"""


#: Starts each measured process and reports its wall time and peak RSS (``wait4``'s
#: ``ru_maxrss``). A process of its own, and a small one: a child's peak RSS counts the memory
#: of the process it was spawned from (Linux carries the old image's high-water mark across
#: ``execve``), so spawned from this one, with torch loaded, every child would read ~300 MB.
SPAWNER = """
import json, os, sys, time
out_path, err_path = (os.path.join(sys.argv[1], name) for name in ("out", "err"))
for line in sys.stdin:
    argv = json.loads(line)
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    out, err = os.open(out_path, flags), os.open(err_path, flags)
    t0 = time.perf_counter()
    pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=[
        (os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_DUP2, err, 2)])
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    os.close(out)
    os.close(err)
    with open(out_path) as o, open(err_path) as e:
        print(json.dumps({"wall": wall, "rss_kib": usage.ru_maxrss, "out": o.read(),
                          "code": os.waitstatus_to_exitcode(status), "err": e.read()}),
              flush=True)
"""


class Spawner:
    """The small process that runs every measured command (see :data:`SPAWNER`)."""

    def __init__(self, scratch: Path) -> None:
        """A spawner whose children write their output into files under ``scratch``."""
        self._proc = subprocess.Popen(
            [sys.executable, "-c", SPAWNER, str(scratch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, argv: list[str]) -> dict[str, Any]:
        """Run ``argv`` to its end; its wall time, peak RSS (KiB), exit code and output."""
        assert self._proc.stdin is not None
        assert self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(argv) + "\n")
        self._proc.stdin.flush()
        result: dict[str, Any] = json.loads(self._proc.stdout.readline())
        return result

    def close(self) -> None:
        """End the spawner."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait()


@dataclass
class Contender:
    """One command line, and what its runs measured."""

    name: str
    argv: list[str]
    wall: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    #: What its first run printed.
    output: str | None = None

    def once(self, spawner: Spawner) -> None:
        """Run it once; record its wall time and peak RSS."""
        result = spawner.run(self.argv)
        if result["code"] != 0:
            raise SystemExit(f"{self.name} failed: {result['err']}")
        self.wall.append(result["wall"])
        self.rss_mb.append(result["rss_kib"] / 1024)
        if self.output is None:
            self.output = result["out"]

    @property
    def median_s(self) -> float:
        """The median wall time in seconds."""
        return statistics.median(self.wall)

    @property
    def median_mb(self) -> float:
        """The median peak RSS in MB."""
        return statistics.median(self.rss_mb)


def make_manifest(root: Path, count: int) -> tuple[str, str]:
    """A SQLite manifest and local store with ``count`` committed checkpoints of one run."""
    db, store = str(root / "manifest.db"), str(root / "store")
    with open_run(RUN, db=db, store=store, async_save=False) as run:
        for step in range(1, count + 1):
            state = {"model": {"w": torch.full((4,), float(step))}}
            run.save(step, state, metrics={"loss": 1 / step}, trigger="period")
    return db, store


def contenders(db: str, store: str, count: int) -> list[tuple[Contender, Contender]]:
    """Each command with its peer, the same lookup through sqlite3."""
    cli = str(Path(sys.executable).with_name("ckptstore"))
    middle = str(count // 2)
    commands = {  # name: (how the table shows it, its arguments, the peer's parameters)
        "latest": ("latest RUN", ["latest", RUN], [RUN]),
        "runs": ("runs", ["runs"], []),
        "ls": ("ls RUN", ["ls", RUN], [RUN]),
        "show": ("show RUN@STEP", ["show", f"{RUN}@{middle}"], [RUN, middle]),
    }
    pairs = []
    for name, (shown, args, params) in commands.items():
        ours = Contender(f"ckptstore {shown}", [cli, "--db", db, "--store", store, *args])
        peer = Contender(
            f"python + sqlite3 ({name})",
            [sys.executable, "-c", PEER, db, " ".join(PEER_SQL[name].split()), *params],
        )
        pairs.append((ours, peer))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description="Start-up time of the read commands.")
    parser.add_argument("--checkpoints", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=15, help="rounds (medians over them)")
    parser.add_argument("--json", metavar="PATH", help="write the result rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_cli_") as tmp:
        t0 = time.perf_counter()
        db, store = make_manifest(Path(tmp), args.checkpoints)
        print(f"manifest: {args.checkpoints} checkpoints in {time.perf_counter() - t0:.1f} s")
        pairs = contenders(db, store, args.checkpoints)
        floor = Contender("python -c pass", [sys.executable, "-c", "pass"])
        everyone = [floor] + [c for pair in pairs for c in pair]
        spawner = Spawner(Path(tmp))
        load_before = os.getloadavg()
        for _ in range(2):  # warm the page cache and the bytecode caches
            for contender in everyone:
                contender.once(spawner)
        for contender in everyone:
            contender.wall.clear()
            contender.rss_mb.clear()
        for round_ in range(args.reps):
            shift = round_ % len(everyone)
            for contender in everyone[shift:] + everyone[:shift]:
                contender.once(spawner)
        load_after = os.getloadavg()
        spawner.close()
    ours_latest, peer_latest = pairs[0]
    if (ours_latest.output or "").strip() != (peer_latest.output or "").strip():
        raise SystemExit(
            f"latest printed {ours_latest.output!r}, the sqlite3 peer {peer_latest.output!r}"
        )
    print(
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
        f"({os.cpu_count()} CPUs); medians of {args.reps} runs, alternating\n"
    )
    print(
        f"{'command':<28} {'wall s':>7} {'RSS MB':>7}   {'peer (sqlite3) s':>16} {'MB':>5}"
        f" {'ratio':>6}   goal < {GOAL_S} s"
    )
    rows = []
    for ours, peer in pairs:
        ratio = ours.median_s / peer.median_s
        met = ours.median_s < GOAL_S
        print(
            f"{ours.name:<28} {ours.median_s:7.3f} {ours.median_mb:7.1f}   "
            f"{peer.median_s:16.3f} {peer.median_mb:5.1f} {ratio:5.1f}x   "
            f"{'met' if met else 'NOT met'}"
        )
        rows.append(
            {
                "work": f"{ours.name} (SQLite, {args.checkpoints:,} checkpoints), wall",
                "ours": ours.median_s,
                "peer": "the same lookup through sqlite3 in a python process",
                "peer_value": peer.median_s,
                "unit": "s",
                "ratio": ratio,
                "goal": f"< {GOAL_S} s",
                "met": met,
            }
        )
    print(f"{floor.name:<28} {floor.median_s:7.3f} {floor.median_mb:7.1f}   (interpreter floor)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {len(rows)} rows to {args.json}")


if __name__ == "__main__":
    main()
