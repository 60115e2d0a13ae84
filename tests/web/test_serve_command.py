"""``ckptstore serve`` as a command: what it refuses before serving, and a real server process
that starts without torch (nor numpy, boto3 or the ORM until a page needs them) and stops
cleanly on SIGTERM."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from web_sample import Sample

from ckptstore.cli.main import main

# Runs `ckptstore serve` in the main thread; a client thread fetches pages, noting which heavy
# modules are loaded after each group, prints the report, and stops the server with SIGTERM.
PROBE = """
import contextlib, io, json, os, signal, sys, threading, urllib.request
from ckptstore.cli.main import main
HEAVY = ("torch", "numpy", "boto3", "zstandard", "alembic", "sqlalchemy.orm")
ready, out = threading.Event(), io.StringIO()
class Out(io.StringIO):
    def write(self, text):
        n = super().write(text)
        ready.set()
        return n
out = Out()
def loaded():
    return [m for m in HEAVY if m in sys.modules]
def client():
    report = {"at_start": None}
    try:
        ready.wait(60)
        report["at_start"] = loaded()
        url = json.loads(out.getvalue().splitlines()[0])["url"].rstrip("/")
        for group, paths in json.loads(sys.argv[-1]):
            for path in paths:
                with urllib.request.urlopen(url + path, timeout=60) as r:
                    assert r.status == 200, path
            report[group] = loaded()
    except BaseException as exc:
        report["error"] = repr(exc)
    sys.__stdout__.write(json.dumps(report) + "\\n")
    sys.__stdout__.flush()
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=client, daemon=True).start()
with contextlib.redirect_stdout(out):
    code = main(sys.argv[1:-1])
sys.__stdout__.write(json.dumps({"code": code}) + "\\n")
"""


def test_serve_starts_without_heavy_imports_and_stops_on_sigterm(
    sample: Sample, tmp_path: Path
) -> None:
    ids = sample.ids
    groups = [
        ("manifest_pages", ["/", "/lineage", "/runs/base", "/api/runs/base/history"]),
        (
            "store_pages",
            [
                f"/checkpoints/{ids['base', 8]}",
                f"/compare?a={ids['base', 7]}&b={ids['base', 8]}",
                "/storage",
            ],
        ),
    ]
    argv = ["--db", sample.db, "--store", sample.store, "serve", "--port", "0", "--json"]
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv, json.dumps(groups)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    report, ended = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert "error" not in report, report
    assert report["at_start"] == []
    assert report["manifest_pages"] == []  # the manifest through SQLAlchemy Core only
    assert "torch" not in report["store_pages"]  # indexes are read without torch
    assert ended == {"code": 0}


def test_a_non_loopback_address_without_a_token_is_refused(
    sample: Sample, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--db", sample.db, "--store", sample.store, "serve"]
    assert main([*base, "--host", "0.0.0.0"]) == 2
    assert "without a token" in capsys.readouterr().err
    assert main([*base, "--host", "0.0.0.0", "--token", "short"]) == 2
    assert "at least 16" in capsys.readouterr().err


def test_a_busy_port_a_bad_port_and_a_missing_database_are_usage_errors(
    sample: Sample, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert main(["--db", sample.db, "--store", sample.store, "serve", "--port", port]) == 2
    assert f"cannot serve on 127.0.0.1:{port}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["--db", sample.db, "serve", "--port", "70000"])
    assert exited.value.code == 2
    missing = tmp_path / "nothing.db"
    assert main(["--db", str(missing), "serve", "--port", "0"]) == 2
    assert "no manifest database" in capsys.readouterr().err
    assert not missing.exists()
