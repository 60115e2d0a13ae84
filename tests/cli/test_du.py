"""``ckptstore du``: logical, unique, stored and referenced bytes per run and in total, and the
dedup and compression figures ``runs`` reports too (one definition, stated in ``--help``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from populated import Populated, cli, cli_json
from sqlalchemy import select
from tiny_runs import Site

from ckptstore.cas import blob_key
from ckptstore.checkpointer import open_run
from ckptstore.cli import main
from ckptstore.cli.commands.du import STORED_OVER_LOGICAL
from ckptstore.manifest import Database
from ckptstore.manifest.models import BlobRow, CheckpointBlobRow, Status


def test_du(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    usage = cli_json(populated, capsys, "du")
    runs = {u["run"]: u for u in usage["runs"]}
    total = usage["total"]
    assert sorted(runs) == ["alpha", "beta"]

    db = Database(populated.db_url)
    try:
        with db.read() as session:
            blobs = {b.digest: b for b in session.scalars(select(BlobRow))}
            all_rows = sum(b.stored_bytes for b in blobs.values())
        per_run: dict[str, set[str]] = {}
        logical: dict[str, int] = {}
        referenced: dict[str, int] = {}
        for name in ("alpha", "beta"):
            with open_run(name, db=db, store=populated.root, writable=False) as run:
                committed = run.checkpoints([Status.COMMITTED])
                logical[name] = sum(c.logical_bytes for c in committed)
                per_run[name] = set()
                referenced[name] = 0
                with db.read() as session:
                    for c in committed:
                        refs = set(
                            session.scalars(
                                select(CheckpointBlobRow.digest).where(
                                    CheckpointBlobRow.checkpoint_id == c.id
                                )
                            )
                        )
                        per_run[name] |= refs
                        referenced[name] += sum(blobs[d].logical_bytes for d in refs)
    finally:
        db.close()

    def on_disk(digests: set[str]) -> int:
        return sum((populated.root / blob_key(d)).stat().st_size for d in digests)

    everything = per_run["alpha"] | per_run["beta"]
    for name, expected_count in (("alpha", 3), ("beta", 2)):
        u = runs[name]
        assert u["checkpoints"] == expected_count
        assert u["logical_bytes"] == logical[name]
        assert u["unique_bytes"] == sum(blobs[d].logical_bytes for d in per_run[name])
        assert u["stored_bytes"] == on_disk(per_run[name])
        assert u["referenced_bytes"] == referenced[name]
        assert u["dedup_ratio"] == pytest.approx(u["referenced_bytes"] / u["unique_bytes"])
        assert u["compression_ratio"] == pytest.approx(u["unique_bytes"] / u["stored_bytes"])
    assert total["run"] == "TOTAL"
    assert total["checkpoints"] == 5
    assert total["logical_bytes"] == logical["alpha"] + logical["beta"]
    assert total["unique_bytes"] == sum(blobs[d].logical_bytes for d in everything)
    assert total["stored_bytes"] == on_disk(everything)
    # The runs share the embedding: the total counts it once.
    assert total["unique_bytes"] < runs["alpha"]["unique_bytes"] + runs["beta"]["unique_bytes"]
    assert runs["alpha"]["dedup_ratio"] > 1  # the embedding is in all three checkpoints
    # Deleted checkpoints' blobs are still stored until a GC: counted in the rows' total only.
    assert usage["all_blob_rows_stored_bytes"] == all_rows > total["stored_bytes"]

    code, out, err = cli(populated, capsys, "du")
    assert (code, err) == (0, "")
    assert [line.split()[:2] for line in out.splitlines()[2:5]] == [
        ["alpha", "3"],
        ["beta", "2"],
        ["TOTAL", "5"],
    ]


def test_du_and_runs_agree_on_dedup_and_compression(
    tiny_site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    du = {u["run"]: u for u in cli_json(tiny_site, capsys, "du")["runs"]}
    runs = {r["run"]: r for r in cli_json(tiny_site, capsys, "runs")}
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
    for command in ("du", "runs"):
        code, table, err = cli(tiny_site, capsys, command)
        assert (code, err) == (0, "")
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


def test_du_explains_stored_over_logical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A tiny state is stored in more bytes than it holds (its index, headers): the note says
    # why for that run only; a run of zeros compresses to far below its logical bytes.
    site = Site(f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "store")
    with open_run("tiny", db=site.db_url, store=site.store, async_save=False) as run:
        run.save(1, {"w": torch.ones(3)})
    with open_run("zeros", db=site.db_url, store=site.store, async_save=False) as run:
        run.save(1, {"w": torch.zeros(2**18)})
    code, out, err = cli(site, capsys, "du")
    assert (code, err) == (0, "")
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert notes == [STORED_OVER_LOGICAL.format(runs="tiny")]
    usage = cli_json(site, capsys, "du")  # JSON has the figures, no prose
    assert "note" not in usage
