"""Read once, share (issue 43): data-parallel ranks loading the same replicated checkpoint
read each blob from the object store once between them -- one rank reads it and sends it to
the others over gloo -- instead of once per rank. Counted: the object-store bytes of the data
blobs read by all ranks together equal the bytes of one replica.

Every rank still decodes and verifies what it receives, so a damaged blob fails the load on
every rank, naming the blob, and no rank's state is touched (the load is atomic).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptstore.cas import blob_key
from ckptstore.checkpointer import open_run
from ckptstore.integrations import dcp as ckpt_dcp
from ckptstore.serialize import read_index
from ckptstore.testing.factories import S3StoreFactory

CHILD = Path(__file__).with_name("dcp_read_once_child.py")
sys.path.insert(0, str(CHILD.parent))
from dcp_read_once_child import saved  # noqa: E402


def _save(tmp_path: Path, store: object = None) -> tuple[Path, set[str]]:
    """One replicated checkpoint (in ``tmp_path/s``, or ``store``); its plan's JSON file and
    the keys of its data blobs."""
    import warnings

    warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
    store = store if store is not None else tmp_path / "s"
    with open_run("r", db=tmp_path / "m.db", store=store, async_save=False) as run:
        ckpt_dcp.save(saved(), run, 1)
        plan = ckpt_dcp.plan_load(run, 1)
        data: set[str] = set()
        for comp in run.checkpoint(1).components:
            for entry in read_index(run.store, comp.index_digest).entries:
                data.update(blob_key(seg.digest) for seg in entry.segments)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    return plan_file, data


def _launch(
    tmp_path: Path,
    world: int,
    share: bool | None,
    case: str = "load",
    store: str = "",
    **env_extra: str,
) -> list[dict[str, Any]]:
    mode = "default" if share is None else str(int(share))
    out = tmp_path / f"out-{world}-{mode}-{case}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **env_extra)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    where = store or str(tmp_path / "s")
    args = [where, str(tmp_path / "plan.json"), str(out), mode, case]
    children = [
        subprocess.Popen(
            [sys.executable, str(CHILD), str(rank), str(world), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for rank in range(world)
    ]
    texts = []
    for child in children:
        try:
            texts.append(child.communicate(timeout=180)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for c in children:
                c.kill()
            raise
    for rank, (child, text) in enumerate(zip(children, texts, strict=True)):
        shown = text if len(text) < 5000 else f"{text[:2500]}\n...\n{text[-2500:]}"
        assert child.returncode == 0, f"rank {rank} exited {child.returncode}:\n{shown}"
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(world)]


def _data_bytes(results: list[dict[str, Any]], data: set[str]) -> int:
    return sum(n for r in results for key, n in r["read_bytes"].items() if key in data)


def test_three_replicas_read_each_blob_once(tmp_path: Path) -> None:
    _, data = _save(tmp_path)
    one_replica = sum((tmp_path / "s" / key).stat().st_size for key in data)
    shared = _launch(tmp_path, 3, share=True)
    assert all(r["exact"] and not r["error"] for r in shared), shared
    assert _data_bytes(shared, data) == one_replica
    # Six blobs, each read by one rank and sent to the two others; the reads are spread.
    assert len(data) == 6
    assert sum(r["sent"] for r in shared) == 2 * len(data) == sum(r["received"] for r in shared)
    assert all(r["sent"] > 0 for r in shared)


@pytest.mark.integration
def test_the_user_facing_load_shares_by_default_on_a_remote_store(
    tmp_path: Path, seaweed_store_factory: S3StoreFactory
) -> None:
    """On S3 (SeaweedFS) ``ckptstore.integrations.dcp.load`` reads each blob once between
    the ranks without being asked."""
    endpoint = seaweed_store_factory.endpoint_url
    assert endpoint is not None
    store = seaweed_store_factory()
    _, data = _save(tmp_path, store)
    one_replica = sum(store.head(key).size for key in data)
    url = f"s3://{seaweed_store_factory.bucket}/{seaweed_store_factory.prefix}"
    results = _launch(tmp_path, 2, None, "api", url, AWS_ENDPOINT_URL=endpoint)
    assert all(r["exact"] and not r["error"] for r in results), results
    assert _data_bytes(results, data) == one_replica


def test_a_local_directory_is_read_by_every_rank_by_default(tmp_path: Path) -> None:
    """Measured (bench/bench_read_once.py): on one machine's own disk, sending costs more than
    reading, so each rank reads its own copy unless asked to share: every replica is read."""
    _, data = _save(tmp_path)
    one_replica = sum((tmp_path / "s" / key).stat().st_size for key in data)
    results = _launch(tmp_path, 2, None, "api")
    assert all(r["exact"] and not r["error"] for r in results), results
    assert _data_bytes(results, data) == 2 * one_replica


@pytest.mark.parametrize("world", [2])
def test_a_damaged_shared_blob_fails_every_rank_and_touches_nothing(
    tmp_path: Path, world: int
) -> None:
    _, data = _save(tmp_path)
    victim = tmp_path / "s" / sorted(data)[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.chmod(0o644)
    victim.write_bytes(bytes(raw))
    results = _launch(tmp_path, world, share=True, case="damaged")
    digest_hex = victim.name
    for r in results:
        assert r["error"].startswith("IntegrityError"), r
        assert digest_hex in r["error"]
        assert r["untouched"], "an atomic load touches no target when a blob fails"
