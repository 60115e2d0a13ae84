"""The process of the tier crash tests (test_tier_crash_points.py), SIGKILLed on purpose.

``python tiers_crash_child.py JOB_JSON``: opens run ``crash`` on node ``a`` of three simulated
nodes (tier directories ``tier-{node}``, R = 2), commits ``before`` local steps (the even ones
drained), then does the job's ``action`` at step ``before + 1`` -- ``save`` (a local save with a
worker's receipt from node b) or ``drain`` (of the newest local checkpoint) -- and SIGKILLs
itself the ``nth`` time execution reaches the job's kill ``point``. A line ``kill POINT`` is
appended to the progress file first. Exit 3: the point was never reached.

The states are a function of the step (:func:`make_state`), so the parent knows what every
checkpoint must load back as; part of each repeats across steps (dedup, and copies that the
tiers' eviction drops and a later save needs again).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptstore import ShardWriter, TierConfig, open_run, writer_store
from ckptstore.checkpointer import commit as commit_module
from ckptstore.checkpointer import drain as drain_module
from ckptstore.checkpointer import tiered as tiered_module
from ckptstore.manifest import tiering as tiering_module
from ckptstore.objectstore import LocalStore

NODES = ("a", "b", "c")
EXIT_NOT_REACHED = 3


def make_state(step: int) -> dict[str, torch.Tensor]:
    """What step ``step`` saves (``frozen`` never changes; ``cycle`` repeats every 3 steps)."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(64 * 1024, generator=g),
        "frozen": torch.arange(4096, dtype=torch.float32),
        "cycle": torch.full((8192,), float(step % 3)),
    }


def worker_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {"v": torch.randn(32 * 1024, generator=g)}


def tiers(root: Path, node: str) -> TierConfig:
    return TierConfig(local_dir=str(root / "tier-{node}"), node=node, nodes=NODES, replicas=2)


class Killer:
    """SIGKILLs this process the ``nth`` time :meth:`hit` is called with its ``point``."""

    def __init__(self, point: str, nth: int, progress: Path) -> None:
        self.point, self.left, self.progress = point, nth, progress
        self._lock = threading.Lock()  # drains upload on several threads

    def hit(self, point: str) -> None:
        if point != self.point:
            return
        self._lock.acquire()  # never released: the holder kills the process
        self.left -= 1
        if self.left > 0:
            self._lock.release()
            return
        with self.progress.open("a") as out:
            out.write(f"kill {point}\n")
            out.flush()
            os.fsync(out.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


def wrap(owner: Any, name: str, before: Callable[[], None] | None = None,
         after: Callable[[], None] | None = None) -> None:  # fmt: skip
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        result = original(*args, **kwargs)
        if after is not None:
            after()
        return result

    setattr(owner, name, wrapped)


def arm(killer: Killer, root: Path) -> None:
    """The kill points, at the library's seams."""
    peer_root = str(root / "tier-c")

    def peer_put_done(store: LocalStore, key: str, data: Any) -> bool:
        created = put(store, key, data)
        if str(store.root).startswith(peer_root):
            killer.hit("peer-put")  # node c has a copy, node a may not yet
        return created

    put = LocalStore.put
    LocalStore.put = peer_put_done  # type: ignore[method-assign]
    wrap(LocalStore, "flush", after=lambda: killer.hit("flushed"))
    original_commit = tiering_module.commit_local

    def commit_local(*args: Any, **kwargs: Any) -> None:
        check = kwargs["check_copies"]

        def checking(asked: Any) -> Any:
            found = check(asked)
            killer.hit("in-commit")  # inside the transaction, before COMMIT
            return found

        kwargs["check_copies"] = checking
        original_commit(*args, **kwargs)
        killer.hit("committed")  # COMMIT done, eviction not yet

    commit_module.tiering.commit_local = commit_local  # type: ignore[attr-defined]
    original_evict = tiering_module.evict

    def evict(db: Any, node: str, keep_last: int, delete_files: Any, **kw: Any) -> int:
        def deleting(digests: Any) -> None:
            delete_files(digests)
            killer.hit("evicted-files")  # files gone, their rows' deletion not committed

        return original_evict(db, node, keep_last, deleting, **kw)

    tiered_module.tiering.evict = evict  # type: ignore[attr-defined]
    original_one = drain_module._Uploader.one

    def one(self: Any, digest: str, holders: Any) -> None:
        original_one(self, digest, holders)
        killer.hit("drain-put")

    drain_module._Uploader.one = one  # type: ignore[method-assign]
    original_mark = tiering_module.mark_drained

    def mark_drained(db: Any, checkpoint_id: int, check_objects: Any) -> bool:
        def checking(digests: Any) -> Any:
            found = check_objects(digests)
            killer.hit("in-drain-commit")
            return found

        done = original_mark(db, checkpoint_id, checking)
        killer.hit("drained")
        return done

    drain_module.tiering.mark_drained = mark_drained  # type: ignore[attr-defined]


def save(run: Any, root: Path, step: int) -> None:
    with writer_store(tiers(root, "b")) as store, ShardWriter(store) as worker:
        receipt = worker.write("rank1", worker_state(step))
    run.save(step, {"rank0": make_state(step)}, receipts=[receipt]).wait()


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    root = Path(job["root"])
    for node in NODES:
        (root / f"tier-{node}").mkdir(parents=True, exist_ok=True)
    with open_run(
        "crash",
        db=str(root / "manifest.db"),
        store=str(root / "store"),
        tiers=tiers(root, "a"),
        async_save=False,
    ) as run:
        for step in range(len(run.checkpoints()) + 1, job["before"] + 1):
            save(run, root, step)
            if step % 2 == 0:
                run.drain()
        target = job["before"] + 1
        killer = Killer(job["point"], job["nth"], root / "progress")
        if job["action"] == "save":
            arm(killer, root)
            save(run, root, target)
        else:
            save(run, root, target)
            arm(killer, root)
            run.drain()
    return EXIT_NOT_REACHED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
