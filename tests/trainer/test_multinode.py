"""The sharded trainer on a multi-node Ray cluster (issue 25): ``ray.cluster_utils.Cluster`` runs a
head and two worker nodes on this machine, each its own raylet; every worker node has one
``policy_slot``, so the two FSDP2 policy ranks land on different nodes, and the controller
stays on the driver's node (the head). Checkpoints go to PostgreSQL and a SeaweedFS server of
this module's own (the second test stalls it).

1. A run saves and finishes; the same command with a higher ``grpo.max_num_steps`` resumes from
   its last commit, again over two nodes, and finishes.
2. A node is lost in the middle of a save: SeaweedFS is stopped (SIGSTOP: connections stay open
   and nothing answers, a network stall) before a save, so the save's uploads hang; once both
   ranks wait for them, a node hosting a rank is removed (its actors die mid-upload) and
   SeaweedFS continues. The run fails naming the dead worker and commits nothing for that step
   (no pending row either); a re-run with one policy worker on the remaining nodes resumes from
   the last committed step and finishes; ``ckptstore verify`` is clean and ``ckptstore gc``
   removes what the failed save left, so every object in the store has a blob row.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3servers
from ray_cluster import LocalCluster, local_cluster, paused, run_trainer, trainer_process
from sqlalchemy import create_engine, text
from trainer_helpers import CHECKOUT, checkout_env, small_overrides

from ckptstore import open_run
from ckptstore.cas.digest import digest_from_key

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

RUN = "mn"
SAVE_PERIOD = 2
#: The sharded layout line the controller prints at start.
SHARDED = r"^policy sharded over 2 workers \(FSDP2\) on 2 node\(s\)$"


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3servers.SeaweedServer]:
    """A SeaweedFS of this module's own: the second test stops it for a while."""
    with s3servers.seaweed_server(tmp_path_factory.mktemp("weed-multinode")) as server:
        yield server


@pytest.fixture
def store_url(weed: s3servers.SeaweedServer) -> str:
    client = s3servers.plain_client(weed.endpoint_url)
    bucket = s3servers.random_bucket_name("mn")
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/mn-{secrets.token_hex(4)}"


@pytest.fixture
def nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weed: s3servers.SeaweedServer
) -> Iterator[LocalCluster]:
    """A head and two worker nodes with one ``policy_slot`` each, shut down afterwards."""
    # Ray's sockets live under RAY_TMPDIR: their paths must fit in 107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="rmn-", dir="/tmp")
    python_path = [str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])]
    for name, value in {
        "RAY_TMPDIR": ray_tmp,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "HOME": str(tmp_path / "home"),  # Ray's per-user files stay in the test's tmp dir
        # The actors run in the nodes' worker processes, which inherit this environment (not
        # the driver's): the trainer must be importable there and the store reachable.
        "PYTHONPATH": os.pathsep.join(python_path),
        "AWS_ENDPOINT_URL": weed.endpoint_url,
    }.items():
        monkeypatch.setenv(name, value)
    try:
        with local_cluster(workers=2, worker_resources={"policy_slot": 1}) as cluster:
            yield cluster
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _args(nodes: LocalCluster, root: Path, db: str, store: str, **extra: Any) -> list[str]:
    settings: dict[str, Any] = {
        "backend": "ray",
        "ray_address": nodes.address,
        "policy.num_workers": 2,
        "policy.worker_resources.policy_slot": 1,
        # Far below the default (120 s): nothing may wait long for a rank that is gone. (The
        # ranks' start and their uploads have timeouts of their own: starting one takes tens
        # of seconds here, and the second test stalls the uploads.)
        "policy.collective_timeout_s": 20,
        "checkpointing.run_name": RUN,
        "checkpointing.save_period": SAVE_PERIOD,
        "checkpointing.db": db,
        "checkpointing.store": store,
        **extra,
    }
    return small_overrides(root, **settings)


def _env() -> dict[str, str]:
    return checkout_env(PYTHONUNBUFFERED="1")


def _rows(db: str) -> list[tuple[str, int, str]]:
    """(run, step, status) of every checkpoint row."""
    engine = create_engine(db)
    try:
        with engine.connect() as conn:
            found = conn.execute(
                text(
                    "SELECT r.name, c.step, c.status FROM checkpoints c "
                    "JOIN runs r ON r.id = c.run_id ORDER BY r.name, c.step"
                )
            ).all()
    finally:
        engine.dispose()
    return [(row.name, row.step, row.status) for row in found]


def _steps(db: str, status: str) -> list[int]:
    return [step for run, step, st in _rows(db) if run == RUN and st == status]


def _assert_layout(nodes: LocalCluster) -> None:
    """Each worker node holds one policy rank; the controller and the rollout worker are on
    the head, the driver's node."""
    ranks = {id(node): len(nodes.actors(node, "PolicyRank")) for node in nodes.workers}
    assert sorted(ranks.values()) == [1, 1], {n.node_id: nodes.titles(n) for n in nodes.workers}
    assert nodes.actors(nodes.head, "PolicyRank") == []
    assert nodes.hosting("Controller") == [nodes.head]
    assert nodes.hosting("RolloutWorker") == [nodes.head], (
        "the rollout worker is not on the controller's node (trainer/actors.py spawn(): a soft "
        "node affinity lets Ray place a zero-CPU actor on any node)"
    )


def test_a_sharded_run_saves_and_resumes_across_nodes(
    nodes: LocalCluster, tmp_path: Path, pg_schema_url: str, store_url: str
) -> None:
    first_args = _args(nodes, tmp_path, pg_schema_url, store_url, **{"grpo.max_num_steps": 6})
    with trainer_process(first_args, _env(), tmp_path) as first:
        first.wait_for(SHARDED)
        first.wait_for(r"^step\s+1 \|")
        _assert_layout(nodes)
        code = first.finish()
    assert code == 0, first.output
    assert re.search(rf"^finished: run '{RUN}' at step 6 ", first.output, re.M), first.output
    assert _steps(pg_schema_url, "committed")[-1] == 6

    again = _args(nodes, tmp_path, pg_schema_url, store_url, **{"grpo.max_num_steps": 10})
    code, output = run_trainer(again, _env(), tmp_path, timeout=300)
    assert code == 0, output
    assert re.search(SHARDED, output, re.M), output
    assert re.search(rf"^resumed run '{RUN}' from step 6:", output, re.M), output
    assert re.search(rf"^finished: run '{RUN}' at step 10 ", output, re.M), output
    assert not re.search(r"^step\s+[1-6] \|", output, re.M), output  # nothing trained twice

    assert not [row for row in _rows(pg_schema_url) if row[2] == "pending"]
    with open_run(RUN, db=pg_schema_url, store=store_url, writable=False) as run:
        latest = run.latest()
        assert latest is not None
        assert latest.step == 10
        names = {component.name for component in latest.components}
        expected = {"dcp/metadata", "dcp/rank0", "dcp/rank1", "replay_buffer", "dataloader"}
        assert expected | {"rollout_state"} <= names, names
        assert (latest.training_info or {}).get("policy_sharding", {}).get("workers") == 2


def _ranks_waiting(nodes: LocalCluster) -> int:
    """How many policy ranks are inside ``shard_receipts`` (waiting for their uploads)."""
    return sum(
        title.startswith("ray::PolicyRank.shard_receipts")
        for node in nodes.workers
        for title in nodes.actors(node, "PolicyRank")
    )


def _cli(db: str, store: str, *args: str) -> Any:
    """``ckptstore --db DB --store STORE ARGS --json``, which must succeed: its report."""
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore", "--db", db, "--store", store, *args, "--json"],
        capture_output=True,
        text=True,
        env=checkout_env(),
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def _store_digests(weed: s3servers.SeaweedServer, store: str) -> set[str]:
    bucket, _, prefix = store.removeprefix("s3://").partition("/")
    client = s3servers.plain_client(weed.endpoint_url)
    found = set()
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/cas/"
    ):
        for item in page.get("Contents", []):
            digest = digest_from_key(item["Key"].removeprefix(f"{prefix}/"))
            assert digest is not None, item["Key"]
            found.add(digest)
    return found


def _blob_rows(db: str) -> set[str]:
    engine = create_engine(db)
    try:
        with engine.connect() as conn:
            return {row.digest for row in conn.execute(text("SELECT digest FROM blobs"))}
    finally:
        engine.dispose()


class _HungSave:
    """Watches a run whose store is stalled: returns the step of the save that hangs, once
    both ranks wait for its uploads (``shard_receipts``, called when the next save has to
    wait for it) in two checks in a row -- a call that finds the uploads done returns at once.
    That save is the newest one taken, it is not committed, and training went on after it."""

    def __init__(self, lines: list[str], nodes: LocalCluster) -> None:
        self.lines = lines
        self.nodes = nodes
        self.waiting = 0

    def __call__(self, line: str | None) -> int | None:
        if line is not None:
            return None
        steps = [re.match(r"step\s+(\d+) \|", text) for text in self.lines]
        taken = [int(m[1]) for m in steps if m and "| save (" in m.string]
        newest = max((int(m[1]) for m in steps if m), default=0)
        save = max(taken, default=0)
        committed = any(text.startswith(f"saved step {save} ") for text in self.lines)
        if save and newest > save and not committed and _ranks_waiting(self.nodes) == 2:
            self.waiting += 1
        else:
            self.waiting = 0
        return save if self.waiting >= 2 else None


def test_a_node_lost_mid_save_commits_nothing_and_the_rest_resume(
    nodes: LocalCluster,
    tmp_path: Path,
    pg_schema_url: str,
    store_url: str,
    weed: s3servers.SeaweedServer,
) -> None:
    steps = 16
    args = _args(nodes, tmp_path, pg_schema_url, store_url, **{"grpo.max_num_steps": steps})
    assert weed.process is not None
    with trainer_process(args, _env(), tmp_path) as trainer:
        trainer.wait_for(SHARDED)
        trainer.wait_for(rf"^saved step {SAVE_PERIOD} ")  # the run has a committed checkpoint
        with paused(weed.process.pid) as resume:
            hung_step = trainer.wait_until(
                _HungSave(trainer.lines, nodes), "both ranks waiting for a save's uploads", 120
            )
            lost = next(n for n in nodes.workers if not nodes.actors(n, "RolloutWorker"))
            assert nodes.actors(lost, "PolicyRank")
            assert not nodes.actors(lost, "Controller")
            nodes.remove(lost)
            resume()
            code = trainer.finish(timeout=180)
    # A failure at run time (exit 1), in one line that names the lost worker and its node.
    assert code == 1, trainer.output
    error = re.search(r"^error: (.*)", trainer.output, re.M)
    assert error, trainer.output
    assert re.search(r"policy (rank|worker)", error[1]), error[1]
    assert re.search(r"lost|died", error[1]), error[1]
    assert lost.node_id[:8] in error[1], (lost.node_id, error[1])

    # Nothing of the hung save was committed (no row at all: the controller never began its
    # commit), no row is left pending, and the newest commit is older.
    rows = _rows(pg_schema_url)
    assert not [row for row in rows if row[2] == "pending"], rows
    assert not [row for row in rows if row[0] == RUN and row[1] >= hung_step], rows
    last = _steps(pg_schema_url, "committed")[-1]
    assert SAVE_PERIOD <= last < hung_step

    # One policy worker on what is left resumes from there and finishes.
    alone = [*args, "policy.num_workers=1"]
    code, output = run_trainer(alone, _env(), tmp_path, timeout=300)
    assert code == 0, output
    assert re.search(rf"^resumed run '{RUN}' from step {last}:", output, re.M), output
    assert re.search(rf"^finished: run '{RUN}' at step {steps} ", output, re.M), output
    assert _steps(pg_schema_url, "committed")[-1] == steps

    # Every committed checkpoint verifies; GC finds what the failed save uploaded (objects
    # without a row) and deletes it, and then every object in the store has a blob row.
    verified = _cli(pg_schema_url, store_url, "verify")
    assert verified["problems"] == [], verified
    assert verified["checkpoints"] > 0, verified
    assert _cli(pg_schema_url, store_url, "gc", "--dry-run", "--grace", "0s")["orphans"] > 0
    collected = _cli(pg_schema_url, store_url, "gc", "--grace", "0s")
    assert collected["errors"] == [], collected
    assert _store_digests(weed, store_url) == _blob_rows(pg_schema_url)
    assert _cli(pg_schema_url, store_url, "gc", "--dry-run", "--grace", "0s")["orphans"] == 0
    assert _cli(pg_schema_url, store_url, "verify")["problems"] == []
