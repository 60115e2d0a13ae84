"""S3Store: Amazon S3 or any S3-compatible server (MinIO, SeaweedFS, moto) through boto3.

Credentials come only from boto3's normal chain (environment, profile, instance role); this
module never stores or prints them. botocore's own retries are turned off so that one policy
covers every request, including reading a response body that was cut short: every request goes
through a :class:`~ckptstore.objectstore.remote.RemoteCaller`, and :func:`classify` is all this
module tells it about botocore's exceptions.

The store is split by job: this module is its face (the contract's calls, single PUTs and
GETs); :mod:`._s3_multipart` uploads big objects in parts and sweeps abandoned uploads;
:mod:`._s3_client` checks the configuration and builds the boto3 client; :mod:`._s3_errors`
sorts botocore's exceptions; :mod:`._s3_body` sends a list of buffers as one request body.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar, cast

import botocore.exceptions as bexc

from ckptstore.errors import (
    ConfigError,
    ObjectNotFoundError,
    ObjectStoreError,
    StoreNotFoundError,
    StorePermissionError,
)
from ckptstore.names import printable
from ckptstore.objectstore._retry import RetryPolicy
from ckptstore.objectstore._s3_body import _PartsReader
from ckptstore.objectstore._s3_client import (
    _redact,
    aws_retry_settings,
    check_bucket_name,
    make_client,
    retry_policy,
)
from ckptstore.objectstore._s3_errors import (
    TruncatedResponseError,
    _code,
    _rejects_conditional,
    _status,
    classify,
)
from ckptstore.objectstore._s3_multipart import MultipartUploads
from ckptstore.objectstore._s3_reader import S3ObjectReader
from ckptstore.objectstore.base import (
    USABLE_PROBE_KEY,
    ObjectInfo,
    ObjectReader,
    ObjectStore,
    PutData,
    as_parts,
    check_key,
    clip_range,
    parts_size,
    uninitialized,
)
from ckptstore.objectstore.registry import StoreURL
from ckptstore.objectstore.remote import RemoteCaller, strip_userinfo

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

log = logging.getLogger("ckptstore.objectstore")
T = TypeVar("T")
B = TypeVar("B", bytearray, memoryview)
MiB = 1 << 20
#: Bytes asked of a response body per read. urllib3 reads each request into a temporary of
#: that size and copies it into our buffer: one whole-object read would allocate (and page in)
#: two more object-sized temporaries, at twice the client CPU per GiB of these cache-sized
#: steps (measured on SeaweedFS: 0.88 vs 0.42 CPU-s/GiB for 16 MiB objects).
_READ_STEP = 1 * MiB
#: Keys one DeleteObjects request may name (an S3 limit).
_DELETE_BATCH = 1000


class S3Store(MultipartUploads, ObjectStore):
    """Objects in ``s3://bucket/prefix``.

    Args:
        bucket: Bucket name; it must exist.
        prefix: Key prefix inside the bucket; every key of this store lives below it.
        endpoint_url: S3-compatible endpoint; default from boto3 (``AWS_ENDPOINT_URL``...).
        profile_name: boto3 profile for credentials and region.
        region_name: Region; default from boto3's configuration.
        addressing_style: ``"path"`` or ``"virtual"``; default ``"path"`` when an endpoint is
            configured (local servers rarely resolve bucket subdomains), else boto3's choice.
        multipart_threshold: Objects of at least this many bytes are uploaded in parts. The
            default sends every blob of the default writer (64 MiB chunks) in one PUT: each
            request costs botocore CPU, and 64 MiB in 8 MiB parts took 2.2x the client CPU of
            single PUTs (0.62 vs 0.28 CPU-s/GiB on SeaweedFS); the blob writer already uploads
            many objects at once, so per-object parallelism buys nothing.
        part_size: Size of each multipart part (S3 needs >= 5 MiB except the last); 32 MiB
            parts took 0.48 CPU-s/GiB where 8 MiB parts took 0.56.
        max_concurrency: Parts uploaded in parallel for one object.
        retry: Backoff policy for throttling, 5xx, timeouts and dropped connections. Default:
            ckptstore's, with boto3's ``max_attempts`` (``AWS_MAX_ATTEMPTS``) if that is set;
            boto3's ``retry_mode`` (``AWS_RETRY_MODE``) is the client's mode either way.
        connect_timeout, read_timeout: Socket timeouts in seconds, so a hung request fails
            (and is retried) instead of hanging training.
        conditional_writes: Use ``If-None-Match: *`` for idempotent creates. ``None`` probes:
            it is tried and turned off if the server rejects the header, falling back to
            HEAD then PUT.
        sign_payload: Put the SHA-256 of every request body into its signature. Off by
            default: botocore hashes each body once more for it (over plain http and, without
            a checksum header, over https too), about half a CPU-second per GiB, while the
            BLAKE3 digest that every blob carries is verified on every read, so a body changed
            on its way is caught there all the same. Turn it on for a server or bucket policy
            that refuses ``UNSIGNED-PAYLOAD`` (``x-amz-content-sha256``).
        client: A ready boto3 S3 client to use instead of building one (``addressing_style``,
            the timeouts and ``sign_payload`` then come from its own configuration).
    """

    write_bandwidth_hint = 1.5e8
    read_concurrency = 16
    probe_new_blobs = False  # a HEAD per new blob; put() never overwrites by itself
    remote = True  # a service every node reads over the network

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        profile_name: str | None = None,
        region_name: str | None = None,
        addressing_style: str | None = None,
        multipart_threshold: int = 128 * MiB,
        part_size: int = 32 * MiB,
        max_concurrency: int = 8,
        retry: RetryPolicy | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        conditional_writes: bool | None = None,
        sign_payload: bool = False,
        client: S3Client | None = None,
    ) -> None:
        check_bucket_name(bucket)
        if part_size < 5 * MiB:
            raise ConfigError("S3Store part_size must be at least 5 MiB (an S3 limit)")
        if multipart_threshold < part_size:
            raise ConfigError("S3Store multipart_threshold must be >= part_size")
        if max_concurrency < 1:
            raise ConfigError("S3Store max_concurrency must be >= 1")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        aws_retry = aws_retry_settings(profile_name)
        self.retry = retry_policy(retry, aws_retry, self.url)
        self._conditional = conditional_writes
        self._conditional_lock = threading.Lock()
        if client is None:
            client = make_client(
                endpoint_url=endpoint_url,
                profile_name=profile_name,
                region_name=region_name,
                addressing_style=addressing_style,
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                max_pool_connections=max(16, 2 * max_concurrency),
                sign_payload=sign_payload,
                retry_mode=aws_retry.mode,
            )
        self.client: S3Client = client
        self.endpoint = _redact(self.client.meta.endpoint_url)
        self._remote = RemoteCaller(
            classify=functools.partial(classify, bucket=self.bucket, endpoint=self.endpoint),
            policy=self.retry,
            endpoint=self.endpoint,
        )
        self._parts_pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="ckpt-s3-part")

    @property
    def url(self) -> str:
        """The store's URL, as ``open_store`` takes it."""
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- requests ---------------------------------------------------------------------------

    def _call(self, action: str, key: str, fn: Callable[[], T]) -> T:
        """Run one request with retries; a final failure becomes one of our errors."""
        return self._remote.call(action, f"{self.url}/{key}", fn)

    # -- contract ---------------------------------------------------------------------------

    def put(self, key: str, data: PutData) -> bool:
        """Create ``key`` with ``data`` (an existing key is success); True if this call made it."""
        full = self._key(key)
        parts = as_parts(data)
        size = parts_size(parts)
        if size >= self.multipart_threshold:
            return self._put_multipart(key, full, parts, size)
        if self._conditional is not False:
            created = self._put_conditional(key, full, parts, size)
            if created is not None:
                return created
        if self.exists(key):
            return False
        self._call("writing", key, lambda: self._put_object(full, parts, size, conditional=False))
        return True

    def _put_conditional(
        self, key: str, full: str, parts: list[memoryview], size: int
    ) -> bool | None:
        """True/False as ``put``; None if the server does not support conditional writes."""
        try:
            self._call("writing", key, lambda: self._put_object(full, parts, size, True))
        except ObjectStoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, bexc.ClientError):
                if _status(cause) == 412 or _code(cause) == "PreconditionFailed":
                    return False
                if self._conditional is None and _rejects_conditional(cause):
                    with self._conditional_lock:
                        self._conditional = False
                    return None
            raise
        return True

    def _put_object(
        self, full: str, parts: Sequence[memoryview], size: int, conditional: bool
    ) -> None:
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if conditional else {}
        self.client.put_object(
            Bucket=self.bucket,
            Key=full,
            Body=cast(Any, _PartsReader(parts)),
            ContentLength=size,
            **extra,
        )

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        """The object's bytes (or ``byte_range`` of them)."""
        full = self._key(key)
        if byte_range is not None:
            clip_range(byte_range, 1 << 62)  # validates the range
            if byte_range[0] == byte_range[1]:
                self.head(key)
                return bytearray()
        return self._call("reading", key, lambda: self._fetch(key, full, byte_range, bytearray))

    def get_view(self, key: str) -> memoryview:
        """The whole object, read straight into a buffer that is never zero-filled (the read is
        the first touch of its pages)."""
        full = self._key(key)
        return self._call("reading", key, lambda: self._fetch(key, full, None, uninitialized))

    def _fetch(
        self,
        key: str,
        full: str,
        byte_range: tuple[int, int] | None,
        allocate: Callable[[int], B],
    ) -> B:
        """One GET of ``key`` (bucket key ``full``) into a buffer from ``allocate(length)``,
        in steps of ``_READ_STEP``; a body that ends early raises TruncatedResponseError
        (transient: the caller's retry sends the GET again)."""
        extra: dict[str, Any] = {}
        if byte_range is not None:
            extra["Range"] = f"bytes={byte_range[0]}-{byte_range[1] - 1}"
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=full, **extra)
        except bexc.ClientError as exc:
            if _code(exc) == "InvalidRange":
                return allocate(0)
            raise
        length = response["ContentLength"]
        buf = allocate(length)
        view = memoryview(buf)
        body = response["Body"]
        got = 0
        try:
            while got < length:
                n = body.readinto(cast(Any, view[got : got + _READ_STEP]))
                if not n:
                    break
                got += n
        finally:
            body.close()
        if got != length:
            raise TruncatedResponseError(f"reading {self.url}/{key}: got {got} of {length} bytes")
        return buf

    @contextlib.contextmanager
    def open_reader(self, key: str) -> Iterator[ObjectReader]:
        """``key`` opened for reads at any offset (:class:`~.base.RandomAccess`): its first
        bytes in one small GET, then reads in order from one streamed ranged GET."""
        full = self._key(key)
        reader = S3ObjectReader(
            self.client,
            self.bucket,
            full,
            f"{self.url}/{key}",
            lambda fn: self._call("reading", key, fn),
        )
        try:
            yield reader
        finally:
            reader.close()

    def check_usable(self) -> None:
        """One GET of a key no object has: the bucket exists, the endpoint answers and the
        credentials are accepted. ``AccessDenied`` alone passes: credentials that may not list
        the bucket are refused a missing object rather than told it is missing, and may still
        read and write objects."""
        try:
            self._exists_by_get(USABLE_PROBE_KEY)
        except StoreNotFoundError as exc:
            raise StoreNotFoundError(
                f"store {self.url}: bucket {self.bucket!r} does not exist at {self.endpoint}; "
                f"create it (e.g. aws s3 mb s3://{self.bucket}, with --endpoint-url for a "
                "non-AWS server) or fix the store URL (--store / $CKPTSTORE_STORE)"
            ) from exc
        except StorePermissionError as exc:
            code = _cause_code(exc)
            if code == "AccessDenied":
                log.debug("%s: the usability check was denied (%s); going on", self.url, exc)
                return
            raise StorePermissionError(
                f"store {self.url}: access denied ({code or exc}) by {self.endpoint}, which "
                "refused the credentials; check the credentials boto3 finds (AWS_PROFILE, "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
            ) from exc
        except ObjectStoreError as exc:
            cause = exc.__cause__ or exc
            raise ObjectStoreError(
                f"store {self.url}: endpoint {self.endpoint} did not answer "
                f"({strip_userinfo(f'{type(cause).__name__}: {cause}')}); check the endpoint "
                "(the store option endpoint_url, AWS_ENDPOINT_URL) and that the server is up"
            ) from exc

    def _exists_by_get(self, key: str) -> bool:
        """Whether ``key`` exists, asked with a one-byte GET: unlike a HEAD, its error answer
        says which of the bucket and the key is missing."""
        full = self._key(key)
        try:
            self._call("checking", key, lambda: self._fetch(key, full, (0, 1), bytearray))
        except ObjectNotFoundError:
            return False
        return True

    def head(self, key: str) -> ObjectInfo:
        """The object's size and modification time."""
        full = self._key(key)
        response = self._call(
            "checking", key, lambda: self.client.head_object(Bucket=self.bucket, Key=full)
        )
        return ObjectInfo(
            key=key, size=response["ContentLength"], mtime=response["LastModified"].timestamp()
        )

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (missing ones are fine): one DeleteObjects request per 1,000 keys
        (the S3 limit), one after the other. Sending them concurrently was slower on SeaweedFS
        here (770 against 1,560 keys/s on 2 cores: the server does the work), and a GC batch
        holds the GC lock while it waits, so its size, not concurrency, bounds the wait."""
        batch: list[str] = []
        for key in keys:
            batch.append(key)
            if len(batch) == _DELETE_BATCH:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, keys: list[str]) -> None:
        objects = [{"Key": self._key(k)} for k in keys]
        response = self._call(
            "deleting",
            keys[0],
            lambda: self.client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": objects, "Quiet": True},  # type: ignore[typeddict-item]
            ),
        )
        errors = [e for e in response.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            first = errors[0]
            raise ObjectStoreError(
                f"deleting {len(errors)} objects from {self.url} failed, e.g. "
                f"{first.get('Key')}: {first.get('Code')}: {first.get('Message')}"
            )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (GC and fsck only, never on the save or resume path)."""
        root = f"{self.prefix}/" if self.prefix else ""
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": root + prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._list_page(prefix, kwargs)
            for item in page.get("Contents", []):
                yield ObjectInfo(
                    key=item["Key"][len(root) :],
                    size=item["Size"],
                    mtime=item["LastModified"].timestamp(),
                )
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def _list_page(self, prefix: str, kwargs: dict[str, Any]) -> Any:
        return self._call("listing", prefix or "", lambda: self.client.list_objects_v2(**kwargs))

    def close(self) -> None:
        """Release the clients and threads."""
        self._parts_pool.shutdown(wait=True)
        self.client.close()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint!r})"


def _cause_code(exc: BaseException) -> str:
    """The S3 error code of the botocore error behind ``exc``, or ``""``."""
    cause = exc.__cause__
    return _code(cause) if isinstance(cause, bexc.ClientError) else ""


def open_s3_url(url: StoreURL, *, create: bool, **options: Any) -> S3Store:
    """The store at ``s3://bucket/prefix``; it never creates its bucket, whatever ``create``."""
    if not url.parts.netloc:
        raise ConfigError(
            f"store URL '{printable(url.text)}' has no bucket: use s3://bucket/prefix"
        )
    return S3Store(url.parts.netloc, url.path.strip("/"), **options)
