"""The command line as a whole, on the populated store (:mod:`populated`): the installed console
script (in subprocesses, started in parallel: each one imports torch), the exit codes every
command shares, and global options given after the subcommand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from populated import Populated, assert_one_line_error, cli, superuser_flag

from ckptstore.cli import main

CONSOLE = Path(sys.executable).parent / "ckptstore"


def console(pop: Populated, *commands: list[str]) -> list[tuple[int, str, str]]:
    """Run several commands through the installed console script, in parallel."""
    procs = [
        subprocess.Popen(
            [str(CONSOLE), *pop.base, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=pop.work,
        )
        for args in commands
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_console_entry_point(sql_store: Populated) -> None:
    """The installed ``ckptstore`` script: JSON and CSV on stdout, exit codes, errors on stderr."""
    runs, csv, unknown = console(
        sql_store,
        ["--json", "runs"],
        [
            "sql",
            "SELECT run, committed, latest_step FROM run_summary ORDER BY run",
            "--format",
            "csv",
            *superuser_flag(sql_store.db_url),
        ],
        ["ls", "no-such-run"],
    )
    code, out, err = runs
    assert (code, err) == (0, "")
    assert [(r["run"], r["committed"]) for r in json.loads(out)] == [("alpha", 3), ("beta", 2)]

    code, out, err = csv
    assert code == 0, err
    if superuser_flag(sql_store.db_url):  # one warning line says what the flag allows
        (warning,) = err.splitlines()
        assert "--allow-superuser" in warning
    else:
        assert err == ""
    assert out.splitlines() == ["run,committed,latest_step", "alpha,3,7", "beta,2,2"]

    code, out, err = unknown
    assert (code, out) == (3, "")
    assert_one_line_error(err, "'no-such-run'")


def test_error_exit_codes(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = str(populated.work / "out")
    unknown = [
        ["ls", "nope"],
        ["show", "nope"],
        ["show", "nope@1"],
        ["latest", "nope"],
        ["verify", "nope"],
        ["export", "nope@1", out_dir],
        ["plot", "nope", "--metric", "m", "-o", str(populated.work / "p.png")],
        ["show", "alpha@99"],
    ]
    for args in unknown:
        code, out, err = cli(populated, capsys, *args)
        assert (code, out) == (3, ""), args
        assert_one_line_error(err, "nope" if "nope" in args[1] else "99")
    bad_targets = [
        ["show", "alpha@x"],
        ["show", "@3"],
        ["verify", "alpha@-1"],
        ["export", "alpha@1.5", out_dir],
        ["export", "alpha", out_dir],  # export needs a step
    ]
    for args in bad_targets:
        code, out, err = cli(populated, capsys, *args)
        assert (code, out) == (2, ""), args
        assert_one_line_error(err)
    assert not Path(out_dir).exists()
    # argparse's own usage errors exit 2 as well.
    for args in (["ls"], ["frobnicate"], ["gc", "--grace", "soon"], ["gc", "--grace=-5s"]):
        with pytest.raises(SystemExit) as exc:
            main([*populated.base, *args])
        assert exc.value.code == 2, args


def test_json_flag_after_the_subcommand(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(populated, capsys, "show", "alpha", "--entries", "--json")
    assert code == 0, err
    assert json.loads(out)["step"] == 7
