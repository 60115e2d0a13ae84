"""AzureStore: Azure Blob Storage (or the Azurite emulator) through azure-storage-blob.

Credentials come only from Azure's usual places (:mod:`._azure_client`); this module never
stores or prints them. The SDK's own retries are turned off so that one policy covers every
request: every request goes through a :class:`~ckptstore.objectstore.remote.RemoteCaller`, and
:func:`~._azure_errors.classify` is all this module tells it about the SDK's exceptions.

The store is split by job: this module is its face (the contract's calls, single Put Blobs and
GETs); :mod:`._azure_blocks` uploads big blobs as staged blocks; :mod:`._azure_reader` reads a
blob in pieces; :mod:`._azure_client` checks the configuration and builds the SDK client;
:mod:`._azure_errors` sorts the SDK's exceptions.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar, cast

from azure.core.exceptions import HttpResponseError

from ckptstore.errors import (
    ConfigError,
    ObjectNotFoundError,
    ObjectStoreError,
    StoreNotFoundError,
    StorePermissionError,
)
from ckptstore.names import printable
from ckptstore.objectstore._azure_blocks import BlockUploads, list_page
from ckptstore.objectstore._azure_client import (
    MAX_PUT_BLOB,
    check_container_name,
    make_service_client,
    redact_url,
)
from ckptstore.objectstore._azure_errors import (
    CREDENTIALS_HINT,
    TruncatedResponseError,
    classify,
    is_exists_answer,
)
from ckptstore.objectstore._azure_reader import AzureObjectReader, ViewWriter, is_invalid_range
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

if TYPE_CHECKING:
    from azure.storage.blob import BlobClient, BlobServiceClient

log = logging.getLogger("ckptstore.objectstore")
T = TypeVar("T")
B = TypeVar("B", bytearray, memoryview)
MiB = 1 << 20
#: Deletes in one Blob Batch request (the service's limit).
_BATCH = 256
#: Single deletes sent at once where batches are refused.
_DELETE_THREADS = 16


class AzureStore(BlockUploads, ObjectStore):
    """Objects in ``az://container/prefix``.

    Args:
        container: Container name; it must exist (the store never creates it).
        prefix: Name prefix inside the container; every key of this store lives below it.
        account_url: The Blob service endpoint, e.g. ``https://acct.blob.core.windows.net``
            (or Azurite's ``http://127.0.0.1:10000/devstoreaccount1``); default from the
            connection string or the account name.
        endpoint_url: The same as ``account_url``, under S3Store's name for it: code that
            reopens a store from its URL and ``endpoint`` (a background process, a rank)
            works on either backend.
        account_name: Storage account; default ``AZURE_STORAGE_ACCOUNT_NAME``.
        connection_string: Default ``AZURE_STORAGE_CONNECTION_STRING``.
        credential: Any credential the SDK takes (a key, a ``TokenCredential``...); default
            the account key or SAS token from the environment, else ``DefaultAzureCredential``.
        block_threshold: Blobs of at least this many bytes go up as staged blocks, committed
            with ``If-None-Match: *``; smaller ones in one Put Blob (also ``If-None-Match:
            *``). Blocks are sent from views of the caller's buffers, while a Put Blob of a
            blob given in pieces (header and payload) sends one joined copy (the SDK takes one
            ``bytes``): the threshold bounds that copy. The default writer's 64 MiB chunks go
            as blocks (no copy, 3 at once); its packs (16 MiB at most) in one Put Blob.
        block_size: Largest staged block; a blob is cut into equal blocks of at most this.
        max_concurrency: Blocks staged at once per store, and chunks of one download.
        retry: Backoff policy for throttling (503 ServerBusy, 429), 5xx, timeouts and dropped
            connections; permanent answers (a missing container, refused credentials) are
            never retried.
        connect_timeout, read_timeout: Socket timeouts in seconds, so a hung request fails
            (and is retried) instead of hanging training.
        service_client: A ready ``BlobServiceClient`` to use instead of building one.
    """

    remote = True  # a service every node reads over the network
    write_bandwidth_hint = 1.5e8
    read_concurrency = 16
    probe_new_blobs = False  # a HEAD per new blob; put() never overwrites by itself

    def __init__(
        self,
        container: str,
        prefix: str = "",
        *,
        account_url: str | None = None,
        endpoint_url: str | None = None,
        account_name: str | None = None,
        connection_string: str | None = None,
        credential: Any = None,
        block_threshold: int = 32 * MiB,
        block_size: int = 32 * MiB,
        max_concurrency: int = 4,
        retry: RetryPolicy | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        service_client: BlobServiceClient | None = None,
    ) -> None:
        check_container_name(container)
        if not 1 <= block_size <= 4000 * MiB:
            raise ConfigError("AzureStore block_size must be 1 byte to 4000 MiB (an Azure limit)")
        if not 1 <= block_threshold <= MAX_PUT_BLOB + 1:
            raise ConfigError("AzureStore block_threshold must be 1 byte to 5000 MiB + 1")
        if max_concurrency < 1:
            raise ConfigError("AzureStore max_concurrency must be >= 1")
        if endpoint_url is not None and account_url not in (None, endpoint_url):
            raise ConfigError("AzureStore: give account_url or endpoint_url, not both")
        account_url = account_url or endpoint_url
        self.container = container
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.block_threshold = block_threshold
        self.block_size = block_size
        self.max_concurrency = max_concurrency
        self.retry = retry or RetryPolicy()
        if service_client is None:
            service_client = make_service_client(
                account_url=account_url,
                account_name=account_name,
                connection_string=connection_string,
                credential=credential,
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                # Every reading thread's parallel chunks, and the staged blocks, at once.
                max_connections=(self.read_concurrency + 2) * max_concurrency,
            )
        # A given client's upload_blob must stay one Put Blob below the threshold: above its
        # max_single_put_size the SDK uploads blocks named by offset (see _azure_blocks).
        single = getattr(getattr(service_client, "_config", None), "max_single_put_size", None)
        if isinstance(single, int) and single < block_threshold - 1:
            raise ConfigError(
                f"AzureStore: the given service_client sends Put Blobs of at most {single} "
                f"bytes, below block_threshold={block_threshold}: build it with "
                f"max_single_put_size={block_threshold - 1} or more, or lower block_threshold"
            )
        self.service = service_client
        self.client = service_client.get_container_client(container)
        self.endpoint = redact_url(service_client.url)
        self._remote = RemoteCaller(
            classify=functools.partial(classify, container=container, endpoint=self.endpoint),
            policy=self.retry,
            endpoint=self.endpoint,
        )
        self._blocks_pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="ckpt-az-block")
        #: Whether deletes go in Blob Batch requests; False once the account refused one.
        self._batches = True

    @property
    def url(self) -> str:
        """The store's URL, as ``open_store`` takes it."""
        return f"az://{self.container}/{self.prefix}" if self.prefix else f"az://{self.container}"

    def _name(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _blob(self, key: str) -> BlobClient:
        return self.client.get_blob_client(self._name(key))

    def _call(self, action: str, key: str, fn: Callable[[], T]) -> T:
        """Run one request with retries; a final failure becomes one of our errors."""
        return self._remote.call(action, f"{self.url}/{key}", fn)

    # -- contract ---------------------------------------------------------------------------

    def put(self, key: str, data: PutData) -> bool:
        """Create ``key`` with ``data`` (an existing key is success); True if this call made it."""
        blob = self._blob(key)
        parts = as_parts(data)
        size = parts_size(parts)
        if size >= self.block_threshold:
            return self._put_blocks(key, blob, parts, size)
        body = _one_buffer(parts)
        try:
            # overwrite=False is Put Blob with If-None-Match: *: the service refuses the write
            # of a name that exists, atomically.
            self._call("writing", key, lambda: blob.upload_blob(body, length=size, overwrite=False))
        except ObjectStoreError as exc:
            if is_exists_answer(exc):
                return False
            raise
        return True

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        """The object's bytes (or ``byte_range`` of them)."""
        blob = self._blob(key)
        if byte_range is not None:
            clip_range(byte_range, 1 << 62)  # validates the range
            if byte_range[0] == byte_range[1]:
                self.head(key)
                return bytearray()
        return self._call("reading", key, lambda: self._fetch(key, blob, byte_range, bytearray))

    def get_view(self, key: str) -> memoryview:
        """The whole object, downloaded straight into a buffer that is never zero-filled."""
        blob = self._blob(key)
        return self._call("reading", key, lambda: self._fetch(key, blob, None, uninitialized))

    def _fetch(
        self,
        key: str,
        blob: BlobClient,
        byte_range: tuple[int, int] | None,
        allocate: Callable[[int], B],
    ) -> B:
        """One download of ``key`` into a buffer from ``allocate(length)``: the first 8 MiB in
        one GET, the rest in 8 MiB ranged GETs, ``max_concurrency`` at once, each written at
        its offset. A download that comes up short raises TruncatedResponseError (transient:
        the caller's retry downloads again)."""
        offset, length = (None, None) if byte_range is None else byte_range
        if length is not None and offset is not None:
            length -= offset
        try:
            download = blob.download_blob(
                offset=offset, length=length, max_concurrency=self.max_concurrency
            )
        except Exception as exc:
            if is_invalid_range(exc):
                return allocate(0)
            raise
        size = int(download.size)
        buf = allocate(size)
        writer = ViewWriter(memoryview(buf))
        got = download.readinto(cast(Any, writer))
        if got != size or writer.end != size:
            raise TruncatedResponseError(f"reading {self.url}/{key}: got {got} of {size} bytes")
        return buf

    @contextlib.contextmanager
    def open_reader(self, key: str) -> Iterator[ObjectReader]:
        """``key`` opened for reads at any offset (:class:`~.base.RandomAccess`): its first
        bytes in one small GET, then reads in order from one download."""
        reader = AzureObjectReader(
            self._blob(key), f"{self.url}/{key}", lambda fn: self._call("reading", key, fn)
        )
        try:
            yield reader
        finally:
            reader.close()

    def head(self, key: str) -> ObjectInfo:
        """The object's size and modification time."""
        blob = self._blob(key)
        props = self._call("checking", key, blob.get_blob_properties)
        return ObjectInfo(key=key, size=int(props.size), mtime=props.last_modified.timestamp())

    def check_usable(self) -> None:
        """One HEAD of a blob no object has: the container exists, the endpoint answers and the
        credentials are accepted; each failure is one line naming the fix."""
        try:
            self.exists(USABLE_PROBE_KEY)
        except StoreNotFoundError as exc:
            raise StoreNotFoundError(
                f"store {self.url}: container {self.container!r} does not exist at "
                f"{self.endpoint}; create it (az storage container create --name "
                f"{self.container}) or fix the store URL (--store / $CKPTSTORE_STORE)"
            ) from exc
        except StorePermissionError as exc:
            raise StorePermissionError(
                f"store {self.url}: {self.endpoint} refused the credentials "
                f"({_cause_text(exc)}); {CREDENTIALS_HINT}"
            ) from exc
        except ObjectStoreError as exc:
            raise ObjectStoreError(
                f"store {self.url}: endpoint {self.endpoint} did not answer "
                f"({_cause_text(exc)}); check the endpoint (the connection string's "
                "BlobEndpoint, the store option account_url) and that the service is up"
            ) from exc

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (missing ones are fine): one Blob Batch request per 256 keys (the
        service's limit); an account that refuses batches (one with a hierarchical namespace)
        gets single deletes, 16 at a time."""
        batch: list[tuple[str, str]] = []
        for key in keys:
            batch.append((key, self._name(key)))
            if len(batch) == _BATCH:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, batch: list[tuple[str, str]]) -> None:
        if self._batches:
            names = [name for _, name in batch]
            try:
                results = self._call(
                    "deleting",
                    batch[0][0],
                    lambda: list(self.client.delete_blobs(*names, raise_on_any_failure=False)),
                )
            except ObjectStoreError as exc:
                if type(exc) is not ObjectStoreError or _is_network(exc):
                    raise  # a missing container, refused credentials, no answer
                log.debug("%s: batch delete refused (%s); deleting one by one", self.url, exc)
                self._batches = False
            else:
                # 202 deleted, 404 absent; anything else is tried again alone (and reported).
                batch = [
                    kn
                    for kn, r in zip(batch, results, strict=True)
                    if r.status_code not in (202, 404)
                ]
        if batch:
            with ThreadPoolExecutor(_DELETE_THREADS, thread_name_prefix="ckpt-az-del") as pool:
                list(pool.map(lambda kn: self._delete_one(*kn), batch))

    def _delete_one(self, key: str, name: str) -> None:
        blob = self.client.get_blob_client(name)
        with contextlib.suppress(ObjectNotFoundError):
            self._call("deleting", key, blob.delete_blob)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (GC and fsck only, never on the save or resume path).
        Uncommitted blocks are not blobs: a blob being uploaded is listed once committed."""
        root = f"{self.prefix}/" if self.prefix else ""
        token: str | None = None
        while True:
            items, token = self._call(
                "listing", prefix, functools.partial(list_page, self.client, root + prefix, token)
            )
            for item in items:
                yield ObjectInfo(
                    key=item.name[len(root) :],
                    size=int(item.size),
                    mtime=item.last_modified.timestamp(),
                )
            if not token:
                return

    def close(self) -> None:
        """Release the clients and threads."""
        self._blocks_pool.shutdown(wait=True)
        self.client.close()
        self.service.close()

    def __repr__(self) -> str:
        return f"AzureStore({self.url!r}, endpoint={self.endpoint!r})"


def _one_buffer(parts: Sequence[memoryview]) -> bytes:
    """``parts`` as one ``bytes``, the only body the SDK's Put Blob takes: the caller's own
    ``bytes`` when it gave one whole, else one copy."""
    if len(parts) == 1:
        obj = parts[0].obj
        if isinstance(obj, bytes) and len(obj) == parts[0].nbytes:
            return obj
    return b"".join(parts)


def _is_network(exc: ObjectStoreError) -> bool:
    """Whether ``exc`` reports no answer at all (rather than an answer refusing the request)."""
    cause = exc.__cause__
    return not isinstance(cause, HttpResponseError) or not cause.status_code


def _cause_text(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return strip_userinfo(
        f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    )


def open_azure_url(url: StoreURL, *, create: bool, **options: Any) -> AzureStore:
    """The store at ``az://container/prefix``; it never creates its container, whatever
    ``create`` says (creating one is an account-level decision: access level, policies)."""
    if not url.parts.netloc:
        raise ConfigError(
            f"store URL '{printable(url.text)}' has no container: use az://container/prefix"
        )
    if "@" in url.parts.netloc or ":" in url.parts.netloc:
        raise ConfigError(
            f"store URL '{printable(strip_userinfo(url.text))}': use az://container/prefix and "
            "give the "
            "account through AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_NAME or "
            "the store option account_url"
        )
    return AzureStore(url.parts.netloc, url.path.strip("/"), **options)
