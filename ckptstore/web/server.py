"""The HTTP server of ``ckptstore serve``: the standard library's ``ThreadingHTTPServer`` and a
handler that answers GET and HEAD only.

Safe by default:

- It binds the loopback interface; any other address needs a token (:func:`check_bind`).
- With a token, every request must carry it: ``Authorization: Bearer TOKEN``, the cookie the
  server sets, or ``?token=TOKEN`` once (answered with the cookie and a redirect to the same
  URL without it, so the token stays out of history and logs). Without a token, only requests
  addressed to a loopback name are answered (``Host``), so a web page cannot reach the server
  through a DNS name it rebinds to 127.0.0.1.
- Every other method is 405; a bad path or id is 404, as a page of the site (JSON under
  ``/api/``); every response forbids inline scripts and framing (``Content-Security-Policy``),
  sniffing and referrers.
- The database is opened read-only (:func:`ckptstore.manifest.serving.open_readonly`), the
  store never written: no endpoint writes anything, whatever a handler does.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
import threading
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from ckptstore.errors import CkptStoreError, ConfigError, DatabaseError
from ckptstore.names import printable
from ckptstore.web.pages import error_page
from ckptstore.web.routes import App, Request, Response, html_response, json_response

log = logging.getLogger("ckptstore.serve")

COOKIE = "ckptstore_token"
MIN_TOKEN_LENGTH = 16
SECURITY_HEADERS = (
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
    ("Cross-Origin-Resource-Policy", "same-origin"),
)
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8"}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is the loopback interface only."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The host of a ``Host`` header, without the port (``[::1]:8000`` -> ``[::1]``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0]


def check_bind(host: str, token: str | None) -> None:
    """Refuse a non-loopback bind without a token, and a token too short to be one."""
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"--token must be at least {MIN_TOKEN_LENGTH} characters (e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_urlsafe())'`)"
        )
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve on {host}, which is not the loopback interface, without a token: "
            "anyone who can reach it could read every run; pass --token TOKEN (at least "
            f"{MIN_TOKEN_LENGTH} characters), or bind 127.0.0.1 and tunnel (ssh -L)"
        )


def static_files() -> dict[str, tuple[bytes, str]]:
    """The files under ``/static/``: name -> (bytes, content type)."""
    folder = resources.files("ckptstore.web") / "static"
    found = {}
    for item in folder.iterdir():
        suffix = "." + item.name.rsplit(".", 1)[-1]
        if item.is_file() and suffix in STATIC_TYPES:
            found[item.name] = (item.read_bytes(), STATIC_TYPES[suffix])
    return found


class Server(ThreadingHTTPServer):
    """The threaded HTTP server with its app, token and static files."""

    daemon_threads = True

    def __init__(self, host: str, port: int, app: App, *, token: str | None = None) -> None:
        """Bind ``host:port`` (port 0: any free port) for ``app``; checks the bind first."""
        check_bind(host, token)
        self.app = app
        self.token = token
        self.static = static_files()
        self.address_family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        super().__init__((host.strip("[]"), port), Handler)

    @property
    def url(self) -> str:
        """The base URL the server answers on."""
        host, port = self.server_address[0], self.server_address[1]
        text = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://{f'[{text}]' if ':' in text else text}:{port}/"

    def serve_in_thread(self) -> threading.Thread:
        """Serve from a daemon thread (tests, benchmarks); stop with ``shutdown()``."""
        thread = threading.Thread(target=self.serve_forever, name="ckptstore-serve", daemon=True)
        thread.start()
        return thread


class Handler(BaseHTTPRequestHandler):
    """Answers GET and HEAD; every other method is 405."""

    server: Server
    server_version = "ckptstore"
    sys_version = ""

    def do_GET(self) -> None:
        """Answer a GET."""
        self._answer(head=False)

    def do_HEAD(self) -> None:
        """Answer a HEAD (a GET without the body)."""
        self._answer(head=True)

    def __getattr__(self, name: str) -> Any:
        # BaseHTTPRequestHandler looks up do_<METHOD>; every method but GET and HEAD is 405.
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self) -> None:
        body = b"405 method not allowed: this server is read-only (GET and HEAD only)\n"
        self._send(
            Response(405, body, "text/plain; charset=utf-8", (("Allow", "GET, HEAD"),)),
            head=False,
        )

    def log_message(self, format: str, *args: Any) -> None:
        """Requests go to the ``ckptstore.serve`` logger (``-v`` shows them)."""
        log.info("%s %s", self.address_string(), format % args)

    def _answer(self, *, head: bool) -> None:
        try:
            response = self._respond()
        except Exception:
            log.exception("internal error answering %s", self.path)
            response = Response(
                500, b"500 internal error; see the server's log\n", "text/plain; charset=utf-8"
            )
        self._send(response, head=head)

    def _respond(self) -> Response:
        parts = urlsplit(self.path)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        api = parts.path.startswith("/api/")
        refused = self._refused(query, parts.path)
        if refused is not None:
            return refused
        if parts.path.startswith("/static/"):
            found = self.server.static.get(parts.path.removeprefix("/static/"))
            if found is None:
                return _error(404, "no such static file", api=False)
            return Response(200, found[0], found[1], (("Cache-Control", "max-age=3600"),))
        try:
            segments = tuple(unquote(s, errors="strict") for s in parts.path.split("/") if s)
        except UnicodeDecodeError:
            # Nothing of the path is echoed: its bytes are not text.
            return _error(400, "the path's percent-escapes are not UTF-8 text", api=api)
        try:
            return self.server.app.handle(Request(segments, query))
        except LookupError as exc:
            return _error(404, str(exc), api=api)
        except ConfigError as exc:
            return _error(400, str(exc), api=api)
        except DatabaseError as exc:
            return _error(503, f"the manifest database is unavailable: {exc}", api=api)
        except CkptStoreError as exc:
            return _error(500, str(exc), api=api)

    def _refused(self, query: dict[str, str], path: str) -> Response | None:
        """A response refusing the request (wrong host, missing token, a token in the URL to
        turn into a cookie), or None to answer it."""
        token = self.server.token
        if token is None:
            if not is_loopback(host_name(self.headers.get("Host") or "")):
                return _error(
                    421,
                    "without --token this server answers requests to 127.0.0.1 or localhost only",
                    api=True,
                )
            return None
        given = query.pop("token", None)
        if given is not None and hmac.compare_digest(given.encode(), token.encode()):
            rest = urlencode(query)
            cookie = f"{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/"
            location = path + (f"?{rest}" if rest else "")
            return Response(
                303, b"", "text/plain", (("Location", location), ("Set-Cookie", cookie))
            )
        if not hmac.compare_digest(self._presented().encode(), token.encode()):
            return _error(
                401, "a token is needed: open the URL `ckptstore serve` printed", api=True
            )
        return None

    def _presented(self) -> str:
        """The token this request carries (bearer header or cookie), or ""."""
        auth = self.headers.get("Authorization") or ""
        if auth.startswith("Bearer "):
            return auth.removeprefix("Bearer ").strip()
        try:
            morsel = SimpleCookie(self.headers.get("Cookie") or "").get(COOKIE)
        except CookieError:
            return ""
        return morsel.value if morsel is not None else ""

    def _send(self, response: Response, *, head: bool) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        for name, value in (*SECURITY_HEADERS, *response.headers):
            self.send_header(name, value)
        if not any(name == "Cache-Control" for name, _ in response.headers):
            self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not head:
            self.wfile.write(response.body)


def _error(status: int, message: str, *, api: bool) -> Response:
    """An error: its status and plain message, as JSON (``{"error": ...}``) for the API, else
    as a page of the site (control characters of names in it escaped, the text HTML-escaped)."""
    if api:
        return json_response({"error": message, "status": status}, status)
    return html_response(error_page(status, printable(message)), status)
