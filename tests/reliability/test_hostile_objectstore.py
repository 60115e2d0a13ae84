"""Hostile conditions at the object store: an AWS secret key and credentials in an S3 endpoint
URL never leak (saves, loads, failures and every read-only CLI command are scanned), and a
store that is not the one the checkpoints live in (a bucket typo, an unmounted directory) is
an error that loses nothing: no checkpoint is marked, no blob collected.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import s3servers
from hostile import HOSTILE, assert_exact, open_writer, weights
from secret_scan import CLI_READS, CLI_READS_EXIT, Scanner, scan_cli, workload

from ckptstore.checkpointer import open_run
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ConfigError,
    IntegrityError,
    ObjectStoreError,
    StoreNotFoundError,
)
from ckptstore.maintenance import collect_garbage
from ckptstore.manifest import Database
from ckptstore.objectstore import LocalStore, ObjectStore, S3Store
from ckptstore.testing.factories import FAST_RETRY, S3StoreFactory

# -- secrets ---------------------------------------------------------------------------------------


@pytest.mark.integration
def test_an_aws_secret_key_never_leaks(
    seaweed_store_factory: S3StoreFactory,
    sqlite_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """The secret key in AWS_SECRET_ACCESS_KEY, as boto3 reads it, through saves, loads, a
    missing bucket, an unreachable endpoint and every read-only CLI command."""
    secret = "Zq7SECRETxAWSkey0000000000000000000000Zq7"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIACKPTSTORETEST01")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    endpoint = str(seaweed_store_factory.endpoint_url)
    scanner = Scanner((secret,))
    try:
        store = seaweed_store_factory(endpoint_url=endpoint)  # credentials from the environment
        missing = S3Store("no-such-bucket-ckpt", "p", endpoint_url=endpoint, retry=FAST_RETRY)
        unreachable = S3Store(
            "ckpt-unreachable", "p", endpoint_url="http://127.0.0.1:1", retry=FAST_RETRY
        )

        def save_to(target: ObjectStore) -> None:
            with open_run("other", db=sqlite_url, store=target) as run:
                run.save(1, {"policy": weights(3)}).wait()

        workload(
            scanner,
            sqlite_url,
            store,
            [
                lambda: save_to(missing),
                lambda: save_to(unreachable),
                lambda: missing.head("cas/00/00"),
            ],
        )
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        base = ["--db", sqlite_url, "--store", store.url]
        export = ["export", "r@1", str(tmp_path / "export")]
        codes = scan_cli(scanner, capsys, base, *CLI_READS, export)
        assert codes == [*CLI_READS_EXIT, 0]
        elsewhere = ["--db", sqlite_url, "--store", "s3://no-such-bucket-ckpt/p"]
        assert scan_cli(scanner, capsys, elsewhere, ["gc", "--dry-run"]) == [3]
        scanner.database(sqlite_url)
        missing.close()
        unreachable.close()
    finally:
        scanner.report(reliability_report)
    assert scanner.leaks == [], scanner.summary()
    assert scanner.texts > 100


@pytest.mark.integration
def test_credentials_in_an_s3_endpoint_url_never_leak(
    seaweed_store_factory: S3StoreFactory,
    sqlite_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """``http://user:password@host`` as the endpoint (explicit, or in AWS_ENDPOINT_URL). Either
    ckptstore refuses such a URL without echoing it, or the password is never shown."""
    password = "Pw9SECRETinURL"
    port = str(seaweed_store_factory.endpoint_url).rsplit(":", 1)[1]
    with_creds = f"http://ckptuser:{password}@127.0.0.1:{port}"
    scanner = Scanner((password,))
    try:
        try:
            store = seaweed_store_factory(endpoint_url=with_creds)
        except ConfigError as exc:  # refusing such URLs is a fine answer
            scanner.exception("refused endpoint", exc)
        else:
            unreachable = S3Store(
                "b", "p", endpoint_url=f"http://ckptuser:{password}@127.0.0.1:1", retry=FAST_RETRY
            )

            def save_to(target: ObjectStore) -> None:
                with open_run("other", db=sqlite_url, store=target) as run:
                    run.save(1, {"policy": weights(3)}).wait()

            workload(scanner, sqlite_url, store, [lambda: save_to(unreachable)])
            monkeypatch.setenv("AWS_ENDPOINT_URL", with_creds)
            scan_cli(scanner, capsys, ["--db", sqlite_url, "--store", store.url], *CLI_READS)
            scanner.database(sqlite_url)
            unreachable.close()
    finally:
        scanner.report(reliability_report)
    assert scanner.leaks == [], scanner.summary()


# -- a store that is not the one the checkpoints live in -------------------------------------------


@pytest.mark.integration
def test_resuming_against_a_missing_bucket_loses_nothing(
    seaweed_store_factory: S3StoreFactory,
    sqlite_url: str,
    reliability_report: Any,
) -> None:
    good = seaweed_store_factory()
    with open_writer(sqlite_url, good) as run:
        run.save(1, {"policy": weights(1)})
        run.save(2, {"policy": weights(2)})
    typo = seaweed_store_factory(bucket=s3servers.random_bucket_name("typo"))
    # A writer finds out when it opens, before the run's epoch is bumped ...
    with pytest.raises(StoreNotFoundError, match=r"bucket 'typo-.*' does not exist.*aws s3 mb"):
        open_run("r", db=sqlite_url, store=typo)
    # ... a reader at its load, which marks nothing
    with open_run("r", db=sqlite_url, store=typo, writable=False) as run:
        with pytest.raises(ObjectStoreError, match="does not exist") as info:
            run.load()
        assert not isinstance(info.value, IntegrityError | CheckpointNotFoundError)
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "committed"),
            (2, "committed"),
        ]
    assert_nothing_lost(sqlite_url, good)
    reliability_report.add(HOSTILE, rejected=2, code_executed=0, escaped_writes=0)


def test_resuming_against_an_empty_store_directory_loses_nothing(
    sqlite_url: str, store: LocalStore, tmp_path: Path, reliability_report: Any
) -> None:
    with open_writer(sqlite_url, store) as run:
        run.save(1, {"policy": weights(1)})
        run.save(2, {"policy": weights(2)})
    with open_run("r", db=sqlite_url, store=tmp_path / "not-mounted") as run:
        with pytest.raises(CkptStoreError) as info:
            run.load()
        assert not isinstance(info.value, CheckpointNotFoundError), info.value
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "committed"),
            (2, "committed"),
        ]
    assert_nothing_lost(sqlite_url, store)
    reliability_report.add(HOSTILE, rejected=1, code_executed=0, escaped_writes=0)


def assert_nothing_lost(db: str, store: ObjectStore) -> None:
    """Two GC passes with no grace, then the newest checkpoint loads exactly."""
    database = Database(db)
    try:
        for _ in range(2):
            collect_garbage(database, store, grace=dt.timedelta(0))
    finally:
        database.close()
    with open_run("r", db=db, store=store, writable=False) as run:
        loaded = run.load()
        assert (loaded.info.step, loaded.skipped) == (2, ())
        assert_exact(loaded.state["policy"], weights(2))
