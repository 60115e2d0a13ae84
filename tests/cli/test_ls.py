"""``ckptstore ls RUN``: a run's checkpoints, deleted ones only with ``--all``."""

from __future__ import annotations

import pytest
from populated import ALPHA_REWARDS, ALPHA_STATUS, Populated, cli, cli_json


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
