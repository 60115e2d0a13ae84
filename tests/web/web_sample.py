"""The web tests' sample store, and a way to ask a server over it (conftest.py has the
fixtures that build both): a store with the history a checkpoint view must show.

Built once per session through the real APIs (``open_run``, ``save``, a DCP save, ``verify``):

- ``base``: eight periodic saves under retention (top 2 by ``train:loss``, every 4th step,
  the latest), a failed save (the store refused the upload), step 3 corrupt (a flipped byte
  found by ``verify``, its blob quarantined); its config holds a tracker URL and the policy;
- ``child``: forked from ``base@8``, two saves that reuse the unchanged embedding;
- ``dcp``: two torch DCP saves (metadata + rank component);
- a run named ``<script>alert(1)</script>`` with hostile entry and metric names, and one whose
  name holds an ESC (renamed in SQL: ``open_run`` refuses such names, a hostile database need
  not);
- ``live``: one save; the browser test adds more while its page is open.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from component_helpers import FlakyStore
from sqlalchemy import create_engine, text

from ckptstore.cas import WriterOptions
from ckptstore.cas.digest import blob_key, digest_bytes
from ckptstore.checkpointer import RetentionPolicy, open_run
from ckptstore.errors import SaveError
from ckptstore.maintenance import verify
from ckptstore.manifest import Database
from ckptstore.web.server import Server

HOSTILE = "<script>alert(1)</script>"
HOSTILE_ENTRY = "<img src=x onerror=alert(2)>"
HOSTILE_METRIC = "<b>loss</b>"
ESCAPED = "esc\x1b[31mred"
LOSS = {1: 0.9, 2: 0.7, 3: 0.2, 4: 0.6, 5: 0.5, 6: 0.3, 7: 0.55, 8: 0.4}
RETENTION = {"keep_top_k": 2, "keep_every_n_steps": 4, "rank_triggers": ["period"]}
TRACKER = "https://tracker.example/runs/base"
EMBED = torch.arange(256, dtype=torch.float32)


def weights(step: int) -> torch.Tensor:
    """``base``'s changing tensor at ``step`` (its own chunk: packs are off)."""
    return torch.full((64,), float(step))


@dataclass
class Sample:
    """The sample store and what tests look up in it."""

    db: str
    store: str
    ids: dict[tuple[str, int], int] = field(default_factory=dict)


def build(root: Path) -> Sample:
    """Build the sample store under ``root``."""
    sample = Sample(str(root / "manifest.db"), str(root / "store"))
    store = FlakyStore(Path(sample.store))
    retention = RetentionPolicy(
        keep_top_k=2,
        keep_every_n_steps=4,
        metric_name="train:loss",
        higher_is_better=False,
        rank_triggers={"period"},
    )
    config = {"tracker_url": TRACKER, "retention": RETENTION, "lr": 0.01}
    # pack_threshold=0: every tensor its own chunk, so a comparison can prove a change.
    options = WriterOptions(pack_threshold=0)
    with open_run(
        "base", db=sample.db, store=store, retention=retention, config=config,
        writer_options=options, async_save=False,
    ) as run:  # fmt: skip
        for step, loss in LOSS.items():
            info = run.save(
                step,
                {"policy": {"embed": EMBED, "w": weights(step)}, "optimizer": {"step": step}},
                training_info={"current_step": step},
                metrics={"train:loss": loss, "train:reward": 1 - loss},
                trigger="period",
                kinds={"policy": "policy", "optimizer": "optimizer"},
            ).wait()
            sample.ids["base", step] = info.id
        store.failing = True
        with pytest.raises(SaveError):
            run.save(9, {"policy": {"embed": EMBED, "w": weights(9)}}, trigger="period").wait()
        store.failing = False
    with open_run(
        "child", db=sample.db, store=sample.store, fork_from="base@8", writer_options=options,
        async_save=False,
    ) as run:  # fmt: skip
        for step in (9, 10):
            info = run.save(
                step, {"policy": {"embed": EMBED, "w": weights(step)}}, metrics={"train:loss": 0.1}
            ).wait()
            sample.ids["child", step] = info.id
    _dcp_run(sample)
    with open_run(HOSTILE, db=sample.db, store=sample.store, async_save=False) as run:
        state = {"policy": {HOSTILE_ENTRY: torch.ones(2)}}
        sample.ids[HOSTILE, 1] = run.save(1, state, metrics={HOSTILE_METRIC: 1.0}).wait().id
    with open_run("esc-run", db=sample.db, store=sample.store, async_save=False) as run:
        sample.ids[ESCAPED, 1] = run.save(1, {"m": torch.ones(1)}).wait().id
    with open_run("live", db=sample.db, store=sample.store, async_save=False) as run:
        sample.ids["live", 1] = run.save(1, {"m": torch.ones(1)}, metrics={"loss": 1.0}).wait().id
    engine = create_engine(f"sqlite:///{sample.db}")
    with engine.begin() as conn:
        conn.execute(text("UPDATE runs SET name = :new WHERE name = 'esc-run'"), {"new": ESCAPED})
    engine.dispose()
    _corrupt_step_3(sample)
    return sample


def _dcp_run(sample: Sample) -> None:
    from ckptstore.integrations import dcp as ckpt_dcp

    with open_run("dcp", db=sample.db, store=sample.store) as run:
        for step in (1, 2):
            state = {
                "model": {"weight": torch.full((8, 4), float(step)), "bias": torch.zeros(4)},
                "epoch": step,
            }
            info = ckpt_dcp.save(state, run, step)
            sample.ids["dcp", step] = info.id


def _corrupt_step_3(sample: Sample) -> None:
    """Flip a byte of step 3's own chunk; ``verify`` marks it corrupt and quarantines it."""
    path = Path(sample.store) / blob_key(digest_bytes(weights(3).numpy().tobytes()))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    db = Database(sample.db, create=False)
    try:
        with FlakyStore(Path(sample.store)) as store:
            report = verify(db, store, run="base", step=3)
    finally:
        db.close()
    assert report.marked == [("base", 3)], report


@dataclass
class Served:
    """A running server over the sample and a way to ask it."""

    server: Server
    sample: Sample

    @property
    def url(self) -> str:
        return self.server.url.rstrip("/")

    def get(
        self, path: str, *, method: str = "GET", headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) of one request; errors are answers too."""
        request = urllib.request.Request(self.url + path, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()
