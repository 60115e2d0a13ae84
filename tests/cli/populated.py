"""The populated store most command tests read, and how they run a command in-process.

A store is populated through ``open_run(...).save(...)``: run ``alpha`` saves steps 1-7 with a
reward each, retention keeps the best two by reward plus the latest, and step 5's save fails
(the store refuses writes); run ``beta`` saves two steps of two shard components. Both runs hold
the same embedding tensor, so they share one blob. The manifest is SQLite or PostgreSQL
(``db_url``) over a real LocalStore.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch
from sqlalchemy import select

from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer import RetentionPolicy, open_run
from ckptstore.cli import main
from ckptstore.errors import ObjectStoreError, SaveError
from ckptstore.manifest import Database
from ckptstore.manifest.models import CheckpointBlobRow, CheckpointRow, Status
from ckptstore.objectstore import LocalStore, PutData
from ckptstore.serialize.compare import first_difference

#: Tensors of 1 KiB and more get chunk blobs of their own (so small states still dedup).
OPTIONS = WriterOptions(pack_threshold=1024)
#: alpha's reward per step; None: the save fails (the store refuses writes).
ALPHA_REWARDS: dict[int, float | None] = {1: 0.1, 2: 0.5, 3: 0.3, 4: 0.9, 5: None, 6: 0.2, 7: 0.4}
#: keep_top_k=2 by reward plus the latest: what each step ends as.
ALPHA_STATUS = {
    1: "deleted",
    2: "committed",
    3: "deleted",
    4: "committed",
    5: "failed",
    6: "deleted",
    7: "committed",
}


# -- states ----------------------------------------------------------------------------------------


def randn(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A reproducible normal tensor."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


EMBED = randn(7, 32, 64)  # in every checkpoint of both runs: one blob


def alpha_state(step: int) -> dict[str, Any]:
    """Run alpha's state at ``step``: nested policy and optimizer, JSON values among tensors."""
    return {
        "policy": {
            "embed": EMBED,
            "layers": [{"w": randn(100 + step, 32, 32), "b": randn(200 + step, 32)}],
            "norm": randn(300 + step, 64, dtype=torch.bfloat16),
            "mask": torch.arange(16) % (step + 1) == 0,
        },
        "optimizer": {
            "step": torch.tensor(step),
            "exp_avg": randn(400 + step, 32, 32),
            "param_groups": [{"lr": 1e-3 / step, "betas": [0.9, 0.95], "name": "adamw"}],
        },
    }


def beta_state(step: int) -> dict[str, Any]:
    """Run beta's state at ``step``: two shard components with nested names."""
    return {
        "policy/rank0": {"embed": EMBED, "w": randn(500 + step, 16, 32)},
        "policy/rank1": {"w": randn(600 + step, 16, 32), "half": randn(700, 8, dtype=torch.half)},
    }


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """Entry path -> leaf, the way ckptstore names entries (keys here hold no '/' or '%')."""
    if isinstance(state, dict):
        items: Any = state.items()
    elif isinstance(state, list):
        items = enumerate(state)
    else:
        return {prefix: state}
    flat: dict[str, Any] = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}/{key}" if prefix else str(key)))
    return flat


def assert_same(actual: Any, expected: Any) -> None:
    """Bit-exact, containers included."""
    diff = first_difference(actual, expected)
    assert diff is None, diff


def assert_components(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Components bit-exact (a load returns components in name order, not save order)."""
    assert sorted(actual) == sorted(expected)
    for name, state in expected.items():
        diff = first_difference(actual[name], state, name)
        assert diff is None, diff


# -- the populated store ---------------------------------------------------------------------------


class FlakyStore(LocalStore):
    """A real LocalStore whose writes fail while ``failing`` is set."""

    failing = False

    def put(self, key: str, data: PutData) -> bool:
        if self.failing:
            raise ObjectStoreError(f"injected failure writing {self.url}/{key}")
        return super().put(key, data)


@dataclass
class Populated:
    """Where the populated store lives and what it holds."""

    db_url: str
    root: Path
    work: Path  # a scratch directory for outputs, outside the store
    states: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)

    @property
    def base(self) -> list[str]:
        """``--db ... --store ...`` for this store."""
        return ["--db", self.db_url, "--store", str(self.root)]

    def committed(self) -> list[tuple[str, int]]:
        """(run, step) of every checkpoint still committed."""
        return sorted(
            (run, step)
            for run, step in self.states
            if run == "beta" or ALPHA_STATUS[step] == "committed"
        )


def populate(db_url: str, root: Path, work: Path) -> Populated:
    """Save runs alpha and beta into a new store under ``root``."""
    pop = Populated(db_url, root, work)
    store = FlakyStore(root, fsync=False)
    retention = RetentionPolicy(keep_top_k=2, metric_name="train:reward")
    with open_run(
        "alpha",
        db=db_url,
        store=store,
        retention=retention,
        writer_options=OPTIONS,
        async_save=False,
        config={"model": "tiny"},
    ) as run:
        for step, reward in ALPHA_REWARDS.items():
            store.failing = reward is None
            try:
                run.save(
                    step,
                    alpha_state(step),
                    metrics={"train:reward": reward} if reward is not None else None,
                    training_info={"current_step": step},
                    trigger="period",
                )
            except SaveError:
                assert reward is None
            else:
                assert reward is not None
                pop.states["alpha", step] = alpha_state(step)
            finally:
                store.failing = False
        assert {c.step: c.status for c in run.checkpoints()} == ALPHA_STATUS
    with open_run("beta", db=db_url, store=store, writer_options=OPTIONS) as run:
        for step in (1, 2):
            run.save(step, beta_state(step)).wait()
            pop.states["beta", step] = beta_state(step)
    store.close()
    return pop


def committed_references(db: Database) -> set[str]:
    """Digests of every blob a committed checkpoint references."""
    with db.read() as session:
        return set(
            session.scalars(
                select(CheckpointBlobRow.digest)
                .join(CheckpointRow, CheckpointRow.id == CheckpointBlobRow.checkpoint_id)
                .where(CheckpointRow.status == Status.COMMITTED)
            )
        )


# -- running a command -----------------------------------------------------------------------------


class Site(Protocol):
    """A manifest and a store: anything that names its ``--db`` and ``--store``."""

    @property
    def base(self) -> list[str]: ...


def cli(site: Site, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``ckptstore --db ... --store ... ARGS`` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main([*site.base, *args])
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(site: Site, capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    """``ckptstore --json ARGS``, which must succeed: its parsed output."""
    code, out, err = cli(site, capsys, "--json", *args)
    assert (code, err) == (0, ""), err
    return json.loads(out)


def assert_one_line_error(err: str, *needles: str) -> None:
    """``err`` is one ``ckptstore: error:`` line holding every needle."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckptstore: error: "), err
    for needle in needles:
        assert needle in lines[0], err


def superuser_flag(db_url: str) -> list[str]:
    """The tests connect to PostgreSQL as its superuser, which `sql` refuses unless told."""
    return [] if db_url.startswith("sqlite") else ["--allow-superuser"]
