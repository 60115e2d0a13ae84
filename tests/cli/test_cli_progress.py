"""Progress on long commands: a tqdm bar on stderr, never on stdout. On a terminal by default;
anywhere with ``--progress`` or ``-v`` (which also logs each phase and the total at INFO);
never with ``--json``, whose stdout stays one JSON document and whose stderr gets no bar."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from populated import Populated, cli

from ckptstore.cli import output


@pytest.fixture(autouse=True)
def _default_mode() -> None:
    # main sets the switch for each command; a test that builds bars itself starts from the
    # default (and leaves it there).
    output.show_progress(None)


def test_progress_forces_a_bar_on_a_pipe(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(populated, capsys, "--progress", "verify")
    assert code == 0, err
    assert "verify: blobs:" in err
    assert "100%" in err
    assert "blob/s" in err
    assert "verify: blobs" not in out  # the report alone on stdout
    assert out.strip().splitlines()[-1].startswith("verified ")


def test_progress_after_the_command_too(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(populated, capsys, "gc", "--dry-run", "--progress")
    assert code == 0, err
    for phase in ("gc: mark", "gc: sweep", "gc: orphans (store objects listed)"):
        assert phase in err


def test_no_bar_on_a_pipe_by_default(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(populated, capsys, "verify")
    assert (code, err) == (0, "")


@pytest.mark.parametrize("flag", ["--progress", "-v"])
def test_json_output_has_no_bar(
    populated: Populated, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    code, out, err = cli(populated, capsys, "--json", flag, "verify")
    assert code == 0, err
    assert json.loads(out)["blobs_checked"] > 0  # stdout: one JSON document, nothing else
    assert "%|" not in err
    assert "blob/s" not in err


def test_verbose_logs_phases_and_shows_the_bar(populated: Populated, tmp_path: Path) -> None:
    # In a process of its own: logging is configured once per process.
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore", *populated.base, "gc", "--dry-run", "-v"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "CKPTSTORE_LOCAL_DIR": ""},
    )
    assert done.returncode == 0, done.stderr
    assert "INFO ckptstore.cli: gc: mark (blobs condemned)" in done.stderr
    assert re.search(r"INFO ckptstore.cli: gc: [0-9]+ item in [0-9.]+s", done.stderr)
    assert "gc: orphans (store objects listed):" in done.stderr  # the bar, on a pipe
    assert done.stdout.startswith("gc (dry run, grace ")


def test_a_bar_is_silent_on_a_pipe_unless_forced(capsys: pytest.CaptureFixture[str]) -> None:
    with output.progress(3, "work", "step", enabled=True) as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""
    output.show_progress(True)
    with output.progress(3, "work", "step", enabled=True) as bar:
        bar.update(3)
    assert "work: 100%" in capsys.readouterr().err
    # The caller's own switch (not --json) still wins: the hf commands pass not args.json.
    with output.progress(3, "work", "step", enabled=False) as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""
    output.show_progress(False)
    with output.progress(3, "work", "step", enabled=True) as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""


def test_drain_shows_the_bytes_it_uploads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from ckptstore import TierConfig, open_run
    from ckptstore.cli.main import main

    db, store, tier = tmp_path / "m.db", tmp_path / "store", tmp_path / "tier"
    with open_run(
        "r", db=db, store=store, tiers=TierConfig(local_dir=str(tier)), async_save=False
    ) as run:
        run.save(1, {"w": torch.randn(1 << 16)})  # local-durable: the tiers only
    capsys.readouterr()
    code = main(["--db", str(db), "--store", str(store), "--progress", "drain", "r@1",
                 "--local-dir", str(tier)])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "remote-durable" in out
    assert "drain" in err
    assert re.search(r"\d+(\.\d+)?[kMG]?B", err), err  # the bar counts bytes

    with open_run(
        "r", db=db, store=store, tiers=TierConfig(local_dir=str(tier)), async_save=False
    ) as run:
        run.save(2, {"w": torch.randn(1 << 16)})
        seen: list[int] = []
        report = run.drain(2, progress=seen.append)
    assert report is not None
    assert report.drained
    assert seen
    assert sum(seen) == report.uploaded_bytes


def test_import_names_its_storing_phase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from safetensors.torch import save_file

    from ckptstore.cli.main import main

    save_file({"w": torch.randn(1 << 16)}, str(tmp_path / "model.safetensors"))
    capsys.readouterr()
    code = main(["--db", str(tmp_path / "m.db"), "--store", str(tmp_path / "store"),
                 "--progress", "import", str(tmp_path / "model.safetensors"), "r@1"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "import: storing" in err  # the bar's label once the source is read
    assert "import: storing" not in out
