"""A fault-injecting HTTP reverse proxy in front of a real S3 endpoint (SeaweedFS in the suite).

:class:`FaultProxy` listens on ``127.0.0.1:<free port>`` in a thread and forwards every request
to the upstream endpoint, streaming request and response bodies in both directions. The
client's headers go upstream unchanged, ``Host`` included, so a SigV4 signature computed for
the proxy's address is the one the server sees (hop-by-hop headers and ``Expect``, which SigV4
never signs, are dropped).

At a configurable ``rate`` (drawn from a seeded RNG) a request is answered with a fault instead;
the kinds (:data:`KINDS`):

- ``slowdown``: ``503 SlowDown`` with S3's XML error body, the request never reaches the server;
- ``internal``: ``500 InternalError``, likewise;
- ``reset``: the connection is reset (RST) before anything is forwarded or answered;
- ``reset_after``: the request is forwarded (the server acts on it), then the connection is
  reset instead of answering: a lost response;
- ``truncate``: the response headers are sent with the full ``Content-Length``, then only part
  of the body, then the connection is closed (only for responses with a body; elsewhere the
  fault becomes ``reset_after``);
- ``reset_mid``: as ``truncate``, but the connection is reset (RST) mid-body;
- ``slow``: the request is held ``slow_seconds`` before it is forwarded normally;
- ``hang``: the request is held without an answer until the client gives up (its read
  timeout) or the proxy releases it; nothing is forwarded.

:meth:`FaultProxy.down` stops listening (clients get "connection refused") and :meth:`up`
listens again on the same port. ``injected`` counts the faults actually injected, by kind.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

KINDS: tuple[str, ...] = (
    "slowdown",
    "internal",
    "reset",
    "reset_after",
    "truncate",
    "reset_mid",
    "slow",
    "hang",
)
#: Faults that leave the request unanswered or answered wrongly: the client must retry.
TRANSIENT_KINDS: tuple[str, ...] = tuple(k for k in KINDS if k != "slow")

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        # Not hop-by-hop, but the proxy answers "100 Continue" itself (BaseHTTPRequestHandler)
        # and SigV4 never signs it.
        "expect",
    }
)
_ERRORS = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "internal": (
        500,
        "Internal Server Error",
        "InternalError",
        "We encountered an internal error.",
    ),
}
_CHUNK = 64 * 1024

Match = Callable[[str, str], bool]


def _every_request(method: str, path: str) -> bool:
    return True


class FaultProxy:
    """Forwards to ``upstream`` (``http://host:port``), injecting faults; see the module doc.

    Args:
        rate: Probability that a request gets a fault.
        seed: Seed of the RNG that decides which requests get one and of which kind.
        kinds: The kinds to draw from (uniformly).
        match: ``(method, path) -> bool``: which requests may get a fault at all.
        max_faults: Inject at most this many faults (None: no limit).
        slow_seconds: How long a ``slow`` request is held (keep it under the read timeout).
        hang_seconds: Upper bound on how long a ``hang`` holds its connection.
    """

    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.0,
        seed: int = 0,
        kinds: Iterable[str] = KINDS,
        match: Match = _every_request,
        max_faults: int | None = None,
        slow_seconds: float = 0.15,
        hang_seconds: float = 60.0,
    ) -> None:
        target = urlsplit(upstream)
        if target.scheme != "http" or not target.hostname:
            raise ValueError(f"FaultProxy forwards to http://host:port, not {upstream!r}")
        self.upstream_host = target.hostname
        self.upstream_port = target.port or 80
        self.slow_seconds = slow_seconds
        self.hang_seconds = hang_seconds
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._rate = 0.0
        self._kinds: tuple[str, ...] = ()
        self._match: Match = _every_request
        self._max_faults: int | None = None
        #: Faults decided since the budget was set (``max_faults`` counts these: a fault
        #: is counted in ``injected`` only once it happened, which can be a little later).
        self._drawn = 0
        self.configure(rate=rate, kinds=kinds, match=match, max_faults=max_faults)
        #: Faults injected so far, by kind (what really happened to a request).
        self.injected: Counter[str] = Counter()
        #: Requests received (faulted or not), and requests answered by the upstream server.
        self.requests = 0
        self.forwarded = 0
        #: Requests being held by ``hang`` right now, and the peak of that number.
        self.hanging = 0
        #: Unexpected errors inside the proxy itself (tests assert there are none).
        self.errors: list[str] = []
        #: Set to let every held (``hang``) request go; set for good by ``close``.
        self._release = threading.Event()
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._server: ThreadingHTTPServer | None = None
        self._serve_thread: threading.Thread | None = None
        self.port = 0
        self._closed = False
        self.up()

    # -- configuration ----------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def configure(
        self,
        *,
        rate: float | None = None,
        kinds: Iterable[str] | None = None,
        match: Match | None = None,
        max_faults: int | None = -1,
        seed: int | None = None,
    ) -> None:
        """Change what is injected from the next request on (arguments left out stay).

        ``max_faults`` starts a new budget: at most that many more faults (None: no limit).
        """
        with self._lock:
            if rate is not None:
                if not 0.0 <= rate <= 1.0:
                    raise ValueError(f"rate must be in [0, 1], got {rate}")
                self._rate = rate
            if kinds is not None:
                chosen = tuple(kinds)
                unknown = set(chosen) - set(KINDS)
                if not chosen or unknown:
                    raise ValueError(f"kinds must be a non-empty subset of {KINDS}: {chosen}")
                self._kinds = chosen
            if match is not None:
                self._match = match
            if max_faults != -1:  # a new budget, counted from now
                self._max_faults = max_faults
                self._drawn = 0
            if seed is not None:
                self._rng = random.Random(seed)

    def always(self, kind: str, *, match: Match = _every_request) -> None:
        """Fault every matching request with ``kind``."""
        self.configure(rate=1.0, kinds=[kind], match=match, max_faults=None)

    def off(self) -> None:
        """Forward everything faithfully from now on (and let held requests go)."""
        self.configure(rate=0.0)
        self.release_hung()

    def release_hung(self) -> None:
        """End every ``hang`` in progress (their connections are closed unanswered)."""
        self._release.set()
        if not self._closed:
            self._release = threading.Event()

    @property
    def total_injected(self) -> int:
        with self._lock:
            return sum(self.injected.values())

    # -- listening ----------------------------------------------------------------------------

    def up(self) -> None:
        """Listen (again, on the same port after ``down``)."""
        if self._closed:
            raise RuntimeError("the proxy is closed")
        if self._server is not None:
            return
        server = _Server(("127.0.0.1", self.port), _handler_class(self))
        self.port = server.server_address[1]
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"faultproxy-{self.port}",
            daemon=True,
        )
        self._server, self._serve_thread = server, thread
        thread.start()

    def down(self) -> None:
        """Stop listening and drop every open connection: clients see refused connections."""
        server, thread = self._server, self._serve_thread
        self._server = self._serve_thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join()
        self.release_hung()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop, release every held request and join every handler thread."""
        if self._closed:
            return
        self._closed = True
        self._release.set()
        self.down()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=10)
        with self._lock:
            alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            self.errors.append(f"handler threads still alive after close: {alive}")

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- per request ----------------------------------------------------------------------------

    def _draw(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests += 1
            if self._rate <= 0.0 or not self._match(method, path):
                return None
            if self._max_faults is not None and self._drawn >= self._max_faults:
                return None
            if self._rng.random() >= self._rate:
                return None
            self._drawn += 1
            return self._rng.choice(self._kinds)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.injected[kind] += 1

    def _register(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.add(conn)
            self._threads.add(threading.current_thread())

    def _unregister(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)
            self._threads.discard(threading.current_thread())

    def _serve(self, handler: _Handler) -> None:
        method, path = handler.command, handler.path
        fault = self._draw(method, path)
        if fault == "reset":
            self._count("reset")
            _reset(handler)
            return
        if fault == "hang":
            self._count("hang")
            self._hang(handler)
            return
        length = _request_length(handler)
        if fault in _ERRORS:
            self._count(fault)
            _drain(handler, length)
            _send_error(handler, *_ERRORS[fault])
            return
        if fault == "slow":
            self._count("slow")
            threading.Event().wait(self.slow_seconds)  # the fault itself: a slow server
        upstream = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=60)
        try:
            upstream.connect()
            _no_delay(upstream.sock)
            upstream.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in handler.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    upstream.putheader(name, value)
            upstream.endheaders()
            _copy(handler.rfile, upstream.send, length or 0)
            response = upstream.getresponse()
            with self._lock:
                self.forwarded += 1
            cut_body = fault in ("truncate", "reset_mid")
            if cut_body and (method == "HEAD" or response.length in (None, 0, 1)):
                fault = "reset_after"  # nothing to cut short: lose the whole answer instead
            if fault == "reset_after":
                self._count("reset_after")
                response.read()
                _reset(handler)
                return
            self._reply(
                handler, response, cut=fault if fault in ("truncate", "reset_mid") else None
            )
        finally:
            upstream.close()

    def _reply(
        self, handler: _Handler, response: http.client.HTTPResponse, *, cut: str | None
    ) -> None:
        """Relay the upstream answer; ``cut`` (``truncate``/``reset_mid``) sends half its body,
        then closes or resets the connection."""
        body: bytes | None = None
        length = response.length
        if handler.command != "HEAD" and length is None:
            body = response.read()  # a chunked answer (small XML): send it with a length
            length = len(body)
        handler.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            lowered = name.lower()
            if lowered in _HOP_BY_HOP or (lowered == "content-length" and body is not None):
                continue
            handler.send_header(name, value)
        if body is not None:
            handler.send_header("Content-Length", str(length))
        if cut is not None:
            handler.send_header("Connection", "close")
            handler.close_connection = True
        handler.end_headers()
        if handler.command == "HEAD":
            return
        if cut is not None:
            assert length is not None
            self._count(cut)
            _copy(response, handler.wfile.write, max(1, length // 2))
            handler.wfile.flush()
            if cut == "reset_mid":
                _reset(handler)
            return
        if body is not None:
            handler.wfile.write(body)
        else:
            _copy(response, handler.wfile.write, length or 0)

    def _hang(self, handler: _Handler) -> None:
        release = self._release
        with self._lock:
            self.hanging += 1
        try:
            release.wait(self.hang_seconds)
        finally:
            with self._lock:
                self.hanging -= 1
        handler.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    # The same port must be usable again right after ``down``.
    allow_reuse_address = True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy: FaultProxy


def _handler_class(proxy: FaultProxy) -> type[_Handler]:
    class Handler(_Handler):
        def setup(self) -> None:
            super().setup()
            _no_delay(self.connection)
            proxy._register(self.connection)

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                proxy._unregister(self.connection)

        def handle(self) -> None:
            try:
                super().handle()
            except (ConnectionError, TimeoutError, http.client.HTTPException, OSError):
                # A client that gave up (its read timeout after a hang, a reset it caused).
                self.close_connection = True
            except Exception as exc:  # a bug in the proxy: the test must see it
                proxy.errors.append(f"{type(exc).__name__}: {exc}")
                self.close_connection = True

        def do_GET(self) -> None:
            proxy._serve(self)

        do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def _no_delay(sock: socket.socket) -> None:
    """Headers and body go out in separate writes: without this, Nagle's algorithm and delayed
    ACKs add some 40 ms to every exchange."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _request_length(handler: BaseHTTPRequestHandler) -> int | None:
    if "chunked" in handler.headers.get("Transfer-Encoding", "").lower():
        raise http.client.HTTPException("chunked request bodies are not supported")
    value = handler.headers.get("Content-Length")
    return int(value) if value is not None else None


def _copy(source: Any, write: Callable[[bytes], Any], length: int) -> None:
    """Stream ``length`` bytes from ``source.read`` to ``write`` in chunks."""
    left = length
    while left > 0:
        chunk = source.read(min(_CHUNK, left))
        if not chunk:
            raise ConnectionError(f"stream ended {left} bytes early")
        write(chunk)
        left -= len(chunk)


def _drain(handler: BaseHTTPRequestHandler, length: int | None) -> None:
    _copy(handler.rfile, lambda _chunk: None, length or 0)


def _send_error(
    handler: BaseHTTPRequestHandler, status: int, reason: str, code: str, message: str
) -> None:
    body = (
        b""
        if handler.command == "HEAD"
        else (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<Resource>{handler.path}</Resource><RequestId>FAULTPROXY</RequestId></Error>"
        ).encode()
    )
    handler.send_response_only(status, reason)
    handler.send_header("Content-Type", "application/xml")
    handler.send_header("Content-Length", str(len(body)))
    if status == 503:
        handler.send_header("Retry-After", "0")
    handler.end_headers()
    handler.wfile.write(body)


def _reset(handler: BaseHTTPRequestHandler) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0), unread request bytes and all."""
    handler.close_connection = True
    conn = handler.connection
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        fd = conn.detach()
    except OSError:
        return
    socket.close(fd)
