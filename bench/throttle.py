"""A bandwidth-limited TCP proxy for benchmarks: a stated per-node bandwidth in front of a local
S3 server (SeaweedFS on loopback serves 0.4-1 GB/s; a cluster's node reaches its object store
at a fraction of that).

``Throttle(host, port, rate)`` listens on ``127.0.0.1`` (a free port) and forwards every
connection to ``host:port``, on an asyncio event loop in a background thread. Each direction
has a token bucket of ``rate`` bytes/s shared by all connections (a node's NIC: every request
of a recovery shares it), with a burst of ``burst`` bytes (default: 10 ms at ``rate``, at least
two chunks). Bytes are counted per direction as they are forwarded (``to_server``,
``to_client``), HTTP headers included.

    with Throttle("127.0.0.1", 8333, 200e6) as proxy:
        store = S3Store("bucket", endpoint_url=proxy.endpoint_url)
        ...
        proxy.to_client  # bytes the server sent through the proxy
        proxy.rate = 400e6  # takes effect for the next chunk forwarded

``directions`` limits which directions are throttled: ``"both"`` (default), ``"down"``
(server -> client only: reads) or ``"up"`` (client -> server only: writes). ``rate=None`` forwards
without a limit (the proxy's own overhead, for comparison).

The buckets are GCRA (virtual scheduling): each chunk reserves its transmission time on the
direction's clock when it is read, and waits until that time (less the burst) before it is
written, so concurrent connections are served in the order they asked and the long-run rate is
exactly ``rate``. One event-loop thread forwards everything; on loopback it moves about 1 GB/s
per core, so a setting well below that is what the proxy enforces (measure it: see
``bench_tiers.py``'s sanity row).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from types import TracebackType

#: Bytes read from a socket at a time (one bucket reservation each).
CHUNK = 256 * 1024
DIRECTIONS = ("both", "down", "up")


class TokenBucket:
    """``rate`` bytes/s with a burst of ``burst`` bytes (GCRA): :meth:`delay` reserves ``n``
    bytes and says how long to wait before sending them. Used from one event loop only."""

    def __init__(self, rate: float | None, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = burst
        #: The theoretical time the bytes reserved so far finish (time.monotonic()).
        self._tat = 0.0

    def delay(self, n: int, now: float | None = None) -> float:
        """Reserve ``n`` bytes; the seconds to wait before sending them (0: at once)."""
        rate = self.rate
        if rate is None:
            return 0.0
        now = time.monotonic() if now is None else now
        burst = self.burst if self.burst is not None else max(2 * CHUNK, 0.01 * rate)
        tat = max(self._tat, now)
        self._tat = tat + n / rate
        return max(0.0, self._tat - burst / rate - now)


class Throttle:
    """A TCP proxy on 127.0.0.1 forwarding to ``host:port`` at ``rate`` bytes/s per direction
    (see the module docstring). A context manager: the loop's thread runs inside the block."""

    def __init__(
        self,
        host: str,
        port: int,
        rate: float | None,
        *,
        directions: str = "both",
        burst: float | None = None,
    ) -> None:
        if directions not in DIRECTIONS:
            raise ValueError(f"directions={directions!r}: use one of {DIRECTIONS}")
        if rate is not None and not rate > 0:
            raise ValueError(f"rate={rate!r} must be > 0 bytes/s (None: no limit)")
        self.target = (host, port)
        self.directions = directions
        self.down = TokenBucket(rate if directions in ("both", "down") else None, burst)
        self.up = TokenBucket(rate if directions in ("both", "up") else None, burst)
        self._rate = rate
        #: Bytes forwarded client -> server and server -> client so far.
        self.to_server = 0
        self.to_client = 0
        #: Connections accepted so far.
        self.connections = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- settings and counters ----------------------------------------------------------------

    @property
    def rate(self) -> float | None:
        """Bytes/s per throttled direction (None: no limit)."""
        return self._rate

    @rate.setter
    def rate(self, rate: float | None) -> None:
        if rate is not None and not rate > 0:
            raise ValueError(f"rate={rate!r} must be > 0 bytes/s (None: no limit)")
        self._rate = rate

        def apply() -> None:
            for bucket, on in ((self.down, "down"), (self.up, "up")):
                if self.directions in ("both", on):
                    bucket.rate = rate
                    bucket._tat = 0.0  # a new setting starts with a full bucket

        self._call(apply)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def counts(self) -> tuple[int, int]:
        """(bytes to the server, bytes to the client) so far."""
        return self.to_server, self.to_client

    def reset_counts(self) -> None:
        self._call(self._zero)

    def _zero(self) -> None:
        self.to_server = self.to_client = 0

    def _call(self, fn: object) -> None:
        """Run ``fn`` on the loop's thread (where the counters and buckets live), or here if
        the loop is not running."""
        assert callable(fn)
        loop = self._loop
        if loop is None or not loop.is_running():
            fn()
            return
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        loop.call_soon_threadsafe(run)
        done.wait()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> Throttle:
        self._thread = threading.Thread(target=self._main, name="throttle", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"the throttle proxy did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> Throttle:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._serve, "127.0.0.1", 0, limit=4 * CHUNK)
            )
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._shutdown())
            loop.close()

    async def _shutdown(self) -> None:
        """Stop accepting, end every connection, wait for their tasks."""
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    # -- forwarding ----------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target, limit=4 * CHUNK)
        except OSError:
            writer.close()
            self._tasks.discard(task)
            return
        for w in (writer, up_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, self.up, True),
                self._pipe(up_reader, writer, self.down, False),
            )
        except asyncio.CancelledError:
            pass  # the proxy is stopping: the connection ends here
        finally:
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()
            self._tasks.discard(task)

    async def _pipe(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        bucket: TokenBucket,
        upward: bool,
    ) -> None:
        try:
            while data := await source.read(CHUNK):
                wait = bucket.delay(len(data))
                if wait > 0:
                    await asyncio.sleep(wait)
                sink.write(data)
                if upward:
                    self.to_server += len(data)
                else:
                    self.to_client += len(data)
                await sink.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(Exception):
                if sink.can_write_eof():
                    sink.write_eof()
