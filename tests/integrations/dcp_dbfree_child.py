"""One rank of the DB-free DCP test (tests/integrations/test_dcp_dbfree.py).

Run as ``python dcp_dbfree_child.py RANK WORLD DB STORE OUTDIR``. Rank 0 opens the run (DB);
every other rank gets ``-`` for DB, an unreachable ``$CKPTSTORE_DB``, and never opens a
database: it passes ``None, store=STORE`` or a :class:`LoadPlan`. Every rank counts the
database connections it opens (the probe must see rank 0's) and writes what it observed to
``OUTDIR/observed<rank>.json``. Any failed expectation exits non-zero with the traceback.

Step 1 was saved by the test in one process before the launch (1 -> 2 ranks). Then: 2 is
saved with ``ckpt_dcp.save``, 3 (the same state) with ``save_shards`` and a commit by rank 0,
4 with ``save_shards(async_save=True)`` on a separate gloo group; 4's rank-1 data is damaged,
a handed-over plan of it raises on every rank, and a coordinated load falls back to 3.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from sqlalchemy import event
from sqlalchemy.pool import Pool
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import ckptstore
from ckptstore.errors import CkptStoreError
from ckptstore.extending import ComponentReader, Database
from ckptstore.integrations import dcp as ckpt_dcp

RUN = "dcp-dbfree"
RANK_COMPONENTS = ["dcp/rank0", "dcp/rank1"]

#: Every database connection or manifest this process opens (checked at the end).
opened: list[str] = []


def watch_the_database() -> None:
    """Count SQLite connects, SQLAlchemy pool connects (any dialect) and Database objects."""
    sys.addaudithook(lambda name, _: opened.append(name) if name == "sqlite3.connect" else None)
    event.listen(Pool, "connect", lambda *_: opened.append("pool connect"))
    init = Database.__init__

    def counted(self: Database, *args: Any, **kwargs: Any) -> None:
        opened.append("Database")
        init(self, *args, **kwargs)

    Database.__init__ = counted  # type: ignore[method-assign]


def full(seed: int) -> dict[str, Any]:
    """The whole state saved at a step (the test recomputes it)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(5, 12, generator=gen),  # 5 rows over 2 ranks: 3 + 2
        "b": (torch.arange(20, dtype=torch.bfloat16) * seed).reshape(5, 4),
        "plain": torch.linspace(0, seed, 7),
        "meta": {"seed": seed, "betas": (0.9, 0.95)},
    }


def sharded(mesh: Any, dim: int, seed: int | None) -> dict[str, Any]:
    """``full(seed)`` (zeros when None) with w and b sharded on ``dim``."""
    state = full(seed if seed is not None else 1)
    if seed is None:
        state = {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()
        }
        state["meta"] = {"seed": -1, "betas": None}
    for key in ("w", "b"):
        state[key] = distribute_tensor(state[key], mesh, [Shard(dim)])
    return state


def check(loaded: dict[str, Any], seed: int, what: str) -> None:
    want = full(seed)
    for key in ("w", "b", "plain"):
        value = loaded[key]
        got = value.full_tensor() if isinstance(value, DTensor) else value
        assert got.dtype == want[key].dtype, f"{what}: {key}"
        assert torch.equal(got, want[key]), f"{what}: {key}"
    assert loaded["meta"] == want["meta"], (what, loaded["meta"])


def raised(call: Any) -> list[str]:
    try:
        call()
    except CkptStoreError as exc:
        return [type(exc).__name__, str(exc)]
    raise AssertionError("expected a ckptstore error on every rank")


def damage_rank1_data(run: ckptstore.Run, store_dir: Path) -> str:
    """Flip a byte of a blob that only step 4's dcp/rank1 holds; its digest."""

    def blobs(step: int, component: str) -> set[str]:
        digest = next(
            c.index_digest for c in run.checkpoint(step).components if c.name == component
        )
        return ComponentReader(run.store, digest).digests

    only4 = blobs(4, "dcp/rank1") - blobs(3, "dcp/rank1") - blobs(3, "dcp/rank0")
    digest = sorted(only4)[0]
    hexdigest = digest.split(":", 1)[1]
    path = store_dir / "cas" / hexdigest[:2] / hexdigest
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    return digest


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    db, store, outdir = sys.argv[3], sys.argv[4], Path(sys.argv[5])
    watch_the_database()
    rendezvous = outdir / "pg-rendezvous"
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{rendezvous}")
    mesh = init_device_mesh("cpu", (world,))
    observed: dict[str, Any] = {}
    run = ckptstore.open_run(RUN, db=db, store=store) if rank == 0 else None
    if rank != 0:
        assert db == "-", "only rank 0 is given a database"
    source = run  # None on every rank but 0

    # 1. Step 1, saved in one process, loads into Shard(0) on every rank (1 -> 2).
    target = sharded(mesh, 0, None)
    info = ckpt_dcp.load(target, source, store=store)
    check(target, 1, "step 1 on two ranks")
    observed["first"] = [info.run, info.step, [c.index_digest for c in info.components]]

    # 2. ckpt_dcp.save, then the newest loads as Shard(1).
    ckpt_dcp.save(sharded(mesh, 0, 2), run if run is not None else store, 2)
    target = sharded(mesh, 1, None)
    assert ckpt_dcp.load(target, source, store=store).step == 2
    check(target, 2, "step 2")

    # 3. The same state through save_shards; rank 0 commits with a component of its own.
    receipts = ckpt_dcp.save_shards(sharded(mesh, 0, 2), store)
    assert isinstance(receipts, list)
    observed["receipts"] = [r.component for r in receipts]
    if run is not None:
        names = [r.component for r in receipts if r.component != ckpt_dcp.METADATA_COMPONENT]
        info3 = run.save(3, {"trainer": {"step": 3}}, receipts=receipts, expect_changed=names)
        committed = info3.wait()
        observed["stale3"] = (committed.training_info or {}).get("stale_components")
    target = sharded(mesh, 1, None)
    # Only rank 0 names the step: the others follow it.
    assert ckpt_dcp.load(target, source, 3 if rank == 0 else None, store=store).step == 3
    check(target, 2, "step 3")

    # 4. Asynchronously, on a gloo group of its own (as training would keep the default one).
    group = dist.new_group(backend="gloo")
    future = ckpt_dcp.save_shards(sharded(mesh, 0, 4), store, process_group=group, async_save=True)
    assert not isinstance(future, list)
    receipts = future.result(timeout=120)
    if run is not None:
        run.save(4, {"trainer": {"step": 4}}, receipts=receipts).wait()
    target = sharded(mesh, 0, None)
    assert ckpt_dcp.load(target, source, store=store, process_group=group).step == 4
    check(target, 4, "step 4")

    # 5. Damage step 4's rank-1 data. A plan handed over (as JSON) raises on every rank and
    # marks nothing; the coordinated load marks it corrupt and every rank falls back to 3.
    if run is not None:
        observed["damaged"] = damage_rank1_data(run, Path(store))
        box = [ckpt_dcp.plan_load(run).to_json()]
    else:
        box = [None]
    dist.broadcast_object_list(box, src=0)
    plan = ckpt_dcp.LoadPlan.from_json(box[0])
    assert plan.step == 4
    target = sharded(mesh, 0, None)
    # Rank 1 is given no store: the plan's URL is used.
    failure = raised(lambda: ckpt_dcp.load(target, plan, store=store if rank == 0 else None))
    observed["given_damaged"] = failure
    if run is not None:
        assert run.checkpoint(4).status == "committed", "a handed-over plan marks nothing"
    target = sharded(mesh, 0, None)
    info = ckpt_dcp.load(target, source, store=store)
    observed["fallback_step"] = info.step
    check(target, 2, "fallback to step 3")
    if run is not None:
        observed["statuses"] = {c.step: c.status for c in run.checkpoints()}
        plan3 = ckpt_dcp.plan_load(run)
        box = [plan3.to_json()]
    else:
        box = [None]
    dist.broadcast_object_list(box, src=0)
    plan3 = ckpt_dcp.LoadPlan.from_json(box[0])
    target = sharded(mesh, 1, None)
    assert ckpt_dcp.load(target, plan3, store=store).step == 3
    check(target, 2, "step 3 from a handed-over plan")

    # 6. Configurations that cannot work fail on every rank, naming the fix; nobody hangs.
    target = sharded(mesh, 0, None)
    observed["no_store"] = raised(lambda: ckpt_dcp.load(target, source))
    observed["mixed"] = raised(lambda: ckpt_dcp.load(target, run or plan3, store=store))
    observed["steps"] = raised(lambda: ckpt_dcp.load(target, source, 2 + rank, store=store))
    observed["rank0_none"] = raised(
        lambda: ckpt_dcp.load(target, None if rank == 0 else plan3, store=store)
    )
    observed["rank0_none_both"] = raised(lambda: ckpt_dcp.load(target, None, store=store))
    observed["different"] = raised(
        lambda: ckpt_dcp.load(target, plan3 if rank == 0 else plan, store=store)
    )

    dist.barrier()
    observed["opened"] = opened
    observed["dot_ckptstore"] = Path(".ckptstore").exists()
    (outdir / f"observed{rank}.json").write_text(json.dumps(observed))
    if run is not None:
        run.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # As in dcp_child.py: skip the interpreter's teardown, where gloo's threads sometimes abort.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
