"""Small real runs for the first-contact CLI tests: a SQLite or PostgreSQL manifest (``db_url``)
over a LocalStore, filled through ``open_run(...).save(...)`` as a user fills one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ckptstore.checkpointer import open_run
from ckptstore.objectstore import LocalStore


@dataclass(frozen=True)
class Site:
    db_url: str
    store: Path

    @property
    def base(self) -> list[str]:
        """``--db ... --store ...`` for this site."""
        return ["--db", self.db_url, "--store", str(self.store)]


def make_site(db_url: str, tmp_path: Path) -> Site:
    """Run ``single`` (one checkpoint) and run ``shared`` (three checkpoints that share their
    large tensor, each with small values of its own)."""
    root = tmp_path / "store"
    store = LocalStore(root, fsync=False)
    try:
        with open_run("single", db=db_url, store=store, async_save=False) as run:
            run.save(1, {"policy": {"w": torch.arange(4096.0), "b": torch.ones(3)}})
        big = torch.linspace(0, 1, 2**19)  # 2 MiB: a chunk of its own (1 MiB packs)
        with open_run("shared", db=db_url, store=store, async_save=False) as run:
            for step in (1, 2, 3):
                state = {"w": big, "step": torch.tensor([step]), "note": f"step {step}"}
                run.save(step, {"policy": state}, metrics={"loss": 1.0 / step})
    finally:
        store.close()
    return Site(db_url, root)
