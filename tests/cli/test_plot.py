"""``ckptstore plot RUN --metric M -o FILE``: a PNG of a metric over the run's checkpoints."""

from __future__ import annotations

import subprocess
import sys

import pytest
from populated import Populated, assert_one_line_error, cli, cli_json

from ckptstore.cli.commands.plot import _draw
from ckptstore.manifest.reporting import MetricPoint

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
    assert_one_line_error(err, "'beta'", "train:reward", "record no numeric metric")
    assert not nothing.exists()


def test_an_unknown_metric_names_those_that_exist(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    png = populated.work / "typo.png"
    code, out, err = cli(populated, capsys, "plot", "alpha", "--metric", "reward", "-o", str(png))
    assert (code, out) == (3, "")
    assert_one_line_error(err, "metric 'reward'; its metrics: train:reward")


def test_step_ticks_are_whole_numbers() -> None:
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    points = [MetricPoint(step, 1.0 / step, "committed") for step in (1, 2, 3)]
    _draw(ax, points, "loss")
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks
    assert all(t == int(t) for t in ticks), ticks


def test_plot_imports_no_torch(populated: Populated) -> None:
    # A read command: the manifest and matplotlib, never torch (README's promise).
    probe = (
        "import contextlib, io, sys\n"
        "from ckptstore.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    code = main(sys.argv[1:])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    png = populated.work / "probe.png"
    args = [*populated.base, "plot", "alpha", "--metric", "train:reward", "-o", str(png)]
    done = subprocess.run(
        [sys.executable, "-c", probe, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout.split() == ["0", "False"], done.stderr
