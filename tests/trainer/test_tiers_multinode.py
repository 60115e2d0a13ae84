"""Node-local tiers on a multi-node Ray cluster on this machine (issue 39): every node its own
tier directory (``tier-{node}``: each node's processes get ``CKPTSTORE_NODE``), a tier agent per
node, R = 2 replicas over the head and two worker nodes, the sharded policy's ranks on the
worker nodes.

1. A node holding a policy rank is lost mid-run (its processes killed, its raylet removed, its
   tier directory deleted). The run fails naming the lost rank; the same command, with a spare
   node added, resumes from the newest local checkpoint -- newer than anything in the store --
   reading every byte from the surviving nodes' tiers and none from the store, and finishes
   with its last checkpoint drained (remote-durable); ``ckptstore verify`` is clean.
2. A worker node whose view of the store's directory is a disk of its own (a mount namespace
   with an empty tmpfs over the store path: what a second machine with a local directory is)
   makes the run refuse to start with one line naming the fix, before anything is saved.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray_cluster import LocalCluster, local_cluster, run_trainer, trainer_process
from sqlalchemy import create_engine, text
from trainer_helpers import CHECKOUT, checkout_env, small_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

RUN = "tiered"
SLOT = {"policy_slot": 1}
NAMES = ("head", "n1", "n2")


@pytest.fixture
def ray_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What Ray and the nodes' processes need from this process's environment."""
    ray_tmp = tempfile.mkdtemp(prefix="rtn-", dir="/tmp")  # socket paths must stay short
    python_path = [str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])]
    for name, value in {
        "RAY_TMPDIR": ray_tmp,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "HOME": str(tmp_path / "home"),
        "PYTHONPATH": os.pathsep.join(python_path),
    }.items():
        monkeypatch.setenv(name, value)
    try:
        yield
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _args(cluster: LocalCluster, root: Path, **extra: Any) -> list[str]:
    settings: dict[str, Any] = {
        "backend": "ray",
        "ray_address": cluster.address,
        "policy.num_workers": 2,
        "policy.worker_resources.policy_slot": 1,
        "policy.collective_timeout_s": 20,
        "checkpointing.run_name": RUN,
        "checkpointing.local_dir": str(root / "tier-{node}"),
        "checkpointing.local_period": 1,
        "checkpointing.save_period": 100,  # only the last save is drained
        "checkpointing.db": str(root / "manifest.db"),
        "checkpointing.store": str(root / "store"),
        **extra,
    }
    return small_overrides(root, **settings)


def _rows(root: Path) -> list[tuple[int, str]]:
    engine = create_engine(f"sqlite:///{root / 'manifest.db'}")
    try:
        with engine.connect() as conn:
            found = conn.execute(
                text(
                    "SELECT c.step, c.status FROM checkpoints c JOIN runs r ON r.id = c.run_id "
                    "WHERE r.name = :run ORDER BY c.step, c.id"
                ),
                {"run": RUN},
            ).all()
    finally:
        engine.dispose()
    return [(row.step, row.status) for row in found]


def _env() -> dict[str, str]:
    return checkout_env(PYTHONUNBUFFERED="1")


def test_a_lost_node_is_recovered_from_the_peers_tiers_without_the_store(
    ray_env: None, tmp_path: Path
) -> None:
    with local_cluster(workers=2, worker_resources=SLOT, names=NAMES) as cluster:
        args = _args(cluster, tmp_path, **{"grpo.max_num_steps": 40})
        with trainer_process(args, _env(), tmp_path) as first:
            first.wait_for(r"^node-local tiers at .* on 3 node\(s\), 2 replica\(s\)")
            first.wait_for(r"^saved step 3 \(local\) to the node-local tiers")
            lost = next(node for node in cluster.workers if cluster.actors(node, "PolicyRank"))
            lost_name = NAMES[1 + cluster.workers.index(lost)]
            cluster.remove(lost)
            shutil.rmtree(tmp_path / f"tier-{lost_name}")
            code = first.finish()
        assert code != 0, first.output
        assert re.search(r"policy worker\(s\) lost", first.output), first.output
        local = [step for step, status in _rows(tmp_path) if status == "local"]
        assert local, _rows(tmp_path)
        assert not [step for step, status in _rows(tmp_path) if status == "committed"]
        newest = max(local)

        cluster.add(SLOT, {"CKPTSTORE_NODE": "n3"})  # a spare replaces the lost node
        again = _args(cluster, tmp_path, **{"grpo.max_num_steps": newest + 2})
        code, output = run_trainer(again, _env(), tmp_path, timeout=600)
    assert code == 0, output
    assert re.search(rf"^resumed run '{RUN}' from step {newest}:", output, re.M), output
    reads = re.search(
        rf"^resume read step {newest} \(local\) from node-local tiers: (.*); from the store: "
        r"([0-9.]+) MiB$",
        output,
        re.M,
    )
    assert reads, output
    assert float(reads.group(2)) == 0.0, output  # R = 2: every blob survived on a peer
    assert lost_name not in reads.group(1), output
    assert re.search(rf"^drained step {newest + 2} to the store", output, re.M), output
    assert (newest + 2, "committed") in _rows(tmp_path)
    verify = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptstore",
            "--db",
            str(tmp_path / "manifest.db"),
            "--store",
            str(tmp_path / "store"),
            "verify",
            RUN,
        ],
        capture_output=True,
        text=True,
        env=checkout_env(),
        timeout=300,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _namespaced_node(cluster: LocalCluster, store: Path, name: str) -> subprocess.Popen[bytes]:
    """A worker node (``ray start``) in a mount namespace of its own whose store directory is
    an empty tmpfs: the same path, another disk."""
    ray = Path(sys.executable).with_name("ray")
    script = (
        f"mount -t tmpfs tmpfs {store} && exec {ray} start --address={cluster.address} "
        f"--num-cpus=1 --resources='{{\"policy_slot\": 1}}' --block"
    )
    env = {**os.environ, "CKPTSTORE_NODE": name}
    return subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _wait_for_alive_nodes(cluster: LocalCluster, count: int, timeout: float = 120.0) -> None:
    import time

    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout
        while len([n for n in ray.nodes() if n["Alive"]]) < count:
            assert time.monotonic() < deadline, f"fewer than {count} nodes joined: {ray.nodes()}"
            time.sleep(0.5)
    finally:
        ray.shutdown()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_a_node_that_does_not_see_the_store_makes_the_run_refuse_to_start(
    ray_env: None, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], check=False)
    if probe.returncode != 0:
        pytest.skip("mount namespaces are not allowed here")
    with local_cluster(workers=1, worker_resources=SLOT, names=NAMES[:2]) as cluster:
        node = _namespaced_node(cluster, store, "elsewhere")
        try:
            _wait_for_alive_nodes(cluster, 3)
            args = _args(cluster, tmp_path, **{"grpo.max_num_steps": 4})
            code, output = run_trainer(args, _env(), tmp_path, timeout=600)
        finally:
            os.killpg(node.pid, 9)
            node.wait(60)
    assert code == 2, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    assert "node 'elsewhere' does not see the object store" in errors[0], output
    assert "s3://" in errors[0], output
    assert not [row for row in _rows(tmp_path) if row[1] != "failed"], _rows(tmp_path)
