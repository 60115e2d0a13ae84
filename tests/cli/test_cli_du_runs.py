"""``du`` and ``runs`` report one dedup and one compression figure for the same run (the
definition their ``--help`` states), and ``runs`` counts corrupt checkpoints.

The reported mismatch: ``du`` divided logical bytes (tensor data) by unique bytes (every blob,
indexes included), so a run of one checkpoint showed 0.93x dedup where ``runs`` said 1.00x.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from tiny_runs import Site, make_site

from ckptstore.cli import main


@pytest.fixture
def site(db_url: str, tmp_path: Path) -> Site:
    return make_site(db_url, tmp_path)


def cli(site: Site, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main([*site.base, *args])
    out, err = capsys.readouterr()
    assert err == "", err
    return code, out


def as_json(site: Site, capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    code, out = cli(site, capsys, "--json", *args)
    assert code == 0
    return json.loads(out)


def test_du_and_runs_agree_on_dedup_and_compression(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    du = {u["run"]: u for u in as_json(site, capsys, "du")["runs"]}
    runs = {r["run"]: r for r in as_json(site, capsys, "runs")}
    for name in ("single", "shared"):
        assert runs[name]["dedup_ratio"] == pytest.approx(du[name]["dedup_ratio"]), name
        assert runs[name]["compression_ratio"] == pytest.approx(du[name]["compression_ratio"])
        assert runs[name]["logical_bytes"] == du[name]["logical_bytes"]
        assert runs[name]["stored_bytes"] == du[name]["stored_bytes"]
    # One checkpoint shares nothing: exactly 1, though its index blobs hold no tensor data.
    single = du["single"]
    assert single["unique_bytes"] > single["logical_bytes"]
    assert single["dedup_ratio"] == 1.0
    # Three checkpoints reference the large tensor's blob; it is stored once.
    shared = du["shared"]
    assert shared["referenced_bytes"] > shared["unique_bytes"] > shared["logical_bytes"] / 3
    assert shared["dedup_ratio"] == pytest.approx(
        shared["referenced_bytes"] / shared["unique_bytes"]
    )
    assert 2 < shared["dedup_ratio"] < 3

    # The text tables show the same figures.
    _, du_text = cli(site, capsys, "du")
    _, runs_text = cli(site, capsys, "runs")
    for table in (du_text, runs_text):
        rows = {line.split()[0]: line for line in table.splitlines()[2:] if line.strip()}
        assert f"{shared['dedup_ratio']:.2f}x" in rows["shared"], table
        assert "1.00x" in rows["single"], table


@pytest.mark.parametrize("command", ["du", "runs"])
def test_du_and_runs_help_states_the_definition(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "dedup = referenced / unique" in shown
    assert "compression = unique / stored" in shown


def test_runs_counts_corrupt_checkpoints(site: Site, capsys: pytest.CaptureFixture[str]) -> None:
    engine = create_engine(site.db_url)
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
    runs = {r["run"]: r for r in as_json(site, capsys, "runs")}
    assert (runs["shared"]["corrupt"], runs["shared"]["committed"]) == (2, 1)
    assert runs["single"]["corrupt"] == 0

    _, out = cli(site, capsys, "runs")
    header, _rule, *rows = out.splitlines()
    column = header.split().index("corrupt")
    assert {row.split()[0]: row.split()[column] for row in rows} == {"shared": "2", "single": "0"}
