"""``ckptstore ls RUN``: a run's checkpoints, deleted ones only with ``--all``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from populated import ALPHA_REWARDS, ALPHA_STATUS, Populated, cli, cli_json
from tiny_runs import Site

from ckptstore.checkpointer import open_run
from ckptstore.cli.output import METRICS_WIDTH, compact_metrics


def test_ls(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    visible = cli_json(populated, capsys, "ls", "alpha")
    assert [(r["step"], r["status"]) for r in visible] == [
        (s, st) for s, st in ALPHA_STATUS.items() if st != "deleted"
    ]
    everything = cli_json(populated, capsys, "ls", "alpha", "--all")
    assert [(r["step"], r["status"]) for r in everything] == list(ALPHA_STATUS.items())
    assert {r["step"]: r["metrics"] for r in everything if r["step"] != 5} == {
        s: {"train:reward": r} for s, r in ALPHA_REWARDS.items() if r is not None
    }
    assert {r["trigger"] for r in everything} == {"period"}

    code, out, err = cli(populated, capsys, "ls", "alpha", "--all")
    assert (code, err) == (0, "")
    rows = [line.split()[:2] for line in out.splitlines()[2:]]
    assert rows == [[str(s), st] for s, st in ALPHA_STATUS.items()]
    code, out, _ = cli(populated, capsys, "ls", "alpha")
    assert "deleted" not in out
    assert "failed" in out


def test_ls_shows_metrics_compactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Full float precision made 273-character lines: a table shows 4 significant digits and
    # cuts the cell at METRICS_WIDTH; --json keeps every value as stored.
    site = Site(f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "store")
    metrics = {
        "loss": 0.123456789012,
        "train:reward": 3.14159265358979,
        "kl": 0.000123456789,
        "tokens": 1234567,
        **{f"eval:task_{i}:accuracy": 0.987654321 for i in range(8)},
    }
    with open_run("m", db=site.db_url, store=site.store, async_save=False) as run:
        run.save(1, {"w": torch.ones(2)}, metrics=metrics)
    code, out, err = cli(site, capsys, "ls", "m")
    assert (code, err) == (0, "")
    row = out.splitlines()[2]
    cell = row[row.index("loss=") :]
    assert cell.startswith("loss=0.1235 train:reward=3.142 kl=0.0001235 tokens=")
    assert len(cell) == METRICS_WIDTH
    assert cell.endswith("...")
    assert max(len(line) for line in out.splitlines()) < 160
    (listed,) = cli_json(site, capsys, "ls", "m")
    assert listed["metrics"] == metrics


def test_compact_metrics() -> None:
    assert compact_metrics(None) == "-"
    assert compact_metrics({}) == "-"
    assert compact_metrics({"ok": True, "n": 3, "tag": "best", "v": [1, 2]}) == (
        "ok=true n=3 tag=best v=[1,2]"
    )
    assert compact_metrics({"a": 1 / 3}, width=8) == "a=0.3333"
    assert compact_metrics({"a": 1 / 3, "b": 2.0}, width=10) == "a=0.333..."
