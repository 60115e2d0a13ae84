"""AzureStore's failures on a real Azurite: permanent ones (a missing container, a refused key, no
credential, an unreachable endpoint, a bad URL) end at once with one line naming the fix and no
secret; transient ones (dropped connections, injected below the SDK at its transport) are
retried; ``create=False`` creates nothing."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import pytest
from azure.core.exceptions import HttpResponseError, IncompleteReadError, ServiceResponseError
from azure.storage.blob import BlobServiceClient
from azureserver import ACCOUNT_KEY, AzureStoreFactory

from ckptstore.errors import (
    ConfigError,
    ObjectStoreError,
    StoreNotFoundError,
    StorePermissionError,
)
from ckptstore.objectstore import RetryPolicy, open_store
from ckptstore.objectstore._azure import AzureStore
from ckptstore.objectstore._azure_client import MAX_PUT_BLOB
from ckptstore.objectstore._azure_errors import classify
from ckptstore.objectstore.remote import Kind
from ckptstore.testing.factories import MiB, pattern

#: The store's default policy (8 attempts, up to 5 s apart): a permanent error that were
#: retried under it would take seconds; these must end at once.
DEFAULT_RETRY = RetryPolicy()


class DropConnections:
    """Drops the connection (as a reset would) of the first ``count`` requests of ``method``:
    the SDK's ``raw_request_hook``, called in its pipeline just before a request is sent."""

    def __init__(self, count: int, method: str = "") -> None:
        self.left, self.method, self.seen = count, method, 0
        self._lock = threading.Lock()

    def __call__(self, request: Any) -> None:
        with self._lock:
            if not self.left or (self.method and request.http_request.method != self.method):
                return
            self.left -= 1
            self.seen += 1
        raise ServiceResponseError("Connection reset by peer (injected by the test)")


def flaky_store(factory: AzureStoreFactory, drops: DropConnections, **options: Any) -> AzureStore:
    client = BlobServiceClient.from_connection_string(
        factory.endpoint.connection_string,
        retry_total=0,
        raw_request_hook=drops,
        max_single_put_size=MAX_PUT_BLOB,
    )
    return factory(service_client=client, **options)


def test_missing_container_fails_at_once_naming_the_fix(
    azure_store_factory: AzureStoreFactory,
) -> None:
    store = azure_store_factory(container="no-such-container", retry=DEFAULT_RETRY)
    start = time.monotonic()
    with pytest.raises(StoreNotFoundError) as info:
        store.check_usable()
    message = str(info.value)
    assert "az://no-such-container/" in message
    assert "az storage container create --name no-such-container" in message
    assert "\n" not in message
    with pytest.raises(StoreNotFoundError, match="container 'no-such-container' does not exist"):
        store.put("k", b"v")
    with pytest.raises(StoreNotFoundError):
        store.get("k")
    assert time.monotonic() - start < 3


def test_refused_key_is_a_permission_error_without_the_key(
    azure_store_factory: AzureStoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = ACCOUNT_KEY[:-8] + "AAAAAAA="
    connection = azure_store_factory.endpoint.connection_string.replace(ACCOUNT_KEY, wrong)
    store = azure_store_factory(connection_string=connection, retry=DEFAULT_RETRY)
    start = time.monotonic()
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(StorePermissionError) as usable:
            store.check_usable()
        with pytest.raises(StorePermissionError) as put:
            store.put("k", b"v")
    assert time.monotonic() - start < 3
    for message in (str(usable.value), str(put.value)):
        assert "AZURE_STORAGE_CONNECTION_STRING" in message
        assert "\n" not in message
        assert wrong not in message
        assert ACCOUNT_KEY not in message
    assert wrong not in caplog.text
    assert ACCOUNT_KEY not in caplog.text


def test_no_credential_at_all_names_where_credentials_come_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An account name without a key signs in with DefaultAzureCredential; where none of its
    sources has a credential, the first request says so at once (no retries)."""
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "nosuchaccount")
    start = time.monotonic()
    with open_store("az://ckpt/run-1", retry=DEFAULT_RETRY) as store:
        assert store.endpoint == "https://nosuchaccount.blob.core.windows.net"
        with pytest.raises(StorePermissionError, match="no usable Azure credential") as info:
            store.put("k", b"v")
    assert "az login" in str(info.value)
    assert time.monotonic() - start < 5


def test_no_account_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="AZURE_STORAGE_CONNECTION_STRING"):
        open_store("az://ckpt/run-1")


def test_unreachable_endpoint_names_it() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={ACCOUNT_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;"
    )
    retry = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05)
    store = open_store("az://ckpt/p", connection_string=connection, retry=retry)
    with store, pytest.raises(ObjectStoreError) as info:
        store.check_usable()
    assert f"http://127.0.0.1:{port}/devstoreaccount1 did not answer" in str(info.value)
    assert ACCOUNT_KEY not in str(info.value)


def test_malformed_connection_string_is_not_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountKey=sekrit-value-123")
    with pytest.raises(ConfigError, match="AZURE_STORAGE_CONNECTION_STRING is malformed") as info:
        open_store("az://ckpt/p")
    assert "sekrit" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("az://", "has no container"),
        ("az://Upper/p", "invalid Azure container name 'Upper'"),
        ("az://ab/p", "3-63 characters"),
        ("az://a--b/p", "single '-'"),
        ("az://user:pw@ckpt/p", "use az://container/prefix"),
        ("az://ckpt/../x", "invalid object key"),
    ],
)
def test_bad_urls_are_config_errors(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        open_store(url)
    assert "pw" not in str(info.value)


@pytest.mark.parametrize("create", [True, False])
def test_opening_never_creates_the_container(
    azure_store_factory: AzureStoreFactory, create: bool
) -> None:
    connection = azure_store_factory.endpoint.connection_string
    before = {c.name for c in azure_store_factory.endpoint.raw.list_containers()}
    store = open_store("az://never-made/p", create=create, connection_string=connection)
    with store, pytest.raises(StoreNotFoundError):
        store.check_usable()
    assert {c.name for c in azure_store_factory.endpoint.raw.list_containers()} == before


def test_dropped_connections_are_retried(
    azure_store_factory: AzureStoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    drops = DropConnections(2)
    store = flaky_store(azure_store_factory, drops)
    with caplog.at_level(logging.INFO, logger="ckptstore.objectstore"):
        assert store.put("k", b"value") is True
        drops.left = 2
        assert store.get("k") == b"value"
        drops.left = 2
        assert store.head("k").size == 5
    assert drops.seen == 6
    assert "succeeded on attempt 3" in caplog.text


def test_staged_blocks_are_retried_one_by_one(azure_store_factory: AzureStoreFactory) -> None:
    drops = DropConnections(3, method="PUT")
    store = flaky_store(azure_store_factory, drops, block_threshold=4 * MiB, block_size=4 * MiB)
    data = pattern(10 * MiB, seed=4)
    assert store.put("big", data) is True
    assert drops.seen == 3
    assert bytes(store.get_view("big")) == data


def test_endless_drops_give_up_after_max_attempts(azure_store_factory: AzureStoreFactory) -> None:
    drops = DropConnections(100)
    store = flaky_store(azure_store_factory, drops)  # the factory's 4 fast attempts
    with pytest.raises(ObjectStoreError, match="Connection reset by peer") as info:
        store.get("k")
    assert drops.seen == 4
    assert store.url in str(info.value)


def test_an_account_refusing_blob_batch_gets_single_deletes(
    azure_store_factory: AzureStoreFactory,
) -> None:
    """Accounts with a hierarchical namespace refuse Blob Batch: the first refused batch
    switches the store to single deletes, which delete everything asked (missing keys too)."""

    def refuse_batches(request: Any) -> None:
        http = request.http_request
        if "comp=batch" in http.url:  # Azurite answers 400 to a comp it does not know
            http.url = http.url.replace("comp=batch", "comp=batch-refused")

    client = BlobServiceClient.from_connection_string(
        azure_store_factory.endpoint.connection_string,
        retry_total=0,
        raw_request_hook=refuse_batches,
        max_single_put_size=MAX_PUT_BLOB,
    )
    store = azure_store_factory(service_client=client)
    for key in ("a", "b/c", "d"):
        store.put(key, key.encode())
    store.delete(["a", "b/c", "missing"])
    assert store._batches is False
    assert [i.key for i in store.list()] == ["d"]
    store.delete(["d"])
    assert list(store.list()) == []


class _Answer:
    """The parts of an HTTP answer that azure-core's HttpResponseError reads."""

    def __init__(self, status: int, code: str) -> None:
        self.status_code, self.reason = status, "reason"
        self.headers = {"x-ms-error-code": code}

    def text(self) -> str:
        return ""


@pytest.mark.parametrize(
    ("status", "code", "kind", "transient"),
    [
        (503, "ServerBusy", Kind.FAILED, True),
        (500, "InternalError", Kind.FAILED, True),
        (429, "TooManyRequests", Kind.FAILED, True),
        (408, "RequestTimeout", Kind.FAILED, True),
        (404, "BlobNotFound", Kind.NOT_FOUND, False),
        (404, "ContainerNotFound", Kind.STORE_NOT_FOUND, False),
        (403, "AuthorizationPermissionMismatch", Kind.PERMISSION, False),
        (403, "AuthenticationFailed", Kind.PERMISSION, False),
        (400, "InvalidBlockList", Kind.FAILED, False),
    ],
)
def test_answers_azurite_never_gives_are_classified(
    status: int, code: str, kind: Kind, transient: bool
) -> None:
    """Throttling and server errors, which Azurite never sends, are retried; the rest not."""
    failure = classify(
        HttpResponseError(message="m", response=_Answer(status, code)),
        container="c",
        endpoint="https://acct.blob.core.windows.net",
    )
    assert failure is not None
    assert (failure.kind, failure.transient) == (kind, transient)


def test_a_body_cut_short_is_retried_whatever_its_status() -> None:
    """azure-core reports a body cut short with the answer's status (a success): retried."""
    failure = classify(
        IncompleteReadError(message="cut", response=_Answer(206, "")),
        container="c",
        endpoint="https://acct.blob.core.windows.net",
    )
    assert failure is not None
    assert (failure.kind, failure.transient) == (Kind.NETWORK, True)
