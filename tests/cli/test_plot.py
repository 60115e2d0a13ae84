"""``ckptstore plot RUN --metric M -o FILE``: a PNG of a metric over the run's checkpoints."""

from __future__ import annotations

import pytest
from populated import Populated, assert_one_line_error, cli, cli_json

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    png = populated.work / "reward.png"
    code, out, err = cli(
        populated, capsys, "plot", "alpha", "--metric", "train:reward", "-o", str(png)
    )
    assert (code, out, err) == (0, f"{png}\n", "")
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000
    # Committed and deleted checkpoints with the metric; the failed save has none.
    record = cli_json(
        populated, capsys, "plot", "alpha", "--metric", "train:reward", "-o", str(png)
    )
    assert record == {"file": str(png), "points": 6}

    nothing = populated.work / "nothing.png"
    code, out, err = cli(
        populated, capsys, "plot", "beta", "--metric", "train:reward", "-o", str(nothing)
    )
    assert (code, out) == (3, "")
    assert_one_line_error(err, "'beta'", "train:reward")
    assert not nothing.exists()
