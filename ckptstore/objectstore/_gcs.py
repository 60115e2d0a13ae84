"""GCSStore: Google Cloud Storage (``gs://bucket/prefix``) through the official client library,
``google-cloud-storage``, with the contract of the S3 store (DESIGN.md §3).

The client library finds the credentials (Application Default Credentials; anonymous towards an
emulator named by ``STORAGE_EMULATOR_HOST``) and the endpoint, and holds the authorized HTTP
session. The requests themselves are the GCS JSON API's, sent over that session by this module,
because the library's own transfers copy every object (a multipart upload joins it into one
request body; a download collects it in a ``BytesIO``) and retry by restarting: here bodies are
read from and written into the caller's buffers, and every request runs through one
:class:`~ckptstore.objectstore.remote.RemoteCaller` (ckptstore's retries;
:func:`._gcs_errors.classify` is all it is told about failures). The library's retries are
never used.

Create-if-absent is GCS's own: every upload carries ``ifGenerationMatch=0``. A server that
ignores that precondition (gcp-storage-emulator does) is found by a probe at the first write
and then written with a check first (HEAD, then PUT), which two racing writers can both pass;
a warning says so. See docs/gcs.md.

Split by job: this module is the contract; :mod:`._gcs_upload` sends objects (one request, or a
resumable upload in chunks); :mod:`._gcs_reader` reads them; :mod:`._gcs_client` checks the
configuration and builds the client; :mod:`._gcs_errors` sorts the failures.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar
from urllib.parse import quote

from ckptstore.errors import (
    ConfigError,
    ObjectNotFoundError,
    ObjectStoreError,
    StoreNotFoundError,
    StorePermissionError,
)
from ckptstore.names import printable
from ckptstore.objectstore._gcs_batch import delete_batch
from ckptstore.objectstore._gcs_client import check_bucket_name, make_client
from ckptstore.objectstore._gcs_errors import classify, raise_for_answer
from ckptstore.objectstore._gcs_reader import GCSObjectReader, fetch, media_url
from ckptstore.objectstore._gcs_upload import (
    CHUNK_QUANTUM,
    ResumableUpload,
    precondition_failed,
    put_single,
)
from ckptstore.objectstore._retry import RetryPolicy
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

log = logging.getLogger("ckptstore.objectstore")
T = TypeVar("T")
MiB = 1 << 20
#: Calls one batch request may carry (a GCS limit).
_DELETE_BATCH = 100
#: Objects one list request asks for (the most GCS returns).
_LIST_PAGE = 1000
#: Name stem of the object the conditional-write probe tries (and, on a conforming server,
#: fails) to create.
_CONDITIONAL_PROBE = "ckptstore-conditional-probe"


class GCSStore(ObjectStore):
    """Objects in ``gs://bucket/prefix``.

    Args:
        bucket: Bucket name; it must exist (the store never creates it).
        prefix: Object-name prefix inside the bucket; every key of this store lives below it.
        endpoint_url: The JSON API's endpoint; default ``STORAGE_EMULATOR_HOST`` if set, else
            ``https://storage.googleapis.com``.
        project: The project for the client (objects need none); default ADC's.
        anonymous: Send unsigned requests. Default: only towards ``STORAGE_EMULATOR_HOST``
            (an emulator; ``endpoint_url`` unset or the same URL); otherwise Application
            Default Credentials.
        resumable_threshold: Objects of at least this many bytes go up in a resumable upload
            (a chunk that fails is resent alone); smaller ones in one request. Either way the
            bytes are sent from the caller's buffers, never copied.
        chunk_size: Bytes per request of a resumable upload, a multiple of 256 KiB.
        retry: Backoff policy for throttling (429), 408/5xx, timeouts and dropped connections.
        connect_timeout, read_timeout: Socket timeouts in seconds, so a hung request fails
            (and is retried) instead of hanging training.
        conditional_writes: Whether the server honours ``ifGenerationMatch`` (GCS does).
            ``None`` probes it once, at the first write: one request that GCS refuses and that
            writes nothing there.
        pool_size: HTTP connections kept open (reads and writes run on many threads).
        client: A ready ``google.cloud.storage.Client`` to use instead of building one.
    """

    write_bandwidth_hint = 1.5e8
    read_concurrency = 16
    probe_new_blobs = False  # put() never overwrites by itself
    remote = True  # a service every node reads over the network

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        project: str | None = None,
        anonymous: bool | None = None,
        resumable_threshold: int = 64 * MiB,
        chunk_size: int = 32 * MiB,
        retry: RetryPolicy | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        conditional_writes: bool | None = None,
        pool_size: int = 32,
        client: Any = None,
    ) -> None:
        check_bucket_name(bucket)
        if chunk_size < CHUNK_QUANTUM or chunk_size % CHUNK_QUANTUM:
            raise ConfigError(
                f"GCSStore chunk_size={chunk_size} must be a positive multiple of 256 KiB "
                "(a GCS limit), e.g. 32 MiB"
            )
        if resumable_threshold < chunk_size:
            raise ConfigError("GCSStore resumable_threshold must be >= chunk_size")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.resumable_threshold = resumable_threshold
        self.chunk_size = chunk_size
        self.retry = retry or RetryPolicy()
        self._timeout = (connect_timeout, read_timeout)
        self._conditional = conditional_writes
        self._conditional_lock = threading.Lock()
        if client is None:
            client = make_client(
                endpoint_url=endpoint_url, project=project, anonymous=anonymous, pool_size=pool_size
            )
        self.client = client
        self.endpoint = strip_userinfo(str(client.api_endpoint).rstrip("/"))
        self._session = client._http
        self._remote = RemoteCaller(
            classify=functools.partial(classify, bucket=bucket, endpoint=self.endpoint),
            policy=self.retry,
            endpoint=self.endpoint,
        )

    @property
    def url(self) -> str:
        """The store's URL, as ``open_store`` takes it."""
        return f"gs://{self.bucket}/{self.prefix}" if self.prefix else f"gs://{self.bucket}"

    def _name(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, action: str, key: str, fn: Callable[[], T]) -> T:
        """Run one request with retries; a final failure becomes one of our errors."""
        return self._remote.call(action, f"{self.url}/{key}", fn)

    def _object_url(self, name: str) -> str:
        return (
            f"{self.endpoint}/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(name, safe='')}"
        )

    # -- writes -------------------------------------------------------------------------------

    def put(self, key: str, data: PutData) -> bool:
        """Create ``key`` with ``data`` (an existing key is success); True if this call made it."""
        name = self._name(key)
        parts = as_parts(data)
        size = parts_size(parts)
        conditional = self._conditional_writes()
        if (size >= self.resumable_threshold or not conditional) and self.exists(key):
            # Before a big upload a HEAD is far cheaper than sending it all to be refused.
            return False
        try:
            if size >= self.resumable_threshold:
                upload = ResumableUpload(
                    self._session,
                    self.endpoint,
                    self.bucket,
                    name,
                    parts,
                    size,
                    chunk_size=self.chunk_size,
                    conditional=conditional,
                    timeout=self._timeout,
                )
                upload.run(lambda action, fn: self._call(action, key, fn))
            else:
                self._call(
                    "writing",
                    key,
                    lambda: put_single(
                        self._session,
                        self.endpoint,
                        self.bucket,
                        name,
                        parts,
                        size,
                        if_generation_match=0 if conditional else None,
                        timeout=self._timeout,
                    ),
                )
        except ObjectStoreError as exc:
            if conditional and precondition_failed(exc):
                return False
            raise
        return True

    def _conditional_writes(self) -> bool:
        """Whether uploads can carry ``ifGenerationMatch=0``, probed once if not configured."""
        if self._conditional is None:
            with self._conditional_lock:
                if self._conditional is None:
                    self._conditional = self._probe_conditional()
        return self._conditional

    def _probe_conditional(self) -> bool:
        """Try to create an empty object "if its generation is 1": GCS refuses (no object has
        it), writing nothing. A server that creates it ignores preconditions: it is deleted,
        and a warning names the consequence."""
        key = f"{_CONDITIONAL_PROBE}-{uuid.uuid4().hex}"
        name = self._name(key)
        try:
            self._call(
                "checking conditional writes with",
                key,
                lambda: put_single(
                    self._session,
                    self.endpoint,
                    self.bucket,
                    name,
                    [],
                    0,
                    if_generation_match=1,
                    timeout=self._timeout,
                ),
            )
        except ObjectStoreError as exc:
            if precondition_failed(exc):
                return True
            raise
        self.delete([key])
        log.warning(
            "%s: the server at %s ignores GCS preconditions (ifGenerationMatch), as "
            "gcp-storage-emulator does: objects are written after a check that they do not "
            "exist, so two writers racing to create one object can both write it (harmless "
            "for content-addressed blobs: their bytes are the same). Real GCS honours them.",
            self.url,
            self.endpoint,
        )
        return False

    # -- reads --------------------------------------------------------------------------------

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        """The object's bytes (or ``byte_range`` of them)."""
        url = media_url(self.endpoint, self.bucket, self._name(key))
        if byte_range is not None:
            clip_range(byte_range, 1 << 62)  # validates the range
            if byte_range[0] == byte_range[1]:
                self.head(key)
                return bytearray()
        where = f"{self.url}/{key}"
        return self._call(
            "reading",
            key,
            lambda: fetch(self._session, url, byte_range, bytearray, where, self._timeout),
        )

    def get_view(self, key: str) -> memoryview:
        """The whole object, read straight into a buffer that is never zero-filled."""
        url = media_url(self.endpoint, self.bucket, self._name(key))
        where = f"{self.url}/{key}"
        return self._call(
            "reading",
            key,
            lambda: fetch(self._session, url, None, uninitialized, where, self._timeout),
        )

    @contextlib.contextmanager
    def open_reader(self, key: str) -> Iterator[ObjectReader]:
        """``key`` opened for reads at any offset (:class:`~.base.RandomAccess`)."""
        url = media_url(self.endpoint, self.bucket, self._name(key))
        reader = GCSObjectReader(
            self._session,
            url,
            f"{self.url}/{key}",
            lambda fn: self._call("reading", key, fn),
            self._timeout,
        )
        try:
            yield reader
        finally:
            reader.close()

    def head(self, key: str) -> ObjectInfo:
        """The object's size and modification time."""
        url = self._object_url(self._name(key))
        resource = self._call(
            "checking", key, lambda: self._get_json(url, {"fields": "size,updated"})
        )
        return ObjectInfo(
            key=key, size=int(resource["size"]), mtime=_timestamp(resource["updated"])
        )

    def _get_json(self, url: str, params: dict[str, str]) -> Any:
        response = self._session.get(url, params=params, timeout=self._timeout)
        raise_for_answer(response)
        try:
            return response.json()
        finally:
            response.close()

    def check_usable(self) -> None:
        """One request for an object no store has, and, if that finds nothing, one for the
        bucket: the bucket exists, the endpoint answers and the credentials are accepted.
        Credentials that may not read the bucket's metadata (403 there) pass: they may still
        read and write objects."""
        try:
            self.head(USABLE_PROBE_KEY)
        except ObjectNotFoundError:
            self._check_bucket()
        except StorePermissionError as exc:
            raise StorePermissionError(f"store {self.url}: {exc}") from exc
        except StoreNotFoundError:
            raise
        except ObjectStoreError as exc:
            raise ObjectStoreError(
                f"store {self.url}: endpoint {self.endpoint} did not answer ({exc}); "
                "check the endpoint (the store option endpoint_url, STORAGE_EMULATOR_HOST) and "
                "that the server is up"
            ) from exc

    def _check_bucket(self) -> None:
        url = f"{self.endpoint}/storage/v1/b/{quote(self.bucket, safe='')}"
        try:
            self._call(
                "checking the bucket of", "", lambda: self._get_json(url, {"fields": "name"})
            )
        except ObjectNotFoundError as exc:
            raise StoreNotFoundError(
                f"store {self.url}: bucket {self.bucket!r} does not exist at {self.endpoint}; "
                f"create it (gcloud storage buckets create gs://{self.bucket}) or fix the store "
                "URL (--store / $CKPTSTORE_STORE)"
            ) from exc
        except StorePermissionError as exc:
            log.debug("%s: the bucket check was denied (%s); going on", self.url, exc)

    # -- namespace ----------------------------------------------------------------------------

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (missing ones are fine): one batch request per 100 keys (the GCS
        limit), one after the other."""
        batch: list[str] = []
        for key in keys:
            batch.append(self._name(key))
            if len(batch) == _DELETE_BATCH:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, names: list[str]) -> None:
        first = names[0][len(self.prefix) + 1 :] if self.prefix else names[0]
        self._call(
            "deleting",
            first,
            lambda: delete_batch(self._session, self.endpoint, self.bucket, names, self._timeout),
        )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (GC and fsck only, never on the save or resume path)."""
        root = f"{self.prefix}/" if self.prefix else ""
        url = f"{self.endpoint}/storage/v1/b/{quote(self.bucket, safe='')}/o"
        params = {
            "prefix": root + prefix,
            "maxResults": str(_LIST_PAGE),
            "fields": "items(name,size,updated),nextPageToken",
        }
        while True:
            page = self._call(
                "listing", prefix, functools.partial(self._get_json, url, dict(params))
            )
            for item in page.get("items") or []:
                yield ObjectInfo(
                    key=item["name"][len(root) :],
                    size=int(item["size"]),
                    mtime=_timestamp(item["updated"]),
                )
            token = page.get("nextPageToken")
            if not token:
                return
            params["pageToken"] = token

    def close(self) -> None:
        """Release the client's connections."""
        self.client.close()

    def __repr__(self) -> str:
        return f"GCSStore({self.url!r}, endpoint={self.endpoint!r})"


def _timestamp(rfc3339: str) -> float:
    """Seconds since the epoch of GCS's ``2026-12-07T21:06:38.123Z``."""
    return dt.datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def open_gcs_url(url: StoreURL, *, create: bool, **options: Any) -> GCSStore:
    """The store at ``gs://bucket/prefix``; it never creates its bucket, whatever ``create``."""
    if not url.parts.netloc:
        raise ConfigError(
            f"store URL '{printable(url.text)}' has no bucket: use gs://bucket/prefix"
        )
    if url.parts.query or url.parts.fragment:
        raise ConfigError(
            f"store URL '{printable(url.text)}' has a query or fragment: use gs://bucket/prefix "
            "(store options go to open_store as keyword arguments)"
        )
    return GCSStore(url.parts.netloc, url.path.strip("/"), **options)
