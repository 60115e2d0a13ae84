"""Google Cloud Storage fixtures: a real GCS emulator (gcp-storage-emulator, a subprocess started
by :mod:`gcsserver`) for the whole session, and a factory of stores over a fresh prefix per test.

- ``gcs_emulator``: the emulator, with GCS's preconditions added (see gcsserver.py), on a port
  of its own; ``gcs_bucket``: one bucket for the session.
- ``gcs_store_factory`` / ``gcs_store``: stores over ``gs://<bucket>/t-<random>/ckpt/run-1``.
- ``gcs_emulator_as_published``: a second emulator, exactly as published (it ignores
  preconditions), for the tests of how the store copes with that.

A session-wide autouse fixture keeps every test away from real Google credentials and the
metadata server. An emulator that fails to start is an error, never a skip.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import gcsserver
import pytest

from ckptstore.objectstore._gcs import GCSStore
from ckptstore.objectstore._gcs_client import import_storage
from ckptstore.testing.factories import FAST_RETRY, StoreFactory


@pytest.fixture(scope="session", autouse=True)
def _gcs_test_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No real Google credentials, gcloud configuration or metadata-server probes, ever."""
    empty = tmp_path_factory.mktemp("gcloud")
    with pytest.MonkeyPatch.context() as mp:
        for name in (
            "GOOGLE_APPLICATION_CREDENTIALS",
            "STORAGE_EMULATOR_HOST",
            "GOOGLE_CLOUD_PROJECT",
        ):
            mp.delenv(name, raising=False)
        mp.setenv("CLOUDSDK_CONFIG", str(empty))
        # A closed port: a metadata-server probe is refused at once instead of timing out.
        mp.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
        mp.setenv("GCE_METADATA_IP", "127.0.0.1:9")
        yield


def plain_gcs_client(endpoint_url: str) -> Any:
    """A google-cloud-storage client independent of ckptstore, for checking a bucket."""
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials

    return import_storage().Client(
        project="test",
        credentials=AnonymousCredentials(),
        client_options=ClientOptions(api_endpoint=endpoint_url),
    )


class GCSStoreFactory(StoreFactory[GCSStore]):
    """Stores over ``gs://bucket/prefix`` on the emulator; the bucket exists.

    ``raw`` is a plain google-cloud-storage client, independent of the stores, for checking
    what is really in the bucket. The suite's multipart options become GCS's resumable ones.
    """

    backend = "gcs"

    def __init__(self, emulator: gcsserver.GCSEmulator, bucket: str) -> None:
        super().__init__()
        self.emulator = emulator
        self.endpoint_url = emulator.endpoint_url
        self.bucket = bucket
        self.raw = plain_gcs_client(self.endpoint_url)
        self.root = f"t-{uuid.uuid4().hex[:16]}"
        self.prefix = f"{self.root}/ckpt/run-1"
        self.created_buckets: list[str] = []

    def _open(self, **options: Any) -> GCSStore:
        if "multipart_threshold" in options:
            options["resumable_threshold"] = options.pop("multipart_threshold")
        if "part_size" in options:
            options["chunk_size"] = options.pop("part_size")
        bucket = options.pop("bucket", self.bucket)
        options.setdefault("prefix", self.prefix)
        options.setdefault("retry", FAST_RETRY)
        options.setdefault("endpoint_url", self.endpoint_url)
        options.setdefault("anonymous", True)
        return GCSStore(bucket, **options)

    def fresh_bucket(self) -> str:
        """Create an empty bucket of this test's own."""
        bucket = f"ckpt-{uuid.uuid4().hex[:20]}"
        self.emulator.create_bucket(bucket)
        self.created_buckets.append(bucket)
        return bucket

    def full_key(self, key: str, prefix: str | None = None) -> str:
        prefix = self.prefix if prefix is None else prefix
        return f"{prefix}/{key}" if prefix else key

    def bucket_keys(self, bucket: str | None = None, prefix: str = "") -> list[str]:
        """Every object name in the bucket that starts with ``prefix``."""
        return [b.name for b in self.raw.list_blobs(bucket or self.bucket, prefix=prefix or None)]

    def raw_get(self, name: str, bucket: str | None = None) -> bytes | None:
        from google.api_core.exceptions import NotFound

        try:
            return bytes(self.raw.bucket(bucket or self.bucket).blob(name).download_as_bytes())
        except NotFound:
            return None

    def raw_put(self, name: str, data: bytes, bucket: str | None = None) -> None:
        self.raw.bucket(bucket or self.bucket).blob(name).upload_from_string(data)


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[gcsserver.GCSEmulator]:
    """gcp-storage-emulator with GCS's preconditions, for the whole session."""
    with gcsserver.gcs_emulator(tmp_path_factory.mktemp("gcs-emulator")) as emulator:
        yield emulator


@pytest.fixture(scope="session")
def gcs_emulator_as_published(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[gcsserver.GCSEmulator]:
    """gcp-storage-emulator exactly as published: it ignores ifGenerationMatch."""
    root = tmp_path_factory.mktemp("gcs-emulator-as-published")
    with gcsserver.gcs_emulator(root, honour_preconditions=False) as emulator:
        yield emulator


@pytest.fixture(scope="session")
def gcs_bucket(gcs_emulator: gcsserver.GCSEmulator) -> str:
    """One bucket for the session; each test works under its own random prefix."""
    bucket = f"ckpt-{uuid.uuid4().hex[:20]}"
    gcs_emulator.create_bucket(bucket)
    return bucket


@pytest.fixture
def gcs_store_factory(
    gcs_emulator: gcsserver.GCSEmulator, gcs_bucket: str
) -> Iterator[GCSStoreFactory]:
    factory = GCSStoreFactory(gcs_emulator, gcs_bucket)
    yield factory
    factory.close_all()
    factory.raw.close()


@pytest.fixture
def gcs_store(gcs_store_factory: GCSStoreFactory) -> GCSStore:
    return gcs_store_factory()


@pytest.fixture
def gcs_store_url(gcs_emulator: gcsserver.GCSEmulator, gcs_bucket: str) -> Iterator[str]:
    """A fresh ``gs://`` URL on the emulator, with ``STORAGE_EMULATOR_HOST`` set for the test
    (so ``open_store``, the CLI and child processes reach the emulator as a user's would)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint_url)
        yield f"gs://{gcs_bucket}/t-{uuid.uuid4().hex[:16]}/ckpt"
