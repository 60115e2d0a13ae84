"""``ckptstore db current|upgrade``: the manifest's schema revision."""

from __future__ import annotations

import pytest
from populated import Populated, cli, cli_json

from ckptstore.manifest import head_revision


def test_db_current_and_upgrade(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(populated, capsys, "db", "current")
    assert (code, err) == (0, "")
    assert "up to date" in out
    assert head_revision() in out
    record = cli_json(populated, capsys, "db", "current")
    assert (record["current"], record["head"], record["state"]) == (
        head_revision(),
        head_revision(),
        "up to date",
    )
    record = cli_json(populated, capsys, "db", "upgrade")
    assert (record["changed"], record["to"]) == (False, head_revision())
