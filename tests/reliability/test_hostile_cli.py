"""Misconfiguration as the command line meets it: a bad store URL, a missing bucket, wrong
credentials, an unreachable or out-of-date database, an unknown run. Each gives one line on
stderr that names the problem and the fix, a non-zero exit code, and a ckptstore error from
the Python API.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import s3servers
from hostile import ACTIONABLE, open_writer, run_cli, weights
from sqlalchemy import text

from ckptstore.checkpointer import open_run
from ckptstore.cli import main
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ConfigError,
    DatabaseError,
    SchemaError,
    StoreNotFoundError,
    StorePermissionError,
)
from ckptstore.manifest import Database
from ckptstore.manifest.db import redact, resolve_url
from ckptstore.testing.factories import S3StoreFactory


class NotOneLine(AssertionError):
    """stderr held more (or less) than one line."""


@dataclass
class Case:
    """A misconfiguration: how to provoke it from the API and the CLI, and what must be said."""

    argv: list[str]
    api: Callable[[], Any]
    error: type[CkptStoreError]
    says: tuple[str, ...]
    exit_code: int = 3


class AuthSeaweed(s3servers.SeaweedServer):
    """A SeaweedFS that checks credentials (an identities file), unlike the shared one."""

    config: Path = Path()

    def command(self) -> list[str]:
        return [*super().command(), f"-s3.config={self.config}"]


@pytest.fixture(scope="module")
def auth_seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint of a SeaweedFS that accepts only the session's test credentials."""
    root = tmp_path_factory.mktemp("seaweed-auth")
    config = root / "s3.json"
    identity = {
        "name": "ckpt-tests",
        "credentials": [
            {
                "accessKey": os.environ["AWS_ACCESS_KEY_ID"],
                "secretKey": os.environ["AWS_SECRET_ACCESS_KEY"],
            }
        ],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    server = AuthSeaweed(root)
    server.config = config
    server.start()
    try:
        yield server.endpoint_url
    finally:
        server.stop()


def make_case(
    name: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> Case:
    db = f"sqlite:///{tmp_path / 'manifest.db'}"
    store = str(tmp_path / "store")
    if name == "bad store scheme":
        return Case(
            ["--db", db, "--store", "ftp://x", "verify"],
            lambda: open_run("r", db=db, store="ftp://x"),
            ConfigError,
            (
                "unsupported store URL scheme 'ftp'",
                "use a directory path",
                "s3://bucket/prefix, gs://bucket/prefix",
            ),
            exit_code=2,
        )
    if name == "s3 URL without a bucket":
        return Case(
            ["--db", db, "--store", "s3://", "verify"],
            lambda: open_run("r", db=db, store="s3://"),
            ConfigError,
            ("store URL 's3://' has no bucket", "use s3://bucket/prefix"),
            exit_code=2,
        )
    if name == "missing bucket":
        endpoint = request.getfixturevalue("seaweed_endpoint").endpoint_url
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        bucket = s3servers.random_bucket_name("missing")

        def save() -> None:
            with open_run("r", db=db, store=f"s3://{bucket}/ckpt") as run:
                run.save(1, {"policy": weights(1)}).wait()

        return Case(
            ["--db", db, "--store", f"s3://{bucket}/ckpt", "gc", "--dry-run"],
            save,  # a writer finds out when it opens the run, before its first save
            StoreNotFoundError,
            (f"bucket {bucket!r} does not exist at {endpoint}", "fix the store URL"),
        )
    if name == "wrong credentials":
        endpoint = request.getfixturevalue("auth_seaweed")
        bucket = s3servers.random_bucket_name("auth")
        client = s3servers.plain_client(endpoint)
        client.create_bucket(Bucket=bucket)
        client.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-key")

        def save() -> None:
            with open_run("r", db=db, store=f"s3://{bucket}/ckpt") as run:
                run.save(1, {"policy": weights(1)}).wait()

        return Case(
            ["--db", db, "--store", f"s3://{bucket}/ckpt", "gc", "--dry-run"],
            save,  # refused when the run opens
            StorePermissionError,
            ("access denied (", "check the credentials"),
        )
    if name == "unreachable database":
        url = "postgresql://127.0.0.1:1/x"
        return Case(
            ["--db", url, "runs"],
            lambda: open_run("r", db=url, store=store),
            DatabaseError,
            ("cannot reach the manifest database", "127.0.0.1:1", "check the URL and that the"),
        )
    if name.startswith("out-of-date schema"):
        if name.endswith("(PostgreSQL)"):
            db = request.getfixturevalue("pg_schema_url")
        # An old ckptstore created it: the database stops at revision 0002.
        assert main(["--db", db, "db", "upgrade", "0002"]) == 0
        return Case(
            ["--db", db, "runs"],
            lambda: open_run("r", db=db, store=store),
            SchemaError,
            (
                "schema revision 0002, this ckptstore needs",
                f"run `ckptstore db upgrade --db {redact(resolve_url(db))}`",
            ),
        )
    if name == "schema newer than ckptstore":
        database = Database(db)
        with database.engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = 'f00d'"))
        database.close()
        return Case(
            ["--db", db, "runs"],
            lambda: open_run("r", db=db, store=store),
            SchemaError,
            ("schema revision f00d, newer than this ckptstore knows", "upgrade ckptstore"),
        )
    if name == "no such run":
        Database(db).close()
        Path(store).mkdir()  # a reader needs an existing store; the run is what is missing
        return Case(
            ["--db", db, "ls", "nope"],
            lambda: open_run("nope", db=db, store=store, writable=False),
            CheckpointNotFoundError,
            ("no run named 'nope'",),
        )
    raise AssertionError(name)


CASES = [
    "bad store scheme",
    "s3 URL without a bucket",
    pytest.param("missing bucket", marks=pytest.mark.integration),
    pytest.param("wrong credentials", marks=pytest.mark.integration),
    "unreachable database",
    "out-of-date schema",
    pytest.param("out-of-date schema (PostgreSQL)", marks=pytest.mark.integration),
    "schema newer than ckptstore",
    "no such run",
]


@pytest.mark.parametrize("name", CASES)
def test_actionable_error(
    name: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    case = make_case(name, tmp_path, request, monkeypatch)
    one_line = 0
    try:
        with pytest.raises(case.error) as info:
            case.api()
        api_message = str(info.value)
        for phrase in case.says:
            assert phrase in api_message, (phrase, api_message)

        code, out, err = run_cli(capsys, *case.argv)
        assert code == case.exit_code, (out, err)
        assert out == ""
        assert err.startswith("ckptstore: error: ")
        assert "Traceback" not in err
        for phrase in case.says:
            assert phrase in err, (phrase, err)
        one_line = int(err.count("\n") == 1 and err.endswith("\n"))
    finally:
        reliability_report.add(ACTIONABLE, cases=1, one_line=one_line)
    if not one_line:
        raise NotOneLine(f"stderr is not one line: {err!r}")


@pytest.mark.integration
@pytest.mark.parametrize("command", ["verify", "export"])
def test_cli_against_a_missing_bucket_names_the_bucket(
    seaweed_store_factory: S3StoreFactory,
    sqlite_url: str,
    tmp_path: Path,
    command: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    good = seaweed_store_factory()
    with open_writer(sqlite_url, good) as run:
        run.save(1, {"policy": weights(1)})
    monkeypatch.setenv("AWS_ENDPOINT_URL", str(seaweed_store_factory.endpoint_url))
    bucket = s3servers.random_bucket_name("typo")
    argv = ["verify"] if command == "verify" else ["export", "r@1", str(tmp_path / "out")]
    code, out, err = run_cli(capsys, "--db", sqlite_url, "--store", f"s3://{bucket}/x", *argv)
    with open_run("r", db=sqlite_url, store=good, writable=False) as run:
        assert [(c.step, c.status) for c in run.checkpoints()] == [(1, "committed")]
    assert code == 3, (out, err)
    assert err.count("\n") == 1, err
    assert f"bucket {bucket!r} does not exist" in err
    reliability_report.add(ACTIONABLE, cases=1, one_line=1)
