"""Which URL shows what: each route turns a request into a page or its JSON.

Pages and their API twins (the same record, ``/api`` before the path):

===============================  ==========================================================
``/?q=TEXT``                     runs (whose name contains TEXT)
``/lineage``                     the fork tree
``/runs/NAME?page=N&status=S``   a run (NAME percent-encoded: any run name works)
``/checkpoints/ID``              a checkpoint, a page of its state-dict names
``/compare?a=A&b=B&verdict=V``   two checkpoints (ids, or RUN@STEP of committed ones)
``/storage``                     usage, gc preview, damage
===============================  ==========================================================

The checkpoint and compare pages list state-dict names a page at a time
(:mod:`ckptstore.web.listing`): ``q`` keeps the names containing it (any case), ``sort`` orders
by a key (``-key``: descending), ``page`` picks 100 of them; a value they cannot use is 400.

API only: ``/api/runs/NAME/history`` (every checkpoint's chart point and fate),
``/api/runs/NAME/steps`` (the metrics logged per step: name -> ``[[step, value], ...]``),
``/api/runs/NAME/checkpoints?page=N`` (``ckptstore ls --json``'s records, newest first),
``/api/runs/NAME/changes`` and ``/api/changes`` (what the pages poll).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptstore.errors import CheckpointNotFoundError, ConfigError, IntegrityError
from ckptstore.formatting import dumps
from ckptstore.manifest import reading as reads
from ckptstore.names import parse_target
from ckptstore.web import curves, data, listing, pages, pages_entries, pages_run
from ckptstore.web.compare import ORDER
from ckptstore.web.comparison import COMPARE_DEFAULT_SORT, COMPARE_SORTS, compare_view
from ckptstore.web.data import Site
from ckptstore.web.durability import CheckpointRecord
from ckptstore.web.markup import Markup

_DIGITS = re.compile(r"[0-9]{1,18}")


@dataclass(frozen=True, slots=True)
class Request:
    """A GET: the decoded path segments and the query (the last value of each name)."""

    segments: tuple[str, ...]
    query: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Response:
    """What to send: status, body and its type, extra headers."""

    status: int
    body: bytes
    content_type: str
    headers: tuple[tuple[str, str], ...] = ()


def html_response(markup: Markup, status: int = 200) -> Response:
    """A page."""
    return Response(status, markup.encode(), "text/html; charset=utf-8")


def json_response(payload: Any, status: int = 200) -> Response:
    """A record (or list of them) as JSON, as the CLI's ``--json`` prints it."""
    return Response(status, dumps(plain(payload)).encode(), "application/json")


def plain(value: Any) -> Any:
    """``value`` with every record as a dict of its fields: what ``dataclasses.asdict`` (the
    CLI's ``--json``) gives, without its deep copies (a run's history is 10,000 records). A
    checkpoint's record is its fields with ``durability`` and ``replicas`` after them, as
    ``ckptstore ls --json`` and ``show --json`` print it."""
    if isinstance(value, CheckpointRecord):
        return {
            **plain(value.info),
            "durability": value.durability,
            "replicas": value.replicas,
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: plain(getattr(value, name)) for name in _fields(type(value))}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple record
        return {name: plain(item) for name, item in zip(value._fields, value, strict=True)}
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


@functools.cache
def _fields(record_type: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(record_type))


class App:
    """The routes over one :class:`~ckptstore.web.data.Site`."""

    def __init__(self, site: Site, *, poll_seconds: float = 2.0) -> None:
        """Routes over ``site``; pages of runs poll for changes every ``poll_seconds``."""
        self.site = site
        self.poll_seconds = poll_seconds

    def handle(self, request: Request) -> Response:
        """The response to ``request`` (LookupError and ConfigError propagate: the server
        turns them into 404 and 400)."""
        segments = request.segments
        api = bool(segments) and segments[0] == "api"
        path = segments[1:] if api else segments
        route = self._route(path)
        if route is None:
            raise CheckpointNotFoundError(f"no page at /{'/'.join(segments)}")
        return route(request, path, api)

    def _route(
        self, path: tuple[str, ...]
    ) -> Callable[[Request, tuple[str, ...], bool], Response] | None:
        shapes: dict[
            tuple[str | None, ...], Callable[[Request, tuple[str, ...], bool], Response]
        ] = {
            (): self._runs,
            ("runs",): self._runs,
            ("changes",): self._changes,
            ("lineage",): self._lineage,
            ("storage",): self._storage,
            ("compare",): self._compare,
            ("runs", None): self._run,
            ("runs", None, "history"): self._history,
            ("runs", None, "steps"): self._steps,
            ("runs", None, "checkpoints"): self._checkpoints,
            ("runs", None, "changes"): self._changes,
            ("checkpoints", None): self._checkpoint,
        }
        for shape, handler in shapes.items():
            if len(shape) == len(path) and all(
                s is None or s == p for s, p in zip(shape, path, strict=True)
            ):
                return handler
        return None

    def _runs(self, request: Request, _path: tuple[str, ...], api: bool) -> Response:
        view = data.runs_view(self.site, request.query.get("q", ""))
        return (
            json_response(view) if api else html_response(pages.runs_page(view, self.poll_seconds))
        )

    def _changes(self, _request: Request, path: tuple[str, ...], api: bool) -> Response:
        if not api:
            raise CheckpointNotFoundError("no page here: changes are at /api/.../changes")
        return json_response(
            {"changes": data.changes(self.site, path[1] if len(path) > 1 else None)}
        )

    def _lineage(self, _request: Request, _path: tuple[str, ...], api: bool) -> Response:
        lines = data.lineage_view(self.site)
        return json_response(lines) if api else html_response(pages.lineage_page(lines))

    def _storage(self, _request: Request, _path: tuple[str, ...], api: bool) -> Response:
        view = data.storage_view(self.site)
        return json_response(view) if api else html_response(pages.storage_page(view))

    def _run(self, request: Request, path: tuple[str, ...], api: bool) -> Response:
        page = _number(request.query.get("page", "1"), "page")
        status = request.query.get("status") or None
        view, history = data.run_page(self.site, path[1], page=page, status=status)
        if api:
            return json_response(view)
        stepped = [m for m in view.metrics if m in view.step_metrics]
        steps = curves.step_curves(self.site, view.run.id, stepped)
        return html_response(pages_run.run_page(view, history, self.poll_seconds, steps))

    def _history(self, _request: Request, path: tuple[str, ...], api: bool) -> Response:
        if not api:
            raise CheckpointNotFoundError("no page here: see /api/runs/.../history")
        return json_response(data.run_history(self.site, path[1]))

    def _steps(self, _request: Request, path: tuple[str, ...], api: bool) -> Response:
        if not api:
            raise CheckpointNotFoundError("no page here: the run's page charts its steps")
        return json_response(curves.run_steps(self.site, path[1]))

    def _checkpoints(self, request: Request, path: tuple[str, ...], api: bool) -> Response:
        if not api:
            raise CheckpointNotFoundError("no page here: the run's page lists its checkpoints")
        page = _number(request.query.get("page", "1"), "page")
        view = data.run_view(
            self.site, path[1], page=page, status=request.query.get("status") or None
        )
        return json_response([row.checkpoint for row in view.checkpoints])

    def _checkpoint(self, request: Request, path: tuple[str, ...], api: bool) -> Response:
        checkpoint_id = _checkpoint_id(path[1])
        where = listing.parse(request.query, tuple(data.TENSOR_SORTS), data.TENSOR_DEFAULT_SORT)
        view = data.checkpoint_view(self.site, checkpoint_id, where=where)
        return json_response(view) if api else html_response(pages_run.checkpoint_page(view))

    def _compare(self, request: Request, _path: tuple[str, ...], api: bool) -> Response:
        a, b = (self._resolve(request.query.get(k, ""), k) for k in ("a", "b"))
        where = listing.parse(request.query, tuple(COMPARE_SORTS), COMPARE_DEFAULT_SORT)
        verdict = request.query.get("verdict") or None
        if verdict is not None and verdict not in ORDER:
            raise ConfigError(f"invalid verdict {verdict!r}: use one of {', '.join(ORDER)}")
        view = compare_view(self.site, a, b, where, verdict)
        return json_response(view) if api else html_response(pages_entries.compare_page(view))

    def _resolve(self, text: str, what: str) -> int:
        """A checkpoint id, or the id of the committed checkpoint ``RUN@STEP``."""
        text = text.strip()
        if _DIGITS.fullmatch(text):
            return int(text)
        if not text:
            raise ConfigError(f"compare needs {what}=: a checkpoint id or RUN@STEP")
        name, step = parse_target(text, what=what)
        run = reads.require_run(self.site.db, name)
        try:
            info = (
                reads.latest(self.site.db, run)
                if step is None
                else reads.committed_at(self.site.db, run, step)
            )
        except IntegrityError as exc:  # RUN@STEP names committed ones; an id names any
            raise CheckpointNotFoundError(f"{exc}; or compare it by its id") from exc
        if info is None:
            raise CheckpointNotFoundError(f"run {name!r} has no committed checkpoint")
        return info.id


def _number(text: str, what: str) -> int:
    if not _DIGITS.fullmatch(text):
        raise ConfigError(f"invalid {what} {text!r}: use a whole number")
    return int(text)


def _checkpoint_id(text: str) -> int:
    if not _DIGITS.fullmatch(text):
        raise CheckpointNotFoundError(f"no checkpoint with id {text!r}: ids are whole numbers")
    return int(text)
