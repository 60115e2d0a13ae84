"""``ckptstore latest RUN``: the newest committed step."""

from __future__ import annotations

import pytest
from populated import Populated, assert_one_line_error, cli, cli_json

from ckptstore.checkpointer import open_run


def test_latest(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(populated, capsys, "latest", "alpha") == (0, "7\n", "")
    record = cli_json(populated, capsys, "latest", "beta")
    assert (record["run"], record["step"]) == ("beta", 2)
    assert record["committed_at"]

    # A run without any committed checkpoint.
    with open_run("empty", db=populated.db_url, store=populated.root):
        pass
    code, out, err = cli(populated, capsys, "latest", "empty")
    assert (code, out) == (3, "")
    assert_one_line_error(err, "'empty'", "no committed checkpoint")
