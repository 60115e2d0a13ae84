"""Transient faults are retried and leave objects intact; permanent ones raise clear errors.

Faults are injected on the S3Store's own boto3 client through botocore's ``before-send`` event,
so the store, botocore's response parsing and the retry policy all run for real; only the
server's answer is replaced. Faults that need real sockets (a body cut short, a response lost
after the server acted on the request, a stall) go through a small proxy in front of moto's
server.
"""

from __future__ import annotations

import http.client
import io
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import botocore.exceptions as bexc
import pytest
import s3servers
from botocore.awsrequest import AWSPreparedRequest, AWSResponse

from ckptstore.errors import (
    ConfigError,
    ObjectNotFoundError,
    ObjectStoreError,
    StoreNotFoundError,
    StorePermissionError,
)
from ckptstore.objectstore import ObjectStore, RetryPolicy, S3Store
from ckptstore.testing.factories import MULTIPART_OPTIONS, MiB, S3StoreFactory, pattern

FAST = RetryPolicy(max_attempts=5, base_delay=0.001, max_delay=0.01)
#: Where an intercepted request is pointed so that nothing ever answers it (see FaultInjector).
NOWHERE = "http://127.0.0.1:9/fault-injected"
SECRET = "ckpt-test-SECRET-wJalrXUtnFEMI-never-print-me"

# -- fault injection --------------------------------------------------------------------------


class FakeBody:
    """Stands in for urllib3's response object under a botocore AWSResponse."""

    def __init__(self, data: bytes) -> None:
        self._buf = io.BytesIO(data)

    def stream(self, amt: int = 65536, decode_content: bool | None = None) -> Iterator[bytes]:
        while chunk := self._buf.read(amt):
            yield chunk

    def read(self, amt: int | None = None, decode_content: bool | None = None) -> bytes:
        return self._buf.read(amt)

    def readinto(self, buffer: Any) -> int:
        return self._buf.readinto(buffer)

    def close(self) -> None:
        self._buf.close()


Fault = Callable[[str], AWSResponse]


def error(status: int, code: str = "", message: str = "") -> Fault:
    """An S3 error response, with the XML body S3 sends (none for a HEAD-style answer)."""
    body = (
        b'<?xml version="1.0" encoding="UTF-8"?>\n'
        + f"<Error><Code>{code}</Code><Message>{message}</Message>".encode()
        + b"<RequestId>FAULT0INJECTED</RequestId></Error>"
        if code
        else b""
    )

    def respond(url: str) -> AWSResponse:
        headers = {"Content-Type": "application/xml", "Content-Length": str(len(body))}
        return AWSResponse(url, status, headers, FakeBody(body))

    return respond


def raising(exc_type: type[Exception]) -> Fault:
    """A dropped connection or timeout, as botocore raises it."""

    def respond(url: str) -> AWSResponse:
        if issubclass(exc_type, bexc.ConnectionClosedError | bexc.ReadTimeoutError):
            raise exc_type(endpoint_url=url)
        raise exc_type(endpoint_url=url, error="injected")

    return respond


def truncated(data: bytes, declared: int) -> Fault:
    """A 200 whose body ends before its declared Content-Length."""

    def respond(url: str) -> AWSResponse:
        headers = {
            "Content-Length": str(declared),
            "Content-Type": "binary/octet-stream",
            "ETag": '"0123456789abcdef0123456789abcdef"',
            "Last-Modified": "Mon, 30 Nov 2026 00:00:00 GMT",
        }
        return AWSResponse(url, 200, headers, FakeBody(data))

    return respond


class FaultInjector:
    """Answers the first ``times`` requests of one S3 operation with ``fault``.

    Counts every request of that operation (``calls``), faulted or not. ``when`` narrows which
    requests are faulted. A faulted request never reaches the server: moto in-process answers
    from a later ``before-send`` handler, so the request is pointed at an address it does not
    serve before the fault is returned.
    """

    def __init__(
        self,
        store: S3Store,
        operation: str,
        fault: Fault,
        times: float = float("inf"),
        when: Callable[[AWSPreparedRequest], bool] = lambda request: True,
    ) -> None:
        self.fault = fault
        self.times = times
        self.when = when
        self.calls = 0
        self.injected = 0
        self._lock = threading.Lock()
        store.client.meta.events.register(f"before-send.s3.{operation}", self)

    def __call__(self, request: AWSPreparedRequest, **kwargs: Any) -> AWSResponse | None:
        with self._lock:
            self.calls += 1
            inject = self.injected < self.times and self.when(request)
            if inject:
                self.injected += 1
        if not inject:
            return None
        url = request.url
        request.url = NOWHERE
        return self.fault(url)


@pytest.fixture
def factory(moto_store_factory: S3StoreFactory) -> S3StoreFactory:
    return moto_store_factory


@pytest.fixture
def store(factory: S3StoreFactory) -> S3Store:
    store = factory(retry=FAST)
    assert isinstance(store, S3Store)
    return store


def stored(factory: S3StoreFactory, key: str) -> bytes | None:
    """The object's bytes read with a plain client, or None if absent."""
    try:
        response = factory.raw_client.get_object(Bucket=factory.bucket, Key=factory.full_key(key))
    except factory.raw_client.exceptions.NoSuchKey:
        return None
    return bytes(response["Body"].read())


def retry_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The retries logged (at DEBUG: only a fault that outlasts them is reported, once)."""
    found = [r for r in caplog.records if r.name == "ckptstore.objectstore"]
    assert all(r.levelno < logging.WARNING for r in found), [r.getMessage() for r in found]
    return [r.getMessage() for r in found if r.levelno == logging.DEBUG]


# -- transient faults -------------------------------------------------------------------------

TRANSIENT = [
    pytest.param(error(503, "SlowDown", "Please reduce your request rate."), id="503-SlowDown"),
    pytest.param(error(500, "InternalError", "We encountered an internal error."), id="500"),
    pytest.param(error(503, "ServiceUnavailable", "Service is unable to handle."), id="503"),
    pytest.param(error(429, "TooManyRequests", "Too many requests."), id="429"),
    pytest.param(error(400, "RequestTimeout", "Idle connection closed."), id="400-RequestTimeout"),
    pytest.param(error(502, "BadGateway", "Bad gateway."), id="502"),
    pytest.param(raising(bexc.ConnectionClosedError), id="connection-closed"),
    pytest.param(raising(bexc.ReadTimeoutError), id="read-timeout"),
    pytest.param(raising(bexc.EndpointConnectionError), id="connection-refused"),
]


@pytest.mark.parametrize("fault", TRANSIENT)
def test_put_retries_transient_faults(
    store: S3Store, factory: S3StoreFactory, fault: Fault, caplog: pytest.LogCaptureFixture
) -> None:
    data = pattern(20_000)
    injector = FaultInjector(store, "PutObject", fault, times=2)
    with caplog.at_level(logging.DEBUG, "ckptstore.objectstore"):
        assert store.put("cas/k", data) is True
    assert injector.calls == 3
    retries = retry_logs(caplog)
    assert len(retries) == 2
    assert all(f"{store.url}/cas/k" in r for r in retries)
    assert stored(factory, "cas/k") == data


@pytest.mark.parametrize("fault", TRANSIENT)
def test_get_retries_transient_faults(
    store: S3Store, factory: S3StoreFactory, fault: Fault, caplog: pytest.LogCaptureFixture
) -> None:
    data = pattern(20_000)
    store.put("cas/k", data)
    injector = FaultInjector(store, "GetObject", fault, times=2)
    with caplog.at_level(logging.DEBUG, "ckptstore.objectstore"):
        assert store.get("cas/k") == data
        assert store.get("cas/k", (100, 300)) == data[100:300]
    assert injector.calls == 4
    assert len(retry_logs(caplog)) == 2


def test_truncated_get_body_is_retried(store: S3Store, caplog: pytest.LogCaptureFixture) -> None:
    data = pattern(50_000)
    store.put("cas/k", data)
    injector = FaultInjector(store, "GetObject", truncated(data[:1000], len(data)), times=2)
    with caplog.at_level(logging.DEBUG, "ckptstore.objectstore"):
        assert store.get("cas/k") == data
    assert injector.calls == 3
    assert len(retry_logs(caplog)) == 2


def test_truncated_get_body_that_never_completes_fails(store: S3Store) -> None:
    data = pattern(50_000)
    store.put("cas/k", data)
    injector = FaultInjector(store, "GetObject", truncated(data[:10], len(data)))
    with pytest.raises(ObjectStoreError) as info:
        store.get("cas/k")
    assert injector.calls == FAST.max_attempts
    assert f"{store.url}/cas/k" in str(info.value)


@pytest.mark.parametrize(
    ("operation", "call"),
    [
        pytest.param("HeadObject", lambda s: s.head("k").size == 5, id="head"),
        pytest.param("HeadObject", lambda s: s.exists("k"), id="exists"),
        pytest.param("ListObjectsV2", lambda s: [i.key for i in s.list()] == ["k"], id="list"),
        pytest.param("GetObject", lambda s: s.get("k", (1, 3)) == b"bc", id="ranged-get"),
    ],
)
def test_reads_retry_5xx(store: S3Store, operation: str, call: Callable[[S3Store], bool]) -> None:
    store.put("k", b"abcde")
    # HEAD answers carry no body: the error is known only by its status.
    injector = FaultInjector(store, operation, error(503), times=3)
    assert call(store) is True
    assert injector.calls == 4


def test_delete_retries_transient_faults(store: S3Store, factory: S3StoreFactory) -> None:
    for key in ("a", "b"):
        store.put(key, b"x")
    injector = FaultInjector(store, "DeleteObjects", error(500, "InternalError", "oops"), times=2)
    store.delete(["a", "b", "missing"])
    assert injector.calls == 3
    assert stored(factory, "a") is None
    assert stored(factory, "b") is None


def test_delete_reports_per_key_errors(store: S3Store) -> None:
    store.put("a", b"x")
    body = (
        b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult><Error><Key>'
        + f"{store.prefix}/a".encode()
        + b"</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error></DeleteResult>"
    )

    def partial_failure(url: str) -> AWSResponse:
        return AWSResponse(url, 200, {"Content-Length": str(len(body))}, FakeBody(body))

    FaultInjector(store, "DeleteObjects", partial_failure, times=1)
    with pytest.raises(ObjectStoreError, match="AccessDenied") as info:
        store.delete(["a"])
    assert store.url in str(info.value)
    assert "a" in str(info.value)


# -- multipart uploads under faults -----------------------------------------------------------


@pytest.fixture
def big_store(factory: S3StoreFactory) -> S3Store:
    store = factory(retry=FAST, **MULTIPART_OPTIONS)
    assert isinstance(store, S3Store)
    return store


BIG = 12 * MiB + 7  # three parts of 5, 5 and 2 MiB


@pytest.mark.parametrize(
    ("operation", "faults"),
    [("CreateMultipartUpload", 2), ("UploadPart", 3), ("CompleteMultipartUpload", 2)],
)
def test_multipart_upload_retries_each_step(
    big_store: S3Store, factory: S3StoreFactory, operation: str, faults: int
) -> None:
    data = pattern(BIG, seed=5)
    injector = FaultInjector(big_store, operation, error(503, "SlowDown", "slow down"), faults)
    parts = FaultInjector(big_store, "UploadPart", error(500), times=0)
    assert big_store.put("cas/big", data) is True
    assert injector.injected == faults
    assert parts.calls == 3 + (faults if operation == "UploadPart" else 0)
    assert stored(factory, "cas/big") == data
    assert factory.pending_uploads() == []


def test_part_upload_after_dropped_connections_resends_the_whole_part(
    big_store: S3Store, factory: S3StoreFactory
) -> None:
    data = pattern(BIG, seed=6)
    injector = FaultInjector(big_store, "UploadPart", raising(bexc.ConnectionClosedError), 4)
    assert big_store.put("cas/big", [data[:100], data[100:]]) is True
    assert injector.calls == 7
    assert stored(factory, "cas/big") == data


def test_failed_multipart_upload_is_aborted(big_store: S3Store, factory: S3StoreFactory) -> None:
    FaultInjector(big_store, "UploadPart", error(403, "AccessDenied", "Access Denied"))
    with pytest.raises(StorePermissionError):
        big_store.put("cas/big", pattern(BIG))
    assert factory.pending_uploads() == []
    assert stored(factory, "cas/big") is None
    assert not big_store.exists("cas/big")


# -- conditional writes -----------------------------------------------------------------------


def _conditional(request: AWSPreparedRequest) -> bool:
    return "If-None-Match" in request.headers


def test_server_without_conditional_writes_falls_back_to_head_then_put(
    store: S3Store, factory: S3StoreFactory
) -> None:
    """A server that refuses If-None-Match (501) is detected once; puts stay idempotent."""
    injector = FaultInjector(
        store, "PutObject", error(501, "NotImplemented", "not implemented"), when=_conditional
    )
    assert store.put("a", b"first") is True
    assert store.put("a", b"second") is False
    assert store.put("b", b"other") is True
    assert injector.injected == 1  # probed once, then never sent again
    assert injector.calls == 3  # the probe, then one plain PUT for each new key
    assert stored(factory, "a") == b"first"
    assert stored(factory, "b") == b"other"


def test_conditional_writes_off_never_sends_the_header(factory: S3StoreFactory) -> None:
    store = factory(retry=FAST, conditional_writes=False)
    assert isinstance(store, S3Store)
    sent = FaultInjector(store, "PutObject", error(500), when=_conditional)
    assert store.put("a", b"first") is True
    assert store.put("a", b"second") is False
    assert sent.injected == 0
    assert stored(factory, "a") == b"first"


def test_conditional_writes_required_but_refused_is_an_error(factory: S3StoreFactory) -> None:
    store = factory(retry=FAST, conditional_writes=True)
    assert isinstance(store, S3Store)
    FaultInjector(store, "PutObject", error(501, "NotImplemented", "nope"), when=_conditional)
    with pytest.raises(ObjectStoreError, match="NotImplemented") as info:
        store.put("a", b"first")
    assert f"{store.url}/a" in str(info.value)
    assert stored(factory, "a") is None


# -- permanent faults -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("operation", "call"),
    [
        pytest.param("PutObject", lambda s: s.put("cas/k", b"new"), id="put"),
        pytest.param("GetObject", lambda s: s.get("cas/k"), id="get"),
        pytest.param("HeadObject", lambda s: s.head("cas/k"), id="head"),
    ],
)
def test_access_denied_is_a_permission_error_and_not_retried(
    store: S3Store, operation: str, call: Callable[[S3Store], object]
) -> None:
    injector = FaultInjector(
        store,
        operation,
        error(403, "AccessDenied", "Access Denied") if operation != "HeadObject" else error(403),
    )
    with pytest.raises(StorePermissionError) as info:
        call(store)
    exc = info.value
    assert isinstance(exc, PermissionError)
    assert isinstance(exc, ObjectStoreError)
    assert f"{store.url}/cas/k" in str(exc)
    assert injector.calls == 1


@pytest.mark.parametrize(
    ("fault", "code"),
    [
        (error(500, "InternalError", "We encountered an internal error."), "InternalError"),
        (error(503, "SlowDown", "Please reduce your request rate."), "SlowDown"),
        (raising(bexc.ConnectionClosedError), "ConnectionClosedError"),
        (raising(bexc.EndpointConnectionError), "EndpointConnectionError"),
    ],
)
def test_endless_transient_fault_gives_up_after_max_attempts(
    factory: S3StoreFactory, fault: Fault, code: str
) -> None:
    store = factory(retry=RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.01))
    assert isinstance(store, S3Store)
    injector = FaultInjector(store, "PutObject", fault)
    with pytest.raises(ObjectStoreError) as info:
        store.put("cas/k", b"data")
    exc = info.value
    assert not isinstance(exc, ObjectNotFoundError | StorePermissionError)
    assert injector.calls == 3
    assert f"{store.url}/cas/k" in str(exc)
    assert code in str(exc)
    assert stored(factory, "cas/k") is None


@pytest.mark.parametrize(
    "fault",
    [
        error(400, "InvalidArgument", "bad argument"),
        error(501, "NotImplemented", "A header you provided implies unimplemented functionality"),
        error(409, "InvalidBucketState", "The request is not valid"),
    ],
)
def test_client_errors_are_not_retried(
    factory: S3StoreFactory, fault: Fault, caplog: pytest.LogCaptureFixture
) -> None:
    store = factory(retry=FAST, conditional_writes=False)
    assert isinstance(store, S3Store)
    store.put("k", b"v")
    injector = FaultInjector(store, "GetObject", fault)
    with (
        caplog.at_level(logging.DEBUG, "ckptstore.objectstore"),
        pytest.raises(ObjectStoreError) as info,
    ):
        store.get("k")
    assert injector.calls == 1
    assert retry_logs(caplog) == []
    assert f"{store.url}/k" in str(info.value)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda s: s.put("cas/k", b"x"), id="put"),
        pytest.param(lambda s: s.put("cas/k", pattern(6 * MiB)), id="put-multipart"),
        pytest.param(lambda s: s.get("cas/k"), id="get"),
        pytest.param(lambda s: s.head("cas/k"), id="head"),
        pytest.param(lambda s: list(s.list("cas/k")), id="list"),
        pytest.param(lambda s: s.delete(["cas/k"]), id="delete"),
    ],
)
def test_missing_bucket_raises_store_not_found_naming_the_url(
    factory: S3StoreFactory, call: Callable[[ObjectStore], object]
) -> None:
    store = factory(bucket="no-such-bucket-here", retry=FAST, **MULTIPART_OPTIONS)
    with pytest.raises(ObjectStoreError) as info:
        call(store)
    message = str(info.value)
    # A missing bucket is never mistaken for a missing object (that would make a checkpoint
    # look corrupt), except by HEAD: S3 answers it with a bare 404 that names nothing.
    if "head" in message:
        assert isinstance(info.value, ObjectNotFoundError)
    else:
        assert isinstance(info.value, StoreNotFoundError)
        assert not isinstance(info.value, FileNotFoundError)
    assert "s3://no-such-bucket-here/" in message
    assert "cas/k" in message


def test_missing_bucket_message_says_what_to_do(factory: S3StoreFactory) -> None:
    store = factory(bucket="no-such-bucket-here", retry=FAST)
    with pytest.raises(StoreNotFoundError, match=r"bucket .no-such-bucket-here. does not exist"):
        store.get("cas/k")


# -- nothing secret in errors or logs ---------------------------------------------------------


def test_errors_and_logs_never_contain_the_secret_key(
    factory: S3StoreFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    # region_name makes the factory build the store's client the way users do, from the
    # environment's credentials.
    store = factory(
        region_name="us-east-1", retry=RetryPolicy(max_attempts=2, base_delay=0.001, max_delay=0.01)
    )
    assert isinstance(store, S3Store)
    assert store.client._request_signer._credentials.secret_key == SECRET  # type: ignore[attr-defined]
    FaultInjector(store, "PutObject", error(403, "SignatureDoesNotMatch", "Check your key"))
    FaultInjector(store, "GetObject", error(500, "InternalError", "internal"))
    FaultInjector(store, "HeadObject", raising(bexc.ConnectionClosedError))
    errors: list[BaseException] = []
    with caplog.at_level(logging.DEBUG, "ckptstore"):
        for call in (lambda: store.put("k", b"v"), lambda: store.get("k"), lambda: store.head("k")):
            with pytest.raises(ObjectStoreError) as info:
                call()
            errors.append(info.value)
    assert isinstance(errors[0], StorePermissionError)
    for exc in errors:
        assert SECRET not in str(exc)
        assert SECRET not in repr(exc)
        assert store.url in str(exc)
    assert caplog.records, "the retries should have been logged"
    assert SECRET not in caplog.text
    assert SECRET not in repr(store)


def test_credentials_in_the_endpoint_url_are_refused_without_echoing_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = s3servers.free_port_pairs(1)[0]
    url = f"http://user:{SECRET}@127.0.0.1:{port}"
    with pytest.raises(ConfigError, match="embeds credentials") as info:
        S3Store("bucket", "prefix", endpoint_url=url)
    assert SECRET not in str(info.value)
    assert f"http://127.0.0.1:{port}" in str(info.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)  # from boto3's configuration: refused too
    with pytest.raises(ConfigError, match="embeds credentials") as info:
        S3Store("bucket", "prefix")
    assert SECRET not in str(info.value)


def test_unreachable_endpoint_names_it(caplog: pytest.LogCaptureFixture) -> None:
    port = s3servers.free_port_pairs(1)[0]
    store = S3Store(
        "bucket",
        endpoint_url=f"http://127.0.0.1:{port}",
        retry=RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.01),
    )
    with (
        caplog.at_level(logging.DEBUG, "ckptstore.objectstore"),
        store,
        pytest.raises(ObjectStoreError, match="reachable") as info,
    ):
        store.put("cas/k", b"x")
    assert f"http://127.0.0.1:{port}" in str(info.value)
    assert "s3://bucket/cas/k" in str(info.value)
    # The one error is the report; the retries before it are logged only at DEBUG.
    assert len(retry_logs(caplog)) == 2


# -- real sockets: a proxy in front of moto's server ------------------------------------------


class FaultyProxy:
    """An HTTP proxy on 127.0.0.1 that forwards to an S3 endpoint and spoils chosen exchanges.

    Actions: ``truncate`` sends the full Content-Length but only half the body, then hangs up;
    ``drop`` forwards the request (the server acts on it) and hangs up without answering;
    ``stall`` waits ``stall_seconds`` before forwarding.
    """

    def __init__(self, upstream: str, stall_seconds: float = 1.0) -> None:
        target = urlsplit(upstream)
        self.host, self.port = target.hostname or "127.0.0.1", target.port or 80
        self.stall_seconds = stall_seconds
        self.requests: list[tuple[str, str]] = []
        self._plans: list[list[Any]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                try:
                    proxy._forward(self)
                except (ConnectionError, TimeoutError):
                    # The client gave up (its read timed out on a stalled reply): nobody is
                    # left to answer, and a traceback from this thread would only be noise.
                    self.close_connection = True

            do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def spoil(self, method: str, path_part: str, action: str, times: int = 1) -> None:
        with self._lock:
            self._plans.append([method, path_part, action, times])

    def count(self, method: str, path_part: str) -> int:
        return sum(1 for m, p in self.requests if m == method and path_part in p)

    def _take(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests.append((method, path))
            for plan in self._plans:
                if plan[0] == method and plan[1] in path and plan[3] > 0:
                    plan[3] -= 1
                    return str(plan[2])
        return None

    def _forward(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        action = self._take(handler.command, handler.path)
        if action == "stall":
            time.sleep(self.stall_seconds)
        headers = {
            k: v
            for k, v in handler.headers.items()
            if k.lower() not in ("connection", "keep-alive", "transfer-encoding")
        }
        upstream = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            upstream.request(handler.command, handler.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            reply_headers = response.getheaders()
        finally:
            upstream.close()
        if action == "drop":
            handler.close_connection = True
            return
        handler.send_response_only(response.status, response.reason)
        for name, value in reply_headers:
            if name.lower() in ("connection", "keep-alive", "transfer-encoding"):
                continue
            if name.lower() == "content-length" and handler.command != "HEAD":
                continue
            handler.send_header(name, value)
        if handler.command != "HEAD":
            handler.send_header("Content-Length", str(len(data)))
        if action == "truncate":
            handler.send_header("Connection", "close")
            handler.end_headers()
            handler.wfile.write(data[: len(data) // 2])
            handler.wfile.flush()
            handler.close_connection = True
            return
        handler.end_headers()
        handler.wfile.write(data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()


@pytest.fixture
def proxy(moto_server_store_factory: S3StoreFactory) -> Iterator[FaultyProxy]:
    assert moto_server_store_factory.endpoint_url is not None
    proxy = FaultyProxy(moto_server_store_factory.endpoint_url)
    yield proxy
    proxy.close()


@pytest.fixture
def proxied(
    moto_server_store_factory: S3StoreFactory, proxy: FaultyProxy
) -> Callable[..., S3Store]:
    def make(**options: Any) -> S3Store:
        options.setdefault("retry", FAST)
        store = moto_server_store_factory(endpoint_url=proxy.endpoint_url, **options)
        assert isinstance(store, S3Store)
        return store

    return make


@pytest.mark.integration
def test_truncated_body_over_a_real_socket_is_retried(
    proxied: Callable[..., S3Store], proxy: FaultyProxy, caplog: pytest.LogCaptureFixture
) -> None:
    store = proxied()
    data = pattern(300_000)
    store.put("cas/k", data)
    proxy.spoil("GET", "/cas/k", "truncate", times=2)
    with caplog.at_level(logging.DEBUG, "ckptstore.objectstore"):
        assert store.get("cas/k") == data
    assert proxy.count("GET", "/cas/k") == 3
    assert len(retry_logs(caplog)) == 2
    proxy.spoil("GET", "/cas/k", "truncate", times=1)
    assert store.get("cas/k", (1000, 200_000)) == data[1000:200_000]


@pytest.mark.integration
def test_lost_response_to_a_put_that_succeeded(
    proxied: Callable[..., S3Store], proxy: FaultyProxy, moto_server_store_factory: S3StoreFactory
) -> None:
    """The server stored the object but the answer was lost: the retry finds it there."""
    store = proxied()
    data = pattern(10_000)
    proxy.spoil("PUT", "/cas/k", "drop")
    store.put("cas/k", data)  # True or False: either way it must not fail
    assert proxy.count("PUT", "/cas/k") == 2
    assert stored(moto_server_store_factory, "cas/k") == data
    assert store.get("cas/k") == data


@pytest.mark.integration
def test_lost_response_to_a_completed_multipart_upload(
    proxied: Callable[..., S3Store], proxy: FaultyProxy, moto_server_store_factory: S3StoreFactory
) -> None:
    """CompleteMultipartUpload took effect but its answer was lost. The retry completes an
    upload that is already complete (or, on S3, meets If-None-Match): the put must not fail."""
    store = proxied(**MULTIPART_OPTIONS)
    data = pattern(11 * MiB, seed=9)
    proxy.spoil("POST", "uploadId=", "drop")
    store.put("cas/big", data)
    assert proxy.count("POST", "uploadId=") == 2
    assert stored(moto_server_store_factory, "cas/big") == data
    assert moto_server_store_factory.pending_uploads() == []


@pytest.mark.integration
def test_stalled_response_times_out_and_is_retried(
    proxied: Callable[..., S3Store], proxy: FaultyProxy
) -> None:
    store = proxied(read_timeout=0.3)
    store.put("cas/k", b"payload")
    proxy.spoil("GET", "/cas/k", "stall")
    started = time.monotonic()
    assert store.get("cas/k") == b"payload"
    assert time.monotonic() - started < 5
    assert proxy.count("GET", "/cas/k") == 2
