"""The page shell (head, navigation, live-update attributes) and small shared renderers."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from ckptstore.formatting import human_bytes, ratio
from ckptstore.manifest.records import CheckpointInfo
from ckptstore.manifest.statuses import Status
from ckptstore.web.markup import Markup, checkpoint_url, el, join, link, run_url, void

NAV = (("/", "Runs"), ("/lineage", "Lineage"), ("/storage", "Storage"))


def page(
    title: str,
    *body: Any,
    active: str = "",
    poll: str | None = None,
    changes: str | None = None,
    poll_seconds: float = 2.0,
) -> Markup:
    """A whole page. With ``poll`` (an API URL answering ``{"changes": ...}``) the page
    reloads itself when the answer differs from ``changes`` (``/static/live.js``)."""
    nav = [link(href, label, class_="active" if href == active else None) for href, label in NAV]
    head = el(
        "head",
        void("meta", charset="utf-8"),
        void("meta", name="viewport", content="width=device-width, initial-scale=1"),
        el("title", f"{title} - ckptstore"),
        void("link", rel="stylesheet", href="/static/style.css"),
        el("script", src="/static/live.js", defer=True),
    )
    header = el(
        "header",
        el("nav", link("/", "ckptstore", class_="brand"), *nav),
        el("span", "read-only", class_="readonly", title="this server never writes"),
        el("span", "live", class_="live", hidden=True) if poll else None,
    )
    attributes = {"data_poll": poll, "data_changes": changes, "data_poll_seconds": poll_seconds}
    body_el = el("body", header, el("main", *body), **(attributes if poll else {}))
    return Markup("<!doctype html>\n" + el("html", head, body_el, lang="en"))


def status_badge(status: str) -> Markup:
    """A checkpoint status as a coloured word."""
    return el("span", status, class_=f"status {status if status in set(Status) else 'other'}")


def counts_line(counts: Mapping[str, int]) -> Markup:
    """Checkpoints per status, every status that has any."""
    parts = [
        el("span", status_badge(s), f" {counts[s]}", class_="count")
        for s in Status
        if counts.get(s)
    ]
    return (
        el("span", *parts, class_="counts")
        if parts
        else el("span", "no checkpoints", class_="empty")
    )


def when(value: dt.datetime | None) -> str:
    """A time as UTC, to the second; ``-`` for None."""
    if value is None:
        return "-"
    if value.tzinfo is None:  # SQLite returns naive times; every time stored is UTC
        value = value.replace(tzinfo=dt.UTC)
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def seconds(value: float | None) -> str:
    """Seconds, three decimals; ``-`` for None."""
    return "-" if value is None else f"{value:.3f}"


def number(value: Any) -> str:
    """A metric value: 4 significant digits for floats."""
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def checkpoint_link(info: CheckpointInfo) -> Markup:
    """``run@step`` linking to the checkpoint page."""
    return link(checkpoint_url(info.id), f"{info.run}@{info.step}")


def run_link(name: str) -> Markup:
    """The run name linking to its page."""
    return link(run_url(name), name, class_="run")


def metrics_text(metrics: Mapping[str, Any] | None) -> Markup:
    """``name=value`` pairs, compact."""
    if not metrics:
        return Markup("-")
    return join(
        el("span", f"{key}={number(value)}", class_="metric") for key, value in metrics.items()
    )


def definition_list(items: Mapping[str, Any]) -> Markup:
    """``<dl>`` of label and value (values escaped unless Markup)."""
    return el("dl", *(join([el("dt", k), el("dd", v)]) for k, v in items.items()), class_="facts")


__all__ = [
    "checkpoint_link",
    "counts_line",
    "definition_list",
    "human_bytes",
    "metrics_text",
    "number",
    "page",
    "ratio",
    "run_link",
    "seconds",
    "status_badge",
    "when",
]
