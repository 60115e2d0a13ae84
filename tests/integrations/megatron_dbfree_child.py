"""One rank of the DB-free Megatron job (spawned by test_megatron_dbfree.py).

Rank 0 opens the run (the only database user); rank 1 passes None and ``store=`` and has no
database at all: its ``CKPTSTORE_DB`` / ``CKPTSTORE_STORE`` point nowhere, and every way to a
database connection (sqlite3, psycopg, any SQLAlchemy pool) is replaced, before ckptstore is
imported, by one that records the attempt and fails. The scenarios, in order:

1. ``mirror``: rank 1 reads a copy of the store (another URL). Rank 0 skips step 3 (its layout
   lies) and chooses step 2, whose second shard -- which only rank 1 reads -- is damaged in the
   copy as in the store. A rank that reads another store than rank 0's cannot condemn
   anything: every rank raises, step 2 stays committed.
2. ``fallback``: rank 0 commits step 4 (a lying layout), then every rank loads the newest from
   the run's store: rank 0 skips step 4, rank 1 finds step 2 damaged, rank 0 marks it corrupt
   and both fall back to step 1 (bit-exact).
3. ``save``: steps 5 (sync) and 6 (async, Megatron's AsyncCallsQueue) of the TP=2 model, rank 1
   passing only the store; then the newest (6) and step 5 load back bit-exact.
4. ``arguments``: rank 1 passes neither a run nor a store: ConfigError on both ranks, at once.

Run as ``python megatron_dbfree_child.py RANK CONFIG_JSON``; it writes ``<root>/rank<RANK>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

#: Every database connection rank 1 attempted (must stay empty).
ATTEMPTS: list[str] = []


def refuse_databases() -> None:
    """Make every database connection of this process fail, and record that it was tried."""
    import sqlite3

    from sqlalchemy import event
    from sqlalchemy.pool import Pool

    def refused(what: str) -> Any:
        def connect(*args: Any, **kwargs: Any) -> Any:
            ATTEMPTS.append(f"{what}{args[:1]}")
            raise AssertionError(f"rank 1 must not open a database ({what})")

        return connect

    sqlite3.connect = refused("sqlite3.connect")
    try:
        import psycopg

        psycopg.connect = refused("psycopg.connect")  # type: ignore[assignment]
    except ImportError:
        pass
    event.listen(Pool, "connect", lambda *args: ATTEMPTS.append("pool connect"))


def halves(rank: int, rows_per_rank: int, step: int) -> Any:
    """What rank ``rank`` must load of tensor 'w' of the crafted checkpoint ``step``."""
    from crafted_checkpoints import rows

    return rows(rows_per_rank, 1024, start=rank * rows_per_rank) + step


def run_rank(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from crafted_checkpoints import MEGATRON_LIES, commit_megatron
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron_child import cpu_stand_ins, expected_local, same, sharded_state_dict

    import ckptstore
    from ckptstore.integrations import megatron as mcore

    root, url, rows_per_rank = Path(config["root"]), config["store"], config["rows"]
    rendezvous = f"file://{root / 'rendezvous'}"
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=rendezvous)
    run = ckptstore.open_run("dbfree", db=config["db"], store=url) if rank == 0 else None
    report: dict[str, Any] = {"rank": rank}

    def wanted() -> dict[str, Any]:
        half = torch.full((rows_per_rank, 1024), -7.0)
        return {"w": ShardedTensor.from_rank_offsets("w", half, (0, rank, 2))}

    def attempt(name: str, call: Any) -> Any:
        try:
            result = call()
        except Exception as exc:
            report[name] = {"error": type(exc).__name__, "message": str(exc)}
            return None
        report[name] = {"error": None}
        return result

    # 1. rank 1 reads the mirror: its damage condemns nothing.
    mine = config["mirror"] if rank == 1 else url
    attempt("mirror", lambda: mcore.load(wanted(), run, store=mine))
    if run is not None:
        report["after_mirror"] = {c.step: c.status for c in run.checkpoints()}
        commit_megatron(run, 4, MEGATRON_LIES["overlap_hides_a_gap"][0])

    # 2. the newest that holds up, every rank the same (rank 0 passes its run and the URL).
    loaded = attempt("fallback", lambda: mcore.load(wanted(), run, store=url))
    if loaded is not None:
        report["fallback_w"] = torch.equal(loaded["w"], halves(rank, rows_per_rank, 1))
    if run is not None:
        report["after_fallback"] = {c.step: c.status for c in run.checkpoints()}

    # 3. saves where rank 1 has only the store, then loads of them.
    attempt("save5", lambda: mcore.save(sharded_state_dict(5, rank, 2), run, 5, store=url))
    cpu_stand_ins()
    queue = AsyncCallsQueue()
    state = sharded_state_dict(6, rank, 2)
    queue.schedule_async_request(mcore.save(state, run, 6, store=url, async_save=True))
    state["model"]["mlp.fc1.weight"].data.add_(1.0)  # training goes on: the snapshot holds
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    for name, step, seed in (("newest", None, 6), ("step5", 5, 5)):
        got = mcore.load(sharded_state_dict(None, rank, 2), run, step, store=url)
        report[f"{name}_model"] = same(got["model"], expected_local(seed, rank, 2))
        report[f"{name}_objects"] = got["rng_state"] == {
            "seed": seed,
            "tp_rank": rank,
            "ids": [1, 2, 3],
        }
    if run is not None:
        report["saved"] = {c.step: c.status for c in run.checkpoints() if c.step >= 5}

    # 4. a rank with neither a run nor a store: every rank hears of it.
    attempt("arguments", lambda: mcore.load(wanted(), run, store=url if rank == 0 else None))

    report["db_attempts"] = list(ATTEMPTS)
    if run is not None:
        run.close()
    dist.barrier()
    dist.destroy_process_group()
    return report


def main() -> None:
    rank, config = int(sys.argv[1]), json.loads(sys.argv[2])
    sys.path.insert(0, str(Path(__file__).parents[1]))  # crafted_checkpoints
    if rank == 1:
        os.environ["CKPTSTORE_DB"] = "postgresql+psycopg://nobody@127.0.0.1:9/no-database"
        os.environ["CKPTSTORE_STORE"] = "/nonexistent/ckptstore-store"
        refuse_databases()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.dist_checkpointing  # noqa: F401
    try:
        report = run_rank(rank, config)
    except BaseException:
        report = {"rank": rank, "traceback": traceback.format_exc(), "db_attempts": ATTEMPTS}
    Path(config["root"], f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
