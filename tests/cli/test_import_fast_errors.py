"""``ckptstore import`` answers a wrong path or argument before it imports torch (which costs
seconds): each case runs the CLI in a fresh interpreter and checks that the error came, with
exit 2, and torch was never imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import contextlib, io, json, sys, time
from ckptstore.cli.main import main
err = io.StringIO()
started = time.perf_counter()
with contextlib.redirect_stderr(err):
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "err": err.getvalue(), "torch": "torch" in sys.modules,
                  "seconds": time.perf_counter() - started}))
"""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["import", "{tmp}/nonexistent", "r@0"], "does not exist"),
        (["import", "{tmp}/file.bin", "r@0"], "is not a directory or .safetensors file"),
        (["import", "{tmp}/empty", "r@0"], "neither a torch DCP directory"),
        (["import", "{tmp}/dcp", "r@0", "--prefix", "model"], "prefix applies to safetensors"),
        (["import", "{tmp}/dcp", "r"], "RUN@STEP"),
        (["import", "{tmp}/dcp", " padded@0"], "whitespace"),
    ],
)
def test_argument_errors_answer_without_torch(
    tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "file.bin").write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"not read")
    argv = [a.format(tmp=tmp_path) for a in args]
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["code"] == 2, report
    assert message in report["err"], report
    assert len(report["err"].strip().splitlines()) == 1, report["err"]
    assert report["torch"] is False, "torch was imported before the argument error"
    assert not (tmp_path / ".ckptstore").exists()  # nothing made for a refused import
