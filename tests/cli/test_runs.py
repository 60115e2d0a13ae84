"""``ckptstore runs``: one row per run with its counts, latest step, best metric and ratios."""

from __future__ import annotations

import pytest
from populated import Populated, cli, cli_json
from sqlalchemy import create_engine, text
from tiny_runs import Site


def test_runs(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    rows = {r["run"]: r for r in cli_json(populated, capsys, "runs")}
    assert sorted(rows) == ["alpha", "beta"]
    alpha, beta = rows["alpha"], rows["beta"]
    assert (alpha["checkpoints"], alpha["committed"], alpha["failed"]) == (7, 3, 1)
    assert (alpha["corrupt"], beta["corrupt"]) == (0, 0)
    # Steps 1, 3 and 6 of alpha were deleted by retention (keep the best two and the latest).
    assert (alpha["deleted"], beta["deleted"]) == (3, 0)
    assert (alpha["latest_step"], alpha["metric_name"], alpha["best_metric"]) == (
        7,
        "train:reward",
        0.9,
    )
    assert (beta["checkpoints"], beta["committed"], beta["failed"], beta["latest_step"]) == (
        2,
        2,
        0,
        2,
    )

    code, out, err = cli(populated, capsys, "runs")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    head = ["run", "ckpts", "committed", "failed", "corrupt", "deleted", "latest"]
    assert lines[0].split()[:7] == head
    assert lines[2].split()[:7] == ["alpha", "7", "3", "1", "0", "3", "7"]
    assert lines[3].split()[:7] == ["beta", "2", "2", "0", "0", "0", "2"]


def test_runs_counts_corrupt_checkpoints(
    tiny_site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = create_engine(tiny_site.db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE checkpoints SET status = 'corrupt', error = 'digest mismatch' "
                    "WHERE step IN (1, 2) AND run_id = (SELECT id FROM runs WHERE name = 'shared')"
                )
            )
    finally:
        engine.dispose()
    runs = {r["run"]: r for r in cli_json(tiny_site, capsys, "runs")}
    assert (runs["shared"]["corrupt"], runs["shared"]["committed"]) == (2, 1)
    assert runs["single"]["corrupt"] == 0

    code, out, err = cli(tiny_site, capsys, "runs")
    assert (code, err) == (0, "")
    header, _rule, *rows = out.splitlines()
    column = header.split().index("corrupt")
    assert {row.split()[0]: row.split()[column] for row in rows} == {"shared": "2", "single": "0"}
