"""With ``--json``, a failing command still prints one line on stderr and exits with its code, and
also prints ``{"error": {"type", "message", "exit_code"}}`` on stdout, so a script that parses
stdout learns what went wrong; without ``--json`` stdout stays empty."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_runs import Site, make_site

from ckptstore.cli import main


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    """One site for the module: nothing here writes to it."""
    root = tmp_path_factory.mktemp("json-errors")
    return make_site(f"sqlite:///{root / 'manifest.db'}", root)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``ckptstore ARGV`` in-process, argparse's exits included: (code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "code", "kind", "needle"),
    [
        (["ls", "nope"], 3, "CheckpointNotFoundError", "'nope'"),
        (["show", "shared@99"], 3, "CheckpointNotFoundError", "99"),
        (["latest", "nope"], 3, "CheckpointNotFoundError", "'nope'"),
        (["show", "shared@x"], 2, "ConfigError", "RUN@STEP"),
        (["sql", "DELETE FROM runs"], 2, "ConfigError", "got DELETE"),
        (["sql", "SELECT no_such_column FROM runs"], 3, "DatabaseError", "no_such_column"),
        (["ls"], 2, "UsageError", "required: run"),
        (["frobnicate"], 2, "UsageError", "invalid choice"),
        (["gc", "--grace", "soon"], 2, "UsageError", "--grace"),
    ],
)
@pytest.mark.parametrize("where", ["before", "after"])
def test_errors_as_json(
    site: Site,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    code: int,
    kind: str,
    needle: str,
    where: str,
) -> None:
    flagged = ["--json", *argv] if where == "before" else [*argv, "--json"]
    got, out, err = run(capsys, *site.base, *flagged)
    assert got == code
    error = json.loads(out)["error"]
    assert (error["type"], error["exit_code"]) == (kind, code)
    assert needle in error["message"]
    assert needle in err.splitlines()[-1]  # the line on stderr stays
    # Without --json, nothing on stdout.
    assert run(capsys, *site.base, *argv)[:2] == (code, "")


def test_a_missing_database_is_a_json_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere.db"
    code, out, err = run(capsys, "--db", str(missing), "--json", "runs")
    assert code == 2
    error = json.loads(out)["error"]
    assert error["type"] == "ConfigError"
    assert str(missing) in error["message"]
    assert err.startswith("ckptstore: error: ")
    assert not missing.exists()


def test_json_error_messages_are_escaped_like_the_line(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, *site.base, "--json", "ls", "evil\x1b[31m\u202ename")
    assert code == 3
    message = json.loads(out)["error"]["message"]
    assert "\x1b" not in message
    assert "\u202e" not in message
    assert message in err
