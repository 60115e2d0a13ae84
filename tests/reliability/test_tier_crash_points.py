"""Crash consistency of node-local tiers: a process SIGKILLed at every stage of a local save and
of a drain loses nothing and claims nothing (DESIGN.md §13: durability is a level, and it is
earned).

The saving process is ``tiers_crash_child.py`` (a real separate process; three nodes simulated
as tier directories, R = 2, a worker's receipt from node b in every save). It commits a few
local steps (the even ones drained), then is killed at one point of the next local save -- a
peer's copy written, a tier flushed, inside the commit transaction, after COMMIT, while the
tiers drop copies -- or of the drain of that step -- after an upload, after the store's flush,
inside the drain's transaction, after it. Then, as a user restarting the job would:

- the new step is visible (local) iff its local COMMIT completed, and remote-durable iff the
  drain's transaction completed; nothing is left pending;
- every checkpoint the manifest calls local or committed loads exactly (through the tiers), and
  every committed one loads exactly from the store alone;
- every copy a local checkpoint's blob has a row for is on its node's tier, and no file on a
  tier is unknown to the manifest once the writer has started again;
- the next local save and drain succeed, GC (grace 0) keeps what is needed, and every committed
  checkpoint still verifies from the store.

Family "tier crash points": killed, resumed verified, lost (must be 0).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import create_engine, text
from tiers_crash_child import make_state, save, tiers, worker_state

from ckptstore import open_run
from ckptstore.cas.digest import blob_key
from ckptstore.maintenance import collect_garbage
from ckptstore.manifest import Database
from ckptstore.objectstore import LocalStore

CHILD = Path(__file__).with_name("tiers_crash_child.py")
FAMILY = "tier crash points"
BEFORE = 4
TARGET = BEFORE + 1
#: (action, kill point, nth time reached).
POINTS = [
    ("save", "peer-put", 1),
    ("save", "flushed", 1),
    ("save", "flushed", 3),
    ("save", "in-commit", 1),
    ("save", "committed", 1),
    ("save", "evicted-files", 1),
    ("drain", "drain-put", 1),
    ("drain", "drain-put", 2),
    ("drain", "flushed", 1),
    ("drain", "in-drain-commit", 1),
    ("drain", "drained", 1),
]
#: Points from which the target's local COMMIT (or its drain's) had completed.
LOCAL_COMMITTED = {"committed", "evicted-files"}
DRAINED = {"drained"}


def rows(root: Path, sql: str) -> list[tuple[object, ...]]:
    engine = create_engine(f"sqlite:///{root / 'manifest.db'}")
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("action", "point", "nth"), POINTS, ids=[f"{a}-{p}-{n}" for a, p, n in POINTS]
)
def test_a_kill_at_every_stage_of_a_local_save_or_drain_loses_and_claims_nothing(
    tmp_path: Path, action: str, point: str, nth: int, reliability_report: Any
) -> None:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"root": str(tmp_path), "before": BEFORE, "action": action,
                               "point": point, "nth": nth}))  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(CHILD), str(job)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == -9, done.stdout + done.stderr
    assert (tmp_path / "progress").read_text() == f"kill {point}\n"

    statuses = dict(rows(tmp_path, "SELECT step, status FROM checkpoints WHERE status != 'failed'"))
    if action == "save":
        expected = "local" if point in LOCAL_COMMITTED else None
    else:
        expected = "committed" if point in DRAINED else "local"
    if expected is None:  # a save killed before its COMMIT: pending (never loaded) or absent
        assert statuses.get(TARGET) in (None, "pending"), statuses
    else:
        assert statuses.get(TARGET) == expected, statuses

    with open_run("crash", db=str(tmp_path / "manifest.db"), store=str(tmp_path / "store"),
                  tiers=tiers(tmp_path, "a"), async_save=False) as run:  # fmt: skip
        assert run.checkpoints(["pending"]) == []
        loadable = [c.step for c in run.checkpoints(["local", "committed"])]
        for step in loadable:
            state = run.load(step).state
            assert equal(state["rank0"], make_state(step)), step
            assert equal(state["rank1"], worker_state(step)), step
        # Every copy a local checkpoint relies on is there; nothing unknown is left on a tier.
        needed = rows(
            tmp_path,
            "SELECT DISTINCT bc.digest, bc.node FROM blob_copies bc JOIN checkpoint_blobs cb "
            "ON cb.digest = bc.digest JOIN checkpoints c ON c.id = cb.checkpoint_id "
            "WHERE c.status = 'local'",
        )
        for digest, node in needed:
            assert (tmp_path / f"tier-{node}" / blob_key(str(digest))).is_file(), (digest, node)
        known = {
            str(d) for (d,) in rows(tmp_path, "SELECT digest FROM blob_copies WHERE node = 'a'")
        }
        on_a = {p.name for p in (tmp_path / "tier-a" / "cas").rglob("*") if p.is_file()}
        assert on_a <= {d[3:] for d in known}
        # The next save and its drain go through.
        save(run, tmp_path, TARGET + 1)
        report = run.drain()
        assert report is not None
        assert report.drained
    store = LocalStore(tmp_path / "store")
    db = Database(str(tmp_path / "manifest.db"))
    try:
        collect_garbage(db, store, grace=dt.timedelta(0))
        collect_garbage(db, store, grace=dt.timedelta(0))
    finally:
        db.close()
    with open_run("crash", db=str(tmp_path / "manifest.db"), store=store, writable=False) as reader:
        committed = [c.step for c in reader.checkpoints(["committed"])]
        assert TARGET + 1 in committed
        for step in committed:
            state = reader.load(step).state
            assert equal(state["rank0"], make_state(step)), step
    # Reached only when every check above held: a lost checkpoint fails the test first.
    reliability_report.add(FAMILY, killed=1, resumed_verified=1, lost=0)
