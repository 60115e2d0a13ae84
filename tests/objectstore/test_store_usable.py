"""``check_usable``: one cheap request when a writer opens a store, so a missing bucket, an
unreachable endpoint or a vanished directory fails there, in one line naming the store and the
fix, rather than at the first save minutes into a job."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from ckptstore.errors import ObjectStoreError, StoreNotFoundError, StorePermissionError
from ckptstore.objectstore import LocalStore, RetryPolicy, S3Store
from ckptstore.testing.factories import S3StoreFactory

#: Nothing listens on the discard port: every connection is refused at once.
UNREACHABLE = "http://127.0.0.1:9"
FEW_RETRIES = RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.01)


def test_an_existing_bucket_is_usable(factory: S3StoreFactory) -> None:
    store = factory()
    store.check_usable()
    assert factory.bucket_keys(prefix=factory.root) == []  # the check stored nothing


def test_a_missing_bucket_names_bucket_endpoint_and_fix(factory: S3StoreFactory) -> None:
    store = factory(bucket="no-such-bucket-here")
    with pytest.raises(StoreNotFoundError) as caught:
        store.check_usable()
    message = str(caught.value)
    assert "\n" not in message
    assert "bucket 'no-such-bucket-here' does not exist at" in message
    assert store.endpoint in message
    assert "aws s3 mb s3://no-such-bucket-here" in message
    assert "--store" in message


def test_refused_credentials_are_reported(factory: S3StoreFactory) -> None:
    """An answer that says the credentials are wrong fails the check; a bare AccessDenied (the
    credentials may not list the bucket, and a missing object is then refused, not reported
    missing) lets the writer go on."""
    store = factory()
    codes = iter(["InvalidAccessKeyId", "AccessDenied"])

    def refuse(**kwargs: object) -> None:
        code = next(codes)
        raise ClientError(
            {"Error": {"Code": code, "Message": "no"}, "ResponseMetadata": {"HTTPStatusCode": 403}},
            "GetObject",
        )

    store.client.meta.events.register("before-call.s3.GetObject", refuse)
    with pytest.raises(
        StorePermissionError, match=r"access denied \(InvalidAccessKeyId\).*refused the cred"
    ):
        store.check_usable()
    store.check_usable()  # AccessDenied


def test_an_unreachable_endpoint_fails_fast_naming_it() -> None:
    store = S3Store("some-bucket", endpoint_url=UNREACHABLE, retry=FEW_RETRIES, connect_timeout=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(ObjectStoreError) as caught:
            store.check_usable()
    finally:
        store.close()
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert f"endpoint {UNREACHABLE} did not answer" in message
    assert "s3://some-bucket" in message
    assert "AWS_ENDPOINT_URL" in message


def test_local_store_missing_directory(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    store.check_usable()
    store.root.rmdir()
    with pytest.raises(StoreNotFoundError, match=r"does not exist .*fix --store"):
        store.check_usable()


def test_local_store_read_only_directory(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    os.chmod(store.root, 0o500)
    try:
        if os.access(store.root, os.W_OK):
            pytest.skip("running as a user who may write anywhere (root)")
        with pytest.raises(StorePermissionError, match="is not writable by this process"):
            store.check_usable()
    finally:
        os.chmod(store.root, 0o700)


@pytest.fixture
def factory(moto_store_factory: S3StoreFactory) -> S3StoreFactory:
    return moto_store_factory
