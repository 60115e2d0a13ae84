"""``ckptstore serve`` over generated requests, from a real HTTP client to a running server.

The server (:class:`ckptstore.web.server.Server` over a read-only manifest, as ``ckptstore
serve`` runs it) serves a store with a few runs, one of them named with HTML in it, and
several checkpoints. Each case is a request: a path built from the routes' shapes with run
names, checkpoint ids and hostile segments (HTML carrying a marker, percent-escapes that are
not UTF-8, ``%00``, ``..``, CR LF, thousands of characters); a query string of the pages'
parameters with hostile values; headers (``Host`` variants, cookies, tokens, ranges); a method
(GET, HEAD, the others, lower case, made up) through ``http.client``; or, one case in five, a
malformed request written to a raw socket (no version, HTTP/2.0, 70,000-byte lines, a hundred
headers, binary bytes, absolute URIs, folded headers).

The oracle: every answer's status is one the server documents (its own 200, 303, 400, 401,
404, 405, 421 and the standard library's 400, 414, 431, 505 for a request it cannot parse, or
no answer to an empty request), never a 500; the server logs no error; an HTML answer holds
no marker of the input unescaped (``<fzN``, ``"fzN``, ``'fzN``); a plain-text answer holds no
control character. After the last case the server still answers ``/``.
"""

from __future__ import annotations

import http.client
import logging
import random
import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fuzz.surfaces import Finding

#: What the server may answer: its own statuses (README "A web view", web/server.py) and
#: those of ``http.server`` for a request line or headers it cannot parse.
DOCUMENTED = {200, 303, 400, 401, 404, 405, 414, 421, 431, 505}
RUNS = ("base", "child", "<b>run</b>", "a b", "x%y")
PARAMS = ("q", "page", "status", "a", "b", "verdict", "sort", "order", "dir", "filter", "token")
_MARKER = re.compile(rb"""[<"']fz\d""")


class _Errors(logging.Handler):
    """Collects the error records the server logs."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


def populate(workdir: Path) -> tuple[str, Path, list[int]]:
    """A manifest with runs and checkpoints (one run forked); its url, store and ids."""
    import torch

    from ckptstore.checkpointer import open_run

    db, store = f"sqlite:///{workdir / 'serve.db'}", workdir / "store"
    for name in RUNS:
        fork = "base@2" if name == "child" else None
        with open_run(name, db=db, store=store, async_save=False, fork_from=fork) as run:
            first = 3 if name == "child" else 1
            for step in range(first, first + 3):
                state = {"w": torch.full((16,), float(step)), "<i>n</i>": torch.arange(4)}
                run.save(step, {"model": state}, metrics={"loss": 1.0 / step})
    from sqlalchemy import create_engine, text

    engine = create_engine(db)
    with engine.connect() as conn:
        ids = [row[0] for row in conn.execute(text("SELECT id FROM checkpoints"))]
    engine.dispose()
    return db, store, ids


class ServeEngine:
    """A running server and the requests of each case."""

    time_cap = 15.0

    def __init__(self, workdir: Path, seed: int) -> None:
        from ckptstore.manifest.serving import open_readonly
        from ckptstore.web.data import Site
        from ckptstore.web.routes import App
        from ckptstore.web.server import Server

        self.seed = seed
        db, store, self.ids = populate(workdir)
        self.site = Site(open_readonly(db), str(store), db_label=db)
        self.server = Server("127.0.0.1", 0, App(self.site, poll_seconds=2.0))
        self.port = self.server.server_address[1]
        self.server.serve_in_thread()
        self.errors = _Errors()
        logging.getLogger("ckptstore.serve").addHandler(self.errors)
        self._last: dict[str, Any] = {}

    def close(self) -> None:
        """Check that the server still answers, then stop it."""
        try:
            status, _, _ = self._http("GET", "/", {"Host": f"127.0.0.1:{self.port}"})
            if status != 200:
                raise Finding("server-broken", f"/ answers {status} after the cases")
        finally:
            self.server.shutdown()
            self.server.server_close()
            self.site.close()

    def reproducer(self, i: int) -> dict[str, Any]:
        """The request of case ``i`` (regenerated from (seed, i))."""
        return {"seed": self.seed, **self._last}

    # -- requests ------------------------------------------------------------------------------

    def _hostile(self, rng: random.Random, i: int) -> str:
        return rng.choice(
            (
                f"<fz{i}>",
                f'"fz{i}',
                f"'fz{i} onmouseover=x",
                f"</title><fz{i}>",
                "\x00",
                "\x1b[31m",
                "..",
                "../../etc/passwd",
                "x" * rng.choice((100, 5000)),
                "\u202e\ud7ff\ufeff",
                "-1",
                "0",
                "99999999999999999999999",
                "1e9",
                "NaN",
                "",
                "base@2",
                "base@999",
                "'; DROP TABLE runs;--",
                "\r\nSet-Cookie: x=1",
            )
        )

    def _segment(self, rng: random.Random, i: int) -> str:
        choice = rng.randrange(6)
        if choice == 0:
            return quote(rng.choice(RUNS), safe="")
        if choice == 1:
            return str(rng.choice((*self.ids, 0, -1, 10**30)))
        if choice == 2:
            return rng.choice(("%ff", "%C3%28", "%00", "%2F", "%2e%2e", "%", "%zz", "%E2%82"))
        return quote(self._hostile(rng, i), safe=rng.choice(("", "<>\"'")))

    def _path(self, rng: random.Random, i: int) -> str:
        shapes = (
            (),
            ("runs",),
            ("changes",),
            ("lineage",),
            ("storage",),
            ("compare",),
            ("runs", None),
            ("runs", None, "history"),
            ("runs", None, "checkpoints"),
            ("runs", None, "changes"),
            ("checkpoints", None),
            ("static", None),
            (None,),
            (None, None, None, None),
        )
        parts = [p if p is not None else self._segment(rng, i) for p in rng.choice(shapes)]
        if rng.random() < 0.4:
            parts.insert(0, "api")
        if rng.random() < 0.1:
            parts.append(self._segment(rng, i))
        path = "/" + "/".join(parts) + ("/" if rng.random() < 0.1 else "")
        if rng.random() < 0.6:
            query = []
            for _ in range(rng.randint(1, 4)):
                name = rng.choice((*PARAMS, self._segment(rng, i)))
                value = rng.choice((self._segment(rng, i), str(rng.randint(-2, 5)), "committed"))
                query.append(f"{quote(name, safe='%')}={value}")
            path += "?" + "&".join(query)
        return path

    def _headers(self, rng: random.Random, i: int) -> dict[str, str]:
        host = rng.choice(
            (
                f"127.0.0.1:{self.port}",
                f"127.0.0.1:{self.port}",
                f"127.0.0.1:{self.port}",
                f"127.0.0.1:{self.port}",
                f"localhost:{self.port}",
                "localhost",
                "[::1]:80",
                "evil.example",
                "127.0.0.1.evil.example",
                "",
                "x" * 3000,
            )
        )
        headers = {"Host": host}
        for name, value in rng.sample(
            [
                ("Cookie", rng.choice(("ckptstore_token=nope", "a=\x7f;;;=", '"', f"<fz{i}>=1"))),
                ("Authorization", rng.choice(("Bearer ", "Bearer x", "Basic Zm9vOmJhcg=="))),
                ("Range", "bytes=0-10"),
                ("If-None-Match", '"x"'),
                ("Accept", "application/json"),
                ("Content-Length", rng.choice(("0", "5", "-1", "abc"))),
                ("Expect", "100-continue"),
                ("Connection", rng.choice(("close", "keep-alive", "upgrade"))),
            ],
            rng.randint(0, 3),
        ):
            headers[name] = value
        return headers

    def _http(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in headers.items():
                conn.putheader(name, value)
            conn.endheaders()
            response = conn.getresponse()
            body = response.read() if method.upper() != "HEAD" else b""
            return response.status, response.getheader("Content-Type") or "", body
        finally:
            conn.close()

    def _raw(self, rng: random.Random, i: int) -> bytes:
        host = f"Host: 127.0.0.1:{self.port}\r\n".encode()
        return rng.choice(
            (
                b"GET\r\n\r\n",
                b"GET / HTTP/2.0\r\n" + host + b"\r\n",
                b"GET / HTTP/1.1 extra\r\n\r\n",
                b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n" + host + b"\r\n",
                b"GET / HTTP/1.1\r\n"
                + host
                + b"".join(b"X-%d: 1\r\n" % k for k in range(120))
                + b"\r\n",
                b"GET / HTTP/1.1\r\n" + host + b"X: " + b"y" * 70_000 + b"\r\n\r\n",
                b"\x00\xff\xfe\r\n\r\n",
                b"GET /runs/%ff HTTP/1.0\r\n" + host + b"\r\n",
                b"GET http://127.0.0.1/ HTTP/1.1\r\n" + host + b"\r\n",
                b"GET * HTTP/1.1\r\n" + host + b"\r\n",
                b"GET /\tx HTTP/1.1\r\n" + host + b"\r\n",
                b"GET / HTTP/1.1\r\n" + host + b" folded\r\n\r\n",
                b"GET /runs/<fz%d> HTTP/1.1\r\n" % i + host + b"\r\n",
                b"GET /runs/\xc3\x28 HTTP/1.1\r\n" + host + b"\r\n",
                b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil\r\n\r\n",
                b"",
                b"GET / HTTP/1.1\r\n" + host,  # never ends its headers: the client gives up
                b"HEAD /storage HTTP/1.1\r\n" + host + b"Connection: close\r\n\r\n",
                b"POST /runs HTTP/1.1\r\n" + host + b"Content-Length: 4\r\n\r\nabcd",
                b"GET /?"
                + b"&".join(b"q%d=%d" % (k, k) for k in range(5000))
                + b" HTTP/1.0\r\n"
                + host
                + b"\r\n",
            )
        )

    def _send_raw(self, data: bytes) -> tuple[int | None, str, bytes]:
        with socket.create_connection(("127.0.0.1", self.port), timeout=3) as sock:
            try:
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
            except OSError:  # the server answered and closed before taking it all
                pass
            chunks = []
            try:
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
            except (ConnectionResetError, TimeoutError):
                pass
        reply = b"".join(chunks)
        if not reply:
            return None, "", b""
        if not reply.startswith(b"HTTP/"):
            # An error to a request line http.server cannot read is written the HTTP/0.9
            # way: its HTML page alone, no status line.
            code = re.search(rb"<p>Error code: (\d{3})</p>", reply)
            if code is None:
                raise Finding("malformed-answer", repr(reply[:300]))
            return int(code.group(1)), "text/html (HTTP/0.9)", reply
        head, _, body = reply.partition(b"\r\n\r\n")
        match = re.match(rb"HTTP/1\.[01] (\d{3}) ", head)
        if match is None:
            raise Finding("malformed-answer", repr(reply[:300]))
        ctype = re.search(rb"(?im)^content-type:\s*([^\r\n]*)", head)
        return int(match.group(1)), (ctype.group(1).decode() if ctype else ""), body

    # -- the oracle ----------------------------------------------------------------------------

    def case(self, i: int) -> str:
        """One request; check its answer."""
        rng = random.Random(f"{self.seed}/{i}")
        logged = len(self.errors.records)
        if rng.random() < 0.2:
            data = self._raw(rng, i)
            self._last = {"raw": data[:2000].decode("latin-1")}
            status, ctype, body = self._send_raw(data)
            kind = "raw"
        else:
            method = rng.choice(
                ("GET",) * 12 + ("HEAD",) * 3 + ("POST", "PUT", "DELETE", "OPTIONS", "get", "FOO")
            )
            path, headers = self._path(rng, i), self._headers(rng, i)
            self._last = {"method": method, "path": path, "headers": headers}
            try:
                status, ctype, body = self._http(method, path, headers)
            except (http.client.HTTPException, OSError) as exc:
                raise Finding("no-answer", f"{type(exc).__name__}: {exc}") from None
            kind = "api" if path.startswith("/api/") else "page"
        if len(self.errors.records) > logged:
            raise Finding("logged-error", self.errors.records[-1][-2000:])
        if status is None:
            return "raw: closed without an answer"
        if status not in DOCUMENTED:
            raise Finding(f"status-{status}", body[:500].decode(errors="replace"))
        if ctype.startswith("text/html") and _MARKER.search(body):
            found = _MARKER.search(body)
            assert found is not None
            at = found.start()
            raise Finding("reflected", body[max(0, at - 200) : at + 200].decode(errors="replace"))
        if ctype.startswith("text/plain") and re.search(rb"[\x00-\x08\x0b-\x1f\x7f]", body):
            raise Finding("control-character", body[:500].decode(errors="replace"))
        return f"{kind} {status}"


def engine(workdir: Path, seed: int) -> ServeEngine:
    """The family's engine (see :mod:`fuzz.surfaces`)."""
    return ServeEngine(workdir, seed)
