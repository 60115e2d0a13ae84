"""``ckptstore show RUN[@STEP]``: one checkpoint's record, its entries with ``--entries``."""

from __future__ import annotations

import re

import pytest
import torch
from populated import Populated, alpha_state, assert_one_line_error, cli, cli_json, flatten


def test_show(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    record = cli_json(populated, capsys, "show", "alpha@4")
    assert (record["run"], record["step"], record["status"], record["trigger"]) == (
        "alpha",
        4,
        "committed",
        "period",
    )
    assert record["metrics"] == {"train:reward": 0.9}
    assert record["training_info"] == {"current_step": 4}
    comps = {c["name"]: c for c in record["components"]}
    assert sorted(comps) == ["optimizer", "policy"]
    assert comps["policy"]["entries"] == len(flatten(alpha_state(4)["policy"]))
    assert comps["policy"]["index_digest"].startswith("b3:")
    assert record["logical_bytes"] == sum(c["logical_bytes"] for c in comps.values())
    assert "entries" not in record

    # Without a step: the newest committed checkpoint; --entries reads every index.
    record = cli_json(populated, capsys, "show", "alpha", "--entries")
    assert record["step"] == 7
    for name in ("policy", "optimizer"):
        expected = flatten(alpha_state(7)[name])
        entries = {e["path"]: e for e in record["entries"][name]}
        assert list(entries) == list(expected)
        for path, value in expected.items():
            entry = entries[path]
            if isinstance(value, torch.Tensor):
                assert entry["kind"] == "tensor"
                assert entry["shape"] == list(value.shape)
                assert entry["nbytes"] == value.nbytes
                assert entry["dtype"] == str(value.dtype).removeprefix("torch.")
            else:
                assert (entry["kind"], entry["value"]) == ("json", value)

    code, out, err = cli(populated, capsys, "show", "beta@1", "--entries")
    assert (code, err) == (0, "")
    assert re.search(r"^\s+step: 1$", out, re.M)
    assert re.search(r"^\s+status: committed$", out, re.M)
    assert "policy/rank0:" in out
    assert "policy/rank1:" in out

    # A step that retention deleted, or that failed, is not shown as a checkpoint.
    for target, status in (("alpha@3", "deleted"), ("alpha@5", "failed")):
        code, out, err = cli(populated, capsys, "show", target)
        assert (code, out) == (3, "")
        assert_one_line_error(err, status)
