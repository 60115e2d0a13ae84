"""torch DCP through ckptstore from two gloo processes on CPU, on a local directory and on a
real S3 server (SeaweedFS): DTensor Shard(0) -> Shard(1) / replicated / partial, an unchanged
re-save uploading nothing, a failing rank committing nothing, async_save, an FSDP2 model +
AdamW round trip -- then the 2-rank checkpoint loaded into one process, and exported.

Each case starts two Python processes (~15 s on two cores), so all scenarios run inside one
launch per backend (tests/integrations/dcp_child.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore
from ckptstore.integrations import dcp as ckpt_dcp
from ckptstore.testing.factories import S3StoreFactory

CHILD = Path(__file__).with_name("dcp_child.py")


def launch(
    tmp_path: Path, db: str, store: str, env: dict[str, str], world: int = 2
) -> dict[str, Any]:
    """Run the child on ``world`` ranks; the observations rank 0 wrote."""
    out = tmp_path / "observed.json"
    children = [
        subprocess.Popen(
            [sys.executable, str(CHILD), str(rank), str(world), db, store, str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
        for rank in range(world)
    ]
    outputs = []
    for child in children:
        try:
            text, _ = child.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for c in children:
                c.kill()
            raise
        outputs.append(text.decode(errors="replace"))
    failed = [
        f"rank {rank} exited {child.returncode}:\n{text[-5000:]}"
        for rank, (child, text) in enumerate(zip(children, outputs, strict=True))
        if child.returncode != 0
    ]
    assert not failed, "\n\n".join(failed)
    return dict(json.loads(out.read_text()))


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


def check_run(observed: dict[str, Any], db: str, store: str, world: int = 2) -> None:
    """What the ranks reported, then the checkpoint from one process (world -> 1)."""
    ranks = [f"dcp/rank{r}" for r in range(world)]
    assert observed["components"] == ["dcp/metadata", *ranks]
    assert observed["step1_uploaded"] > 0
    # An unchanged re-save: the data blobs are all known; at most indexes are new.
    assert observed["resave_uploaded"] < 0.01 * observed["step1_logical"], observed
    assert "nothing was committed" in observed["failure"]
    assert "simulated disk failure on rank 1" in observed["failure"]
    assert observed["async_step"] == 4
    assert observed["steps"] == [1, 2, 4, 5], "the failed step 3 must not be committed"

    sys.path.insert(0, str(CHILD.parent))
    try:
        import dcp_child
    finally:
        sys.path.remove(str(CHILD.parent))
    full = dcp_child.expected()
    with ckptstore.open_run(dcp_child.RUN, db=db, store=store, writable=False) as run:
        plain = {k: torch.zeros_like(v) for k, v in full.items()}
        plain["meta"] = {"epoch": 0, "betas": None, "name": ""}
        info = ckpt_dcp.load(plain, run, 4)
        for key, tensor in full.items():
            assert torch.equal(plain[key], tensor), key
        assert plain["meta"] == {"epoch": 3, "betas": (0.9, 0.95), "name": "ok"}
        whole = dict(ckpt_dcp.iter_full_tensors(run.store, info))
        assert set(whole) == {"w", "b", "plain"}
        assert all(torch.equal(whole[k], full[k]) for k in whole)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_two_ranks_local(tmp_path: Path) -> None:
    db, store = str(tmp_path / "manifest.db"), str(tmp_path / "store")
    observed = launch(tmp_path, db, store, child_env())
    check_run(observed, db, store)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_four_ranks_local(tmp_path: Path) -> None:
    """The same scenarios on 4 ranks (uneven shards: 5 rows over 4 ranks)."""
    db, store = str(tmp_path / "manifest.db"), str(tmp_path / "store")
    observed = launch(tmp_path, db, store, child_env(), world=4)
    check_run(observed, db, store, world=4)


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_two_ranks_seaweedfs(
    tmp_path: Path, seaweed_store_factory: S3StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = seaweed_store_factory.endpoint_url
    assert endpoint is not None
    db = str(tmp_path / "manifest.db")
    store = f"s3://{seaweed_store_factory.bucket}/{seaweed_store_factory.prefix}"
    env = child_env(AWS_ENDPOINT_URL=endpoint)
    observed = launch(tmp_path, db, store, env)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    check_run(observed, db, store)
