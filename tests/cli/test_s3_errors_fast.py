"""A store that cannot be used at all -- a missing bucket, an unknown access key, a wrong secret
-- is one error line within seconds, and the process ends right after it: the CLI asks the
store once when it opens it, before a command's setup (torch for ``verify`` and ``drain``, a
pass over the manifest), and no permanent error is retried. Against real SeaweedFS servers:
the session's (which accepts any key) and one of this module's, which knows one identity.

The wall-time bounds are generous correctness bounds (no hang, no retried permanent error),
not benchmarks: the same commands took 7-14 s, and over 60 s under load, while they imported
torch first, and lingered 1.5-3 s after their error line while the interpreter collected it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import s3servers
import torch

import ckptstore

pytestmark = pytest.mark.integration

#: Seconds a permanent store error may take, start to exit.
WALL_BOUND = 10.0
#: Seconds the process may live on after its error line.
LINGER_BOUND = 1.5
#: The one identity the module's own server knows (the session's test credentials).
KEY, SECRET = "testing-access-key", "testing-secret-key"


@dataclass(frozen=True)
class Finished:
    """A CLI process that ended: its exit code, stderr, and when its first stderr line came
    and when it exited (seconds from its start)."""

    code: int
    stderr: str
    first_line_at: float
    ended_at: float


def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> Finished:
    """``python -m ckptstore ARGS``, timed."""
    started = time.monotonic()
    with subprocess.Popen(
        [sys.executable, "-m", "ckptstore", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    ) as proc:
        assert proc.stderr is not None
        try:
            first = proc.stderr.readline()
            first_at = time.monotonic() - started
            rest = proc.stderr.read()
            code = proc.wait(timeout=60)
        finally:
            proc.kill()
    return Finished(code, first + rest, first_at, time.monotonic() - started)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A manifest with one checkpoint of run ``r`` (its blobs in a local store: the commands
    are pointed at S3 stores that are missing or refuse the credentials)."""
    root = tmp_path_factory.mktemp("s3-errors")
    db = str(root / "manifest.db")
    with ckptstore.open_run("r", db=db, store=root / "store", async_save=False) as run:
        run.save(1, {"model": {"w": torch.ones(8)}})
    return db


def cli_env(endpoint: str, key: str = KEY, secret: str = SECRET) -> dict[str, str]:
    """The environment of a CLI process that talks to ``endpoint`` with these credentials."""
    env = dict(os.environ)
    env.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID=key,
        AWS_SECRET_ACCESS_KEY=secret,
        CKPTSTORE_LOCAL_DIR="",
    )
    return env


def assert_prompt_error(done: Finished, *, says: str) -> None:
    assert done.code == 3, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("ckptstore: error: store s3://"), lines
    assert says in lines[0]
    assert done.ended_at < WALL_BOUND, f"took {done.ended_at:.1f}s: {lines[0]}"
    linger = done.ended_at - done.first_line_at
    assert linger < LINGER_BOUND, f"lived {linger:.1f}s after its error line"


@pytest.mark.parametrize(
    "command",
    [
        ["verify"],
        ["verify", "r@1", "--sample", "1"],
        ["gc", "--dry-run"],
        ["show", "r@1", "--entries"],
        ["drain", "r", "--local-dir", "{tmp}/tiers"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_a_missing_bucket_fails_at_once(
    seaweed_endpoint: s3servers.S3Endpoint, manifest: str, tmp_path: Path, command: list[str]
) -> None:
    assert seaweed_endpoint.endpoint_url is not None
    bucket = s3servers.random_bucket_name("missing")
    args = ["--db", manifest, "--store", f"s3://{bucket}/ckpts"]
    args += [a.replace("{tmp}", str(tmp_path)) for a in command]
    done = run_cli(args, cli_env(seaweed_endpoint.endpoint_url), tmp_path)
    assert_prompt_error(done, says=f"bucket '{bucket}' does not exist")


# Runs the command in this interpreter and says whether torch was imported on the way.
PROBE = """
import contextlib, io, json, sys
from ckptstore.cli.main import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def test_verify_refuses_a_missing_bucket_before_importing_torch(
    seaweed_endpoint: s3servers.S3Endpoint, manifest: str, tmp_path: Path
) -> None:
    assert seaweed_endpoint.endpoint_url is not None
    store = f"s3://{s3servers.random_bucket_name('missing')}"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "--db", manifest, "--store", store, "verify"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=cli_env(seaweed_endpoint.endpoint_url),
        cwd=tmp_path,
    )
    assert json.loads(done.stdout) == {"code": 3, "torch": False}, done.stderr


class _CredentialedSeaweed(s3servers.SeaweedServer):
    """`weed mini` that knows one identity (KEY, SECRET) and refuses every other."""

    def command(self) -> list[str]:
        config = self.root / "s3.json"
        identity = {
            "name": "tester",
            "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        return [*super().command(), f"-s3.config={config}"]


@pytest.fixture(scope="module")
def credentialed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A SeaweedFS that checks credentials, and a bucket on it: (endpoint URL, bucket)."""
    server = _CredentialedSeaweed(root=tmp_path_factory.mktemp("seaweed-creds"))
    server.start()  # its readiness probe signs with the session's KEY and SECRET
    try:
        bucket = s3servers.random_bucket_name("creds")
        client = s3servers.plain_client(server.endpoint_url)
        client.create_bucket(Bucket=bucket)
        client.close()
        yield server.endpoint_url, bucket
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("key", "secret", "code"),
    [
        (KEY, "not-the-secret", "SignatureDoesNotMatch"),
        ("unknown-key", SECRET, "InvalidAccessKeyId"),
    ],
    ids=["wrong secret", "unknown key"],
)
@pytest.mark.parametrize("command", [["verify"], ["show", "r@1", "--entries"]], ids=" ".join)
def test_refused_credentials_fail_at_once(
    credentialed: tuple[str, str],
    manifest: str,
    tmp_path: Path,
    key: str,
    secret: str,
    code: str,
    command: list[str],
) -> None:
    endpoint, bucket = credentialed
    args = ["--db", manifest, "--store", f"s3://{bucket}", *command]
    done = run_cli(args, cli_env(endpoint, key, secret), tmp_path)
    assert_prompt_error(done, says=f"access denied ({code})")


def test_the_right_credentials_pass_the_check(
    credentialed: tuple[str, str], manifest: str, tmp_path: Path
) -> None:
    # The check refuses only what it should: the same server and bucket with the identity it
    # knows get past it (to the blobs, which this bucket lacks: verify reports them missing).
    endpoint, bucket = credentialed
    done = run_cli(
        ["--db", manifest, "--store", f"s3://{bucket}", "verify", "--no-mark"],
        cli_env(endpoint),
        tmp_path,
    )
    assert "access denied" not in done.stderr
    assert "does not exist" not in done.stderr
    assert done.code in (1, 3), done.stderr
