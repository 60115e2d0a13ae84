"""DB-free workers for torch DCP (DESIGN.md §12): only the coordinator opens the manifest.

- ``LoadPlan``: what ranks need to read a checkpoint from the store alone; JSON and pickle
  round trips, and text that is not a plan refused by name.
- ``plan_load``: the newest committed checkpoint (or a step), its metadata checked first; a
  checkpoint whose metadata fails is marked corrupt and skipped.
- ``load`` with a ``LoadPlan`` (no database) and ``save_shards`` + ``Run.save`` (no rank
  commits) in one process, bit-exact, the same components ``save`` makes, and as ``verify``
  and ``show`` see them.
- Two gloo processes where rank 1 has no database at all (tests/integrations/
  dcp_dbfree_child.py): loads with ``None, store=``, resharding both ways, async
  ``save_shards`` on its own group, a damaged checkpoint (a handed-over plan raises on every
  rank; the coordinated load falls back on every rank), errors raised on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import dcp_dbfree_child as child
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.cli import main as cli
from ckptstore.errors import (
    CheckpointNotFoundError,
    ComponentNotFoundError,
    ConfigError,
    IntegrityError,
    SaveError,
)
from ckptstore.extending import (
    CheckpointInfo,
    ComponentReader,
    Run,
    mark_corrupt,
    open_store,
    receipt_from_json,
    receipt_to_json,
)
from ckptstore.integrations import dcp as ckpt_dcp

CHILD = Path(child.__file__)
SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
RUN = "dcp-dbfree-unit"


@pytest.fixture
def run(tmp_path: Path) -> Any:
    with ckptstore.open_run(RUN, db=tmp_path / "m.db", store=tmp_path / "store") as opened:
        yield opened


def zeros(seed: int = 1) -> dict[str, Any]:
    """A target of ``child.full``'s structure holding nothing of it."""
    state = {k: torch.zeros_like(v) for k, v in child.full(seed).items() if k != "meta"}
    return {**state, "meta": {"seed": -1, "betas": None}}


def assert_loaded(target: dict[str, Any], seed: int) -> None:
    want = child.full(seed)
    for key in ("w", "b", "plain"):
        assert target[key].dtype == want[key].dtype, key
        assert torch.equal(target[key], want[key]), key
    assert target["meta"] == want["meta"]


def dcp_components(info: CheckpointInfo) -> dict[str, Any]:
    return {c.name: c for c in info.components if c.name.startswith("dcp/")}


def damage_blob(store_dir: Path, digest: str) -> None:
    hexdigest = digest.split(":", 1)[1]
    path = store_dir / "cas" / hexdigest[:2] / hexdigest
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))


# -- LoadPlan ----------------------------------------------------------------------------------


@SINGLE_PROCESS
def test_a_plan_round_trips_through_json_and_pickle(run: Run) -> None:
    saved = ckpt_dcp.save(child.full(1), run, 1, training_info={"loss": 0.5, "tags": ["a"]})
    assert isinstance(saved, CheckpointInfo)
    plan = ckpt_dcp.plan_load(run)
    assert (plan.run, plan.step, plan.store_url) == (RUN, 1, run.store.url)
    assert plan.info == saved
    assert plan.metadata_digest == dcp_components(saved)["dcp/metadata"].index_digest
    text = plan.to_json()
    json.loads(text)  # plain JSON
    assert ckpt_dcp.LoadPlan.from_json(text) == plan
    assert ckpt_dcp.LoadPlan.from_json(text).info.created_at == saved.created_at
    assert pickle.loads(pickle.dumps(plan)) == plan  # our own object, in memory


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda d: "not json {", "not JSON"),
        (lambda d: {**d, "format": "other"}, "not a DCP load plan"),
        (lambda d: {**d, "version": 2}, "version 2"),
        (lambda d: {k: v for k, v in d.items() if k != "store_url"}, "lacks ['store_url']"),
        (lambda d: {**d, "checkpoint": {**d["checkpoint"], "extra": 1}}, "unknown ['extra']"),
        (lambda d: {**d, "checkpoint": {**d["checkpoint"], "step": "3"}}, "checkpoint.step"),
        (lambda d: {**d, "checkpoint": {**d["checkpoint"], "step": -1}}, "step must be"),
        (lambda d: {**d, "checkpoint": {**d["checkpoint"], "components": {}}}, "components"),
        (
            lambda d: {
                **d,
                "checkpoint": {
                    **d["checkpoint"],
                    "components": [
                        {**c, "index_digest": "b3:zz"} for c in d["checkpoint"]["components"]
                    ],
                },
            },
            "malformed blob digest",
        ),
        (
            lambda d: {**d, "checkpoint": {**d["checkpoint"], "created_at": "yesterday"}},
            "created_at",
        ),
    ],
)
@SINGLE_PROCESS
def test_text_that_is_not_a_plan_is_refused_by_name(run: Run, edit: Any, needle: str) -> None:
    ckpt_dcp.save({"w": torch.ones(3)}, run, 1)
    doc = json.loads(ckpt_dcp.plan_load(run).to_json())
    edited = edit(doc)
    text = edited if isinstance(edited, str) else json.dumps(edited)
    with pytest.raises(ConfigError, match="load plan") as caught:
        ckpt_dcp.LoadPlan.from_json(text)
    assert needle in str(caught.value)


def test_a_plan_of_a_checkpoint_dcp_did_not_save_is_refused(run: Run) -> None:
    info = run.save(1, {"policy": {"w": torch.ones(2)}}).wait()
    with pytest.raises(ComponentNotFoundError, match="'dcp/metadata'"):
        ckpt_dcp.LoadPlan(info)
    with pytest.raises(ComponentNotFoundError, match="'dcp/metadata'"):
        ckpt_dcp.plan_load(run)


@SINGLE_PROCESS
def test_plan_load_resolves_newest_step_and_before_step(run: Run) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        ckpt_dcp.plan_load(run)
    for step in (1, 2, 3):
        ckpt_dcp.save(child.full(step), run, step)
    assert ckpt_dcp.plan_load(run).step == 3
    assert ckpt_dcp.plan_load(run, 2).step == 2
    assert ckpt_dcp.plan_load(run, before_step=3).step == 2
    with pytest.raises(CheckpointNotFoundError, match="below step 1"):
        ckpt_dcp.plan_load(run, before_step=1)
    with pytest.raises(ConfigError, match="not both"):
        ckpt_dcp.plan_load(run, 2, before_step=3)


@SINGLE_PROCESS
def test_plan_load_skips_a_checkpoint_whose_metadata_fails(run: Run) -> None:
    ckpt_dcp.save(child.full(1), run, 1)
    document = {"format": "ckptstore/dcp", "metadata": json.dumps({"format": "nonsense"})}
    run.save(2, {ckpt_dcp.METADATA_COMPONENT: document}).wait()
    with pytest.raises(IntegrityError, match="step 2"):
        ckpt_dcp.plan_load(run, fallback=False)
    with pytest.raises(IntegrityError, match="step 2"):
        ckpt_dcp.plan_load(run, 2)
    assert run.checkpoint(2).status == "committed"  # neither marked anything
    assert ckpt_dcp.plan_load(run).step == 1
    assert {c.step: c.status for c in run.checkpoints()} == {1: "committed", 2: "corrupt"}


# -- one process: load from a plan, save_shards ------------------------------------------------


@SINGLE_PROCESS
def test_a_plan_loads_from_the_store_alone(run: Run, tmp_path: Path) -> None:
    ckpt_dcp.save(child.full(1), run, 1)
    ckpt_dcp.save(child.full(2), run, 2)
    plan = ckpt_dcp.LoadPlan.from_json(ckpt_dcp.plan_load(run, 1).to_json())
    run.close()  # nothing below may need the run or its database
    (tmp_path / "m.db").rename(tmp_path / "gone.db")
    target = zeros()
    info = ckpt_dcp.load(target, plan)  # the plan's store URL
    assert info == plan.info
    assert_loaded(target, 1)
    target = zeros()
    store = open_store(tmp_path / "store")
    reader = ckpt_dcp.CkptStoreReader.for_plan(store, plan)
    assert reader.read_metadata().state_dict_metadata.keys() >= {"w", "b", "plain"}
    assert ckpt_dcp.load(target, plan, store=store).step == 1
    assert_loaded(target, 1)
    nowhere = dataclasses.replace(plan, store_url=None)
    with pytest.raises(ConfigError, match="names no store: pass store="):
        ckpt_dcp.load(zeros(), nowhere)
    with pytest.raises(ConfigError, match="names no store: pass store="):
        ckpt_dcp.CkptStoreReader.for_plan(None, nowhere)


@SINGLE_PROCESS
def test_a_damaged_checkpoint_from_a_plan_raises_and_the_caller_drives_the_fallback(
    run: Run, tmp_path: Path
) -> None:
    ckpt_dcp.save(child.full(1), run, 1)
    second = ckpt_dcp.save(child.full(2), run, 2)
    assert isinstance(second, CheckpointInfo)
    rank0 = dcp_components(second)["dcp/rank0"].index_digest
    first_rank0 = dcp_components(run.checkpoint(1))["dcp/rank0"].index_digest
    only2 = (
        ComponentReader(run.store, rank0).digests - ComponentReader(run.store, first_rank0).digests
    )
    damage_blob(tmp_path / "store", sorted(only2)[0])

    plan = ckpt_dcp.plan_load(run)  # the metadata is fine: the data is not
    assert plan.step == 2
    with pytest.raises(IntegrityError, match="step 2") as caught:
        ckpt_dcp.load(zeros(), plan)
    assert run.checkpoint(2).status == "committed"  # the plan's holder decides
    # The controller's loop: mark it, plan the one before, hand that out.
    mark_corrupt(run, plan.info, caught.value)
    plan = ckpt_dcp.plan_load(run, before_step=plan.step)
    target = zeros()
    assert ckpt_dcp.load(target, plan).step == 1
    assert_loaded(target, 1)
    assert {c.step: c.status for c in run.checkpoints()} == {1: "committed", 2: "corrupt"}


@SINGLE_PROCESS
@pytest.mark.parametrize("async_save", [False, True])
def test_save_shards_then_run_save_is_the_checkpoint_save_commits(
    run: Run, tmp_path: Path, async_save: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = ckpt_dcp.save(child.full(3), run, 1)
    assert isinstance(saved, CheckpointInfo)
    result = ckpt_dcp.save_shards(child.full(3), run.store, async_save=async_save)
    receipts = result if isinstance(result, list) else result.result(timeout=60)
    assert not async_save or not isinstance(result, list)
    assert [r.component for r in receipts] == ["dcp/rank0", "dcp/metadata"]
    # Through JSON, as a controller in another process gets them.
    receipts = [receipt_from_json(json.loads(json.dumps(receipt_to_json(r)))) for r in receipts]
    assert [c.step for c in run.checkpoints()] == [1]  # nothing committed
    committed = run.save(2, {"trainer": {"step": 2}}, receipts=receipts).wait()

    # The same components, byte for byte, as the ones save committed.
    assert dcp_components(committed) == dcp_components(saved)
    assert {c.name for c in committed.components} == {"dcp/metadata", "dcp/rank0", "trainer"}
    target = zeros(3)
    assert ckpt_dcp.load(target, run).step == 2
    assert_loaded(target, 3)
    assert run.load(2, components=["trainer"]).state["trainer"] == {"step": 2}

    base = ["--db", str(tmp_path / "m.db"), "--store", str(tmp_path / "store")]
    capsys.readouterr()
    assert cli([*base, "verify", f"{RUN}@2"]) == 0
    assert "OK" in capsys.readouterr().out
    shown = []
    for step in (1, 2):
        assert cli([*base, "--json", "show", "--entries", f"{RUN}@{step}"]) == 0
        shown.append(json.loads(capsys.readouterr().out))
    assert [c for c in shown[1]["components"] if c["name"].startswith("dcp/")] == shown[0][
        "components"
    ]
    assert shown[1]["state_dict"]["format"] == "torch DCP"
    assert shown[1]["state_dict"] == shown[0]["state_dict"]
    assert {i["name"] for i in shown[1]["state_dict"]["items"]} == {
        "w",
        "b",
        "plain",
        "meta.seed",
        "meta.betas",
    }


@SINGLE_PROCESS
@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_shards_gives_no_receipts(run: Run, async_save: bool) -> None:
    class Failing(ckpt_dcp.NoPickleSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            if write_item.index.fqn == "w":
                raise OSError("simulated disk failure")
            return super().resolve_data(write_item)

    def save() -> Any:
        result = ckpt_dcp.save_shards(
            child.full(1), run.store, planner=Failing(), async_save=async_save
        )
        return result if isinstance(result, list) else result.result(timeout=60)

    with pytest.raises(SaveError, match="simulated disk failure") as caught:
        save()
    assert "nothing from it can be committed" in str(caught.value)
    assert run.checkpoints() == []


# -- errors that name the fix ------------------------------------------------------------------


@SINGLE_PROCESS
def test_loads_that_cannot_work_name_the_fix(run: Run) -> None:
    ckpt_dcp.save({"w": torch.ones(3)}, run, 1)
    with pytest.raises(ConfigError, match=r"passed no run: .*pass it the Run"):
        ckpt_dcp.load({"w": torch.zeros(3)}, None, store=run.store)
    with pytest.raises(ConfigError, match="source is a Run, a LoadPlan or None, not str"):
        ckpt_dcp.load({"w": torch.zeros(3)}, RUN)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="commits nothing, so it takes no step: pass the step"):
        ckpt_dcp.CkptStoreWriter(run.store, 3, commit=False)
    with pytest.raises(ConfigError, match="takes no metrics, expect_changed: "):
        ckpt_dcp.CkptStoreWriter(run.store, commit=False, metrics={}, expect_changed=True)
    with pytest.raises(ConfigError, match="takes no checkpoint_id"):
        dcp.save(
            {"w": torch.ones(3)},
            checkpoint_id=3,
            storage_writer=ckpt_dcp.CkptStoreWriter(run.store, commit=False),
            planner=ckpt_dcp.NoPickleSavePlanner(),
        )


# -- two processes, rank 1 without a database --------------------------------------------------


def child_args(rank: int, world: int, db: str, store: str, tmp_path: Path) -> list[str]:
    """RANK WORLD DB STORE OUTDIR, with no database (``-``) for every rank but 0."""
    return [str(rank), str(world), db if rank == 0 else "-", store, str(tmp_path)]


def launch(tmp_path: Path, db: str, store: str, world: int = 2) -> list[dict[str, Any]]:
    """Run the child on ``world`` ranks (only rank 0 with the database); what each observed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    no_db = dict(env, CKPTSTORE_DB="postgresql+psycopg://nobody@127.0.0.1:1/unreachable")
    children = [
        subprocess.Popen(
            [sys.executable, str(CHILD), *child_args(rank, world, db, store, tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env if rank == 0 else no_db,
            cwd=tmp_path,
        )
        for rank in range(world)
    ]
    outputs = []
    for process in children:
        try:
            text, _ = process.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for c in children:
                c.kill()
            raise
        outputs.append(text.decode(errors="replace"))
    failed = [
        f"rank {rank} exited {process.returncode}:\n{text[-5000:]}"
        for rank, (process, text) in enumerate(zip(children, outputs, strict=True))
        if process.returncode != 0
    ]
    assert not failed, "\n\n".join(failed)
    return [json.loads((tmp_path / f"observed{r}.json").read_text()) for r in range(world)]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_where_only_rank_0_has_a_database(tmp_path: Path) -> None:
    db, store = str(tmp_path / "manifest.db"), str(tmp_path / "store")
    with ckptstore.open_run(child.RUN, db=db, store=store) as run:
        ckpt_dcp.save(child.full(1), run, 1)  # one process; loaded below on two ranks

    rank0, rank1 = launch(tmp_path, db, store)

    # Rank 1 never opened a database; the probe is live (it saw rank 0's).
    assert rank1["opened"] == []
    assert rank0["opened"] != []
    assert not rank1["dot_ckptstore"]
    # Both ranks loaded the same checkpoint, described the same way.
    assert rank0["first"] == rank1["first"]
    assert rank0["first"][:2] == [child.RUN, 1]
    assert rank0["receipts"] == ["dcp/rank0", "dcp/rank1", "dcp/metadata"]
    assert rank1["receipts"] == []
    assert rank0["stale3"] == ["dcp/rank0", "dcp/rank1"]  # step 3 saved step 2's state
    # The handed-over plan of the damaged step 4 raised on both ranks, marking nothing; the
    # coordinated load marked it and both fell back to 3.
    for observed in (rank0, rank1):
        kind, text = observed["given_damaged"]
        assert kind in ("IntegrityError", "MissingBlobError"), text
        assert "step 4" in text
        assert observed["fallback_step"] == 3
    assert rank0["damaged"].split(":", 1)[1] in rank0["given_damaged"][1]
    assert rank0["statuses"] == {
        "1": "committed",
        "2": "committed",
        "3": "committed",
        "4": "corrupt",
    }
    # Configurations that cannot work raised on both ranks, naming the fix.
    assert rank1["no_store"][0] == rank0["no_store"][0] == "ConfigError"
    assert "pass store=" in rank1["no_store"][1]
    assert rank0["no_store"][1].startswith("on rank 1: ")
    for case, needle in [
        ("mixed", "passed a LoadPlan and ranks"),
        ("steps", "rank 1 asked for step 3 and rank 0 for step 2"),
        ("rank0_none", "rank 0 (or a single process) passed no run"),
        ("rank0_none_both", "pass it the Run"),
        ("different", "handed different LoadPlans (rank 0: ['dcp-dbfree', 3,"),
    ]:
        for observed in (rank0, rank1):
            assert observed[case][0] == "ConfigError", (case, observed[case])
            assert needle in observed[case][1], (case, observed[case])

    # Saved on two ranks, loaded in one process (2 -> 1): from the run and from a plan.
    with ckptstore.open_run(child.RUN, db=db, store=store, writable=False) as run:
        target = zeros()
        assert ckpt_dcp.load(target, run).step == 3
        assert_loaded(target, 2)
        steps = {c.step: c for c in run.checkpoints()}
        assert dcp_components(steps[3]) == dcp_components(steps[2])
        plan = ckpt_dcp.plan_load(run, 2)
    target = zeros()
    assert ckpt_dcp.load(target, plan).step == 2
    assert_loaded(target, 2)
