"""Store factories for tests: each opens stores over one fresh, empty location.

A factory is called with backend options (``factory(multipart_threshold=...)``) and returns a
new store over the same location, so a test can open a second store on what the first wrote;
:meth:`StoreFactory.close_all` closes every store it opened. A backend's tests build one per
test (a pytest fixture) and hand it to the conformance suite in :mod:`ckptstore.testing.store`.
"""

from __future__ import annotations

import abc
import random
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import boto3
from botocore.config import Config

from ckptstore.objectstore import LocalStore, ObjectStore, RetryPolicy, S3Store

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

__all__ = [
    "FAST_RETRY",
    "MULTIPART_OPTIONS",
    "MiB",
    "LocalStoreFactory",
    "S3Endpoint",
    "S3StoreFactory",
    "StoreFactory",
    "pattern",
    "plain_client",
    "random_bucket_name",
]

MiB = 1 << 20
#: Retries in tests: a few attempts with millisecond backoff, so faults cost no waiting.
FAST_RETRY = RetryPolicy(max_attempts=4, base_delay=0.001, max_delay=0.01)
#: The smallest multipart settings S3 allows, so a ~12 MiB object goes up in three parts.
MULTIPART_OPTIONS: dict[str, Any] = {"multipart_threshold": 5 * MiB, "part_size": 5 * MiB}

S_co = TypeVar("S_co", bound=ObjectStore, covariant=True)


def pattern(size: int, seed: int = 0) -> bytes:
    """Deterministic, incompressible-looking bytes, so misplaced ranges cannot match by luck."""
    return random.Random(seed).randbytes(size)


def plain_client(endpoint_url: str | None = None) -> S3Client:
    """A boto3 S3 client independent of ckptstore, for checking what is really in a bucket."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name="us-east-1",
        config=Config(
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": 3, "mode": "standard"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def random_bucket_name(tag: str = "ckpt") -> str:
    """A fresh bucket name that follows S3's rules: ``tag`` and 20 random hex digits."""
    return f"{tag}-{uuid.uuid4().hex[:20]}"


class StoreFactory(abc.ABC, Generic[S_co]):
    """Opens stores over one fresh, empty location; closes every store it opened at teardown."""

    #: A short name for the backend, as test ids and messages show it.
    backend: str = ""

    def __init__(self) -> None:
        self._opened: list[ObjectStore] = []

    def __call__(self, **options: Any) -> S_co:
        """A new store over this factory's location, opened with backend ``options``."""
        store = self._open(**options)
        self._opened.append(store)
        return store

    @abc.abstractmethod
    def _open(self, **options: Any) -> S_co:
        """Open one store over the location (the hook a backend's factory implements)."""

    def close_all(self) -> None:
        """Close every store this factory opened, newest first."""
        while self._opened:
            self._opened.pop().close()


class LocalStoreFactory(StoreFactory[LocalStore]):
    """Local stores over the directory ``root`` (created by the first store)."""

    backend = "local"

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def _open(self, **options: Any) -> LocalStore:
        # The suite passes S3's multipart options to every backend; a directory has no parts.
        options.pop("multipart_threshold", None)
        options.pop("part_size", None)
        return LocalStore(self.root, **options)


#: S3Store options that shape its boto3 client; given any of them, a factory builds the store
#: exactly as a user would instead of taking the fast path below.
_CLIENT_OPTIONS = frozenset(
    {
        "client",
        "endpoint_url",
        "profile_name",
        "region_name",
        "addressing_style",
        "connect_timeout",
        "read_timeout",
        "max_concurrency",
        "sign_payload",
    }
)


class S3Endpoint:
    """One S3 endpoint (None: AWS, e.g. moto in-process) for a whole test session.

    Building a boto3 client in a fresh session parses botocore's S3 model (~0.1 s). Stores are
    therefore given clients from one shared session, configured with the very ``Config`` that
    S3Store's own constructor produced for ``template`` (built once, the way users build it).
    """

    def __init__(self, endpoint_url: str | None) -> None:
        self.endpoint_url = endpoint_url
        self.session = boto3.session.Session()
        #: A plain client, independent of the stores, for checking what is in a bucket.
        self.raw_client = plain_client(endpoint_url)
        template = S3Store("template-bucket", endpoint_url=endpoint_url)
        self.config = template.client.meta.config
        template.close()

    def client(self) -> S3Client:
        """A new boto3 client for a store, configured as S3Store would configure it."""
        return self.session.client("s3", endpoint_url=self.endpoint_url, config=self.config)


class S3StoreFactory(StoreFactory[S3Store]):
    """Stores over ``s3://bucket/prefix`` on ``endpoint``; the bucket must exist.

    ``raw_client`` is a plain boto3 client, independent of the stores, for checking what is
    really in the bucket.
    """

    def __init__(self, backend: str, endpoint: S3Endpoint, *, bucket: str) -> None:
        super().__init__()
        self.backend = backend
        self.endpoint = endpoint
        self.endpoint_url = endpoint.endpoint_url
        self.raw_client = endpoint.raw_client
        self.bucket = bucket
        #: This test's own corner of the bucket (buckets may be shared between tests).
        self.root = f"t-{uuid.uuid4().hex[:16]}"
        #: The stores' prefix unless a test asks for another.
        self.prefix = f"{self.root}/ckpt/run-1"
        #: Buckets made by :meth:`fresh_bucket`, for the fixture to delete at teardown.
        self.created_buckets: list[str] = []

    def _open(self, **options: Any) -> S3Store:
        bucket = options.pop("bucket", self.bucket)
        options.setdefault("prefix", self.prefix)
        options.setdefault("retry", FAST_RETRY)
        if not _CLIENT_OPTIONS & options.keys():
            options["client"] = self.endpoint.client()
        elif self.endpoint_url is not None:
            options.setdefault("endpoint_url", self.endpoint_url)
        return S3Store(bucket, **options)

    def fresh_bucket(self) -> str:
        """Create an empty bucket of this test's own (for stores without a prefix)."""
        bucket = random_bucket_name()
        self.raw_client.create_bucket(Bucket=bucket)
        self.created_buckets.append(bucket)
        return bucket

    def full_key(self, key: str, prefix: str | None = None) -> str:
        """The bucket key of a store's ``key`` under ``prefix`` (default: the stores' prefix)."""
        prefix = self.prefix if prefix is None else prefix
        return f"{prefix}/{key}" if prefix else key

    def bucket_keys(self, bucket: str | None = None, prefix: str = "") -> list[str]:
        """Every key in the bucket that starts with ``prefix``, store prefixes included."""
        keys: list[str] = []
        pages = self.raw_client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket or self.bucket, Prefix=prefix
        )
        for page in pages:
            keys.extend(item["Key"] for item in page.get("Contents", []))
        return keys

    def pending_uploads(self) -> list[str]:
        """Keys of the multipart uploads still open under the stores' prefix."""
        response = self.raw_client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix)
        return [u["Key"] for u in response.get("Uploads", [])]
