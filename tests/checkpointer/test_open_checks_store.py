"""A writer's ``open_run`` checks its store with one cheap request (``check_usable``), so a
missing bucket or an unreachable endpoint fails at once, in one line naming the store and the
fix, before the run's row is touched -- not at the first save, on every rank, minutes in."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from moto import mock_aws

from ckptstore.checkpointer import open_run, run_info
from ckptstore.errors import ObjectStoreError, StoreNotFoundError
from ckptstore.objectstore import RetryPolicy, S3Store
from ckptstore.testing.factories import S3Endpoint, S3StoreFactory

#: Nothing listens on the discard port: every connection is refused at once.
UNREACHABLE = "http://127.0.0.1:9"


@pytest.fixture
def aws() -> Iterator[None]:
    with mock_aws():
        yield


def test_missing_bucket_fails_at_open_naming_it(db_url: str, aws: None) -> None:
    with pytest.raises(StoreNotFoundError) as caught:
        open_run("r", db=db_url, store="s3://no-such-bucket-here/ckpt")
    message = str(caught.value)
    assert "bucket 'no-such-bucket-here' does not exist" in message
    assert "aws s3 mb s3://no-such-bucket-here" in message
    assert run_info("r", db=db_url) is None  # refused before the run was created


def test_existing_bucket_opens_and_saves(db_url: str, moto_store_factory: S3StoreFactory) -> None:
    with open_run("r", db=db_url, store=moto_store_factory()) as run:
        run.save(1, {"state": {"step": 1}}).wait()
        assert run.latest() is not None


def test_unreachable_endpoint_fails_fast_at_open(db_url: str) -> None:
    store = S3Store(
        "some-bucket",
        endpoint_url=UNREACHABLE,
        retry=RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.01),
        connect_timeout=1.0,
    )
    started = time.monotonic()
    try:
        with pytest.raises(ObjectStoreError, match=f"endpoint {UNREACHABLE} did not answer"):
            open_run("r", db=db_url, store=store)
    finally:
        store.close()
    assert time.monotonic() - started < 10
    assert run_info("r", db=db_url) is None


def test_a_reader_is_not_checked(db_url: str, moto_endpoint: S3Endpoint, aws: None) -> None:
    """Only a writer checks: a reader of a run whose bucket is gone still opens (and reports
    the store's error when it reads a checkpoint)."""
    url = "s3://short-lived-bucket/ckpt"
    moto_endpoint.raw_client.create_bucket(Bucket="short-lived-bucket")
    with open_run("r", db=db_url, store=url):
        pass
    moto_endpoint.raw_client.delete_bucket(Bucket="short-lived-bucket")
    with pytest.raises(StoreNotFoundError):
        open_run("r", db=db_url, store=url)
    with open_run("r", db=db_url, store=url, writable=False) as run:
        assert run.latest() is None
