"""Root fixtures: a safe AWS environment for the whole session, S3 servers, and object stores.

Store fixtures (each a fresh, empty location per test):

- ``local_store`` / ``local_store_factory``: a directory under the test's tmp dir.
- ``moto_store`` / ``moto_store_factory``: S3 on moto in-process (``mock_aws``).
- ``seaweed_store`` / ``seaweed_store_factory``: S3 on a real SeaweedFS server (integration).
- ``moto_server_store`` / ``moto_server_store_factory``: S3 on moto's HTTP server (integration).
- ``any_store`` / ``store_factory``: parametrized over all four.

A factory (:mod:`ckptstore.testing.factories`) is called with backend options
(``factory(multipart_threshold=...)``) and returns a new store over the same location; every
store it opened is closed at teardown. Each backend's tests in tests/objectstore/ hand theirs to
the shared conformance suite, :mod:`ckptstore.testing.store`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import s3servers
from moto import mock_aws

from ckptstore.objectstore import ObjectStore
from ckptstore.testing.factories import LocalStoreFactory, S3Endpoint, S3StoreFactory, StoreFactory

# Manifest-database fixtures (db_url on SQLite and PostgreSQL, pg_url, store) for every directory.
pytest_plugins = ["dbfixtures", "gcs_fixtures", "azure_fixtures"]


@pytest.fixture(scope="session", autouse=True)
def _aws_test_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No real credentials, profiles, endpoints or instance-metadata probes, ever."""
    missing = tmp_path_factory.mktemp("aws") / "absent"
    with pytest.MonkeyPatch.context() as mp:
        for name in (
            "AWS_PROFILE",
            "AWS_DEFAULT_PROFILE",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
            "AWS_SESSION_TOKEN",
            "AWS_SECURITY_TOKEN",
            "AWS_ROLE_ARN",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        ):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("AWS_ACCESS_KEY_ID", "testing-access-key")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret-key")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_REGION", "us-east-1")
        # Never read ~/.aws of whoever runs the tests.
        mp.setenv("AWS_CONFIG_FILE", str(missing))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(missing))
        yield


# -- servers ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def seaweed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3servers.SeaweedServer]:
    """A real SeaweedFS (`weed mini`) on 127.0.0.1 for the whole session."""
    with s3servers.seaweed_server(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture(scope="session")
def moto_server() -> Iterator[s3servers.MotoServer]:
    """moto's threaded HTTP server on 127.0.0.1 for the whole session."""
    with s3servers.moto_server() as server:
        yield server


# -- store factories --------------------------------------------------------------------------


@pytest.fixture
def local_store_factory(tmp_path: Path) -> Iterator[LocalStoreFactory]:
    factory = LocalStoreFactory(tmp_path / "store")
    yield factory
    factory.close_all()


# One S3Endpoint per server and session: a plain boto3 client for checking buckets, and a
# shared boto3 session that builds the stores' clients quickly (see S3Endpoint).


@pytest.fixture(scope="session")
def moto_endpoint() -> S3Endpoint:
    """AWS's endpoint; inside ``mock_aws`` every request to it goes to moto."""
    return S3Endpoint(None)


@pytest.fixture(scope="session")
def seaweed_endpoint(seaweed_server: s3servers.SeaweedServer) -> S3Endpoint:
    return S3Endpoint(seaweed_server.endpoint_url)


@pytest.fixture(scope="session")
def moto_server_endpoint(moto_server: s3servers.MotoServer) -> S3Endpoint:
    return S3Endpoint(moto_server.endpoint_url)


@pytest.fixture(scope="session")
def seaweed_bucket(seaweed_endpoint: S3Endpoint) -> str:
    """One bucket for the session: SeaweedFS spends ~0.2 s growing volumes for each new
    bucket, so tests share it and each works under its own random prefix."""
    bucket = s3servers.random_bucket_name()
    seaweed_endpoint.raw_client.create_bucket(Bucket=bucket)
    return bucket


@pytest.fixture
def moto_store_factory(moto_endpoint: S3Endpoint) -> Iterator[S3StoreFactory]:
    with mock_aws():
        bucket = s3servers.random_bucket_name()
        moto_endpoint.raw_client.create_bucket(Bucket=bucket)
        factory = S3StoreFactory("moto", moto_endpoint, bucket=bucket)
        yield factory
        factory.close_all()


@pytest.fixture
def seaweed_store_factory(
    seaweed_endpoint: S3Endpoint, seaweed_bucket: str
) -> Iterator[S3StoreFactory]:
    factory = S3StoreFactory("seaweed", seaweed_endpoint, bucket=seaweed_bucket)
    yield factory
    factory.close_all()
    # The server runs with -s3.allowDeleteBucketNotEmpty (its default): one call drops it all.
    for bucket in factory.created_buckets:
        seaweed_endpoint.raw_client.delete_bucket(Bucket=bucket)


@pytest.fixture
def moto_server_store_factory(
    moto_server: s3servers.MotoServer, moto_server_endpoint: S3Endpoint
) -> Iterator[S3StoreFactory]:
    moto_server.reset()
    bucket = s3servers.random_bucket_name()
    moto_server_endpoint.raw_client.create_bucket(Bucket=bucket)
    factory = S3StoreFactory("moto_server", moto_server_endpoint, bucket=bucket)
    yield factory
    factory.close_all()


BACKENDS = [
    "local",
    "moto",
    pytest.param("seaweed", marks=pytest.mark.integration),
    pytest.param("moto_server", marks=pytest.mark.integration),
]


@pytest.fixture(params=BACKENDS)
def store_factory(request: pytest.FixtureRequest) -> StoreFactory:
    """A factory for each backend in turn."""
    factory: StoreFactory = request.getfixturevalue(f"{request.param}_store_factory")
    return factory


# -- stores -----------------------------------------------------------------------------------


@pytest.fixture
def local_store(local_store_factory: LocalStoreFactory) -> ObjectStore:
    return local_store_factory()


@pytest.fixture
def moto_store(moto_store_factory: S3StoreFactory) -> ObjectStore:
    return moto_store_factory()


@pytest.fixture
def seaweed_store(seaweed_store_factory: S3StoreFactory) -> ObjectStore:
    return seaweed_store_factory()


@pytest.fixture
def moto_server_store(moto_server_store_factory: S3StoreFactory) -> ObjectStore:
    return moto_server_store_factory()


@pytest.fixture
def any_store(store_factory: StoreFactory) -> ObjectStore:
    """A fresh, empty store of each backend in turn."""
    return store_factory()
