"""``ckptstore serve``: a read-only web view of the manifest (see :mod:`ckptstore.web`)."""

from __future__ import annotations

import argparse
import gc
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from ckptstore.cli.context import CliContext
from ckptstore.cli.exits import EXIT_OK
from ckptstore.cli.output import emit
from ckptstore.cli.protocol import Subparsers
from ckptstore.errors import ConfigError
from ckptstore.manifest.db import redact
from ckptstore.manifest.serving import open_readonly
from ckptstore.settings import default_store
from ckptstore.web.commands import location_label
from ckptstore.web.data import Site
from ckptstore.web.routes import App
from ckptstore.web.server import Server, check_bind


def register(
    sub: Subparsers, parents: Sequence[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """``serve [--host H] [--port P] [--token T] [--poll S] [--allow-superuser]``."""
    parser = sub.add_parser(
        "serve",
        parents=parents,
        description="Serve a read-only web view of the runs, checkpoints and storage, with a "
        "JSON API under /api. It binds the loopback interface unless told otherwise; any other "
        "address needs --token.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=_port, default=8000, help="port (default 8000; 0 picks a free one)"
    )
    parser.add_argument(
        "--token",
        help="require this secret (16+ characters) on every request; needed to bind an "
        "address other than loopback",
    )
    parser.add_argument(
        "--poll",
        type=_poll,
        default=2.0,
        metavar="SECONDS",
        help="how often an open run page asks for new checkpoints (default 2)",
    )
    parser.add_argument(
        "--allow-superuser",
        action="store_true",
        help="PostgreSQL: serve even when connected as a superuser (reads still run as "
        "ckptstore_reader, but a superuser could leave that role)",
    )
    return parser


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    """Serve until interrupted (Ctrl-C or SIGTERM)."""
    check_bind(args.host, args.token)
    db = open_readonly(ctx.db_location, allow_superuser=args.allow_superuser)
    store = args.store if args.store is not None else default_store()
    # The copyable commands name both as given (a relative path stays relative, like the
    # store's), the password of a URL masked.
    site = Site(db, store, db_label=location_label(ctx.db_location))
    try:
        server = Server(args.host, args.port, App(site, poll_seconds=args.poll), token=args.token)
    except OSError as exc:
        site.close()
        raise ConfigError(f"cannot serve on {args.host}:{args.port}: {exc.strerror}") from exc
    # What start-up loaded lives as long as the server: keep it out of every garbage collection
    # (a page of a long run allocates enough to trigger several).
    gc.freeze()
    url = server.url + (f"?token={args.token}" if args.token else "")
    emit(
        args,
        {"url": url, "database": redact(db.url), "store": store},
        text=f"serving {url} (read-only: {redact(db.url)}, {store}); Ctrl-C stops it",
    )
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        site.close()
    return EXIT_OK


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _port(text: str) -> int:
    """``--port``: 0 to 65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: use 0 to 65535")
    return int(text)


def _poll(text: str) -> float:
    """``--poll``: seconds, 0.2 to 3600."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.2 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"invalid --poll {text!r}: use 0.2 to 3600 seconds")
    return value
