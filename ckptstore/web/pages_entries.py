"""The long lists of the checkpoint and compare pages: a page of state-dict names (or of
compared parameters) with a name filter, sortable headers and a pager, all links of GET URLs
(:mod:`ckptstore.web.listing` reads them back)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlencode

from ckptstore.web.compare import Param, TensorDiff
from ckptstore.web.comparison import CompareView
from ckptstore.web.data import CheckpointView
from ckptstore.web.layout import checkpoint_link, human_bytes, page
from ckptstore.web.listing import PageInfo
from ckptstore.web.markup import Markup, checkpoint_url, el, join, link, void

#: Builds the URL of the same list with other query values (None drops one).
Url = Callable[..., str]


def _url(path: str, fixed: dict[str, Any]) -> Url:
    def to(**changes: Any) -> str:
        values = {**fixed, **changes}
        kept = {k: v for k, v in values.items() if v not in (None, "")}
        return path + (f"?{urlencode(kept)}" if kept else "") + "#entries"

    return to


def checkpoint_entries_url(view: CheckpointView) -> Url:
    """URLs of the checkpoint page's state-dict list as it is shown now."""
    info = view.entries
    fixed = {"q": info.q, "sort": info.sort} if info else {}
    return _url(checkpoint_url(view.checkpoint.info.id), fixed)


def compare_entries_url(view: CompareView) -> Url:
    """URLs of the compare page's list as it is shown now."""
    info = view.entries
    fixed: dict[str, Any] = {"a": view.a.id, "b": view.b.id, "verdict": view.verdict}
    if info:
        fixed |= {"q": info.q, "sort": info.sort}
    return _url("/compare", fixed)


def controls(info: PageInfo, to: Url, hidden: dict[str, Any], what: str) -> Markup:
    """The name filter (a GET form keeping ``hidden``'s values) and what the list shows."""
    shown = f"{info.total} of {info.count} {what}" if info.q else f"{info.count} {what}"
    return el(
        "form",
        *(void("input", type="hidden", name=k, value=v) for k, v in hidden.items() if v),
        void("input", type="hidden", name="sort", value=info.sort),
        void("input", type="search", name="q", value=info.q, placeholder="name contains"),
        el("button", "Filter", type="submit"),
        " ",
        link(to(q=None, page=None), "clear") if info.q else None,
        el("span", f" {shown}", class_="more"),
        method="get",
        action=to().split("?", 1)[0].split("#", 1)[0],
        class_="filter",
    )


def header(label: str, key: str | None, info: PageInfo, to: Url) -> Markup | str:
    """A column header: a link sorting by ``key`` (again: the other way), marked when active."""
    if key is None or key not in info.sorts:
        return label
    active = info.sort.removeprefix("-") == key
    descending = info.sort.startswith("-")
    target = f"-{key}" if active and not descending else key
    arrow = (" \N{DOWNWARDS ARROW}" if descending else " \N{UPWARDS ARROW}") if active else ""
    return link(to(sort=target, page=None), label + arrow, class_="sort")


def pager(info: PageInfo, to: Url) -> Markup:
    """Links to the first, previous, next and last pages (nothing for a single page)."""
    if info.pages <= 1:
        return Markup("")
    n = info.page
    return el(
        "p",
        link(to(page=1), "first") if n > 1 else None,
        link(to(page=n - 1), "previous") if n > 1 else None,
        f" page {n} of {info.pages} ",
        link(to(page=n + 1), "next") if n < info.pages else None,
        link(to(page=info.pages), "last") if n < info.pages else None,
        class_="pager",
    )


def table_of(
    columns: Sequence[tuple[str, str | None]],
    rows: Sequence[Sequence[Any]],
    info: PageInfo,
    to: Url,
    *,
    empty: str,
    class_: str,
) -> Markup:
    """A table whose headers sort it, or ``empty`` without rows."""
    if not rows:
        return el("p", empty, class_="empty")
    head = el("thead", el("tr", *(el("th", header(c, k, info, to)) for c, k in columns)))
    body = [el("tr", *(el("td", cell) for cell in row)) for row in rows]
    return el("table", head, el("tbody", *body), class_=class_)


# -- a checkpoint's state dict ---------------------------------------------------------------

_TENSOR_COLUMNS = (
    ("component", "component"),
    ("name", "name"),
    ("kind", "kind"),
    ("dtype", "dtype"),
    ("shape / value", "shape"),
    ("bytes", "bytes"),
    ("stored", "stored"),
    ("codec", None),
    ("ranks", "ranks"),
)


def tensors_section(view: CheckpointView) -> Markup:
    """The checkpoint's state-dict names: a page of them, filtered and sorted."""
    if view.tensors_error:
        return el("p", f"state-dict names unavailable: {view.tensors_error}", class_="error")
    info = view.entries
    if info is None:
        return el("p", "not read", class_="empty")
    to = checkpoint_entries_url(view)
    rows = [
        (
            r.component,
            el("code", r.name),
            r.kind,
            r.dtype or "-",
            "x".join(map(str, r.shape)) if r.is_array else short_value(r.value),
            human_bytes(r.nbytes) if r.is_array else "-",
            human_bytes(r.stored_bytes) if r.is_array else "-",
            ", ".join(r.codecs) or "-",
            ", ".join(map(str, r.ranks)) or "-",
        )
        for r in view.tensors
    ]
    empty = "no entry's name contains that" if info.q else "no entries"
    return join(
        [
            controls(info, to, {}, "entries"),
            table_of(_TENSOR_COLUMNS, rows, info, to, empty=empty, class_="tensors"),
            pager(info, to),
        ]
    )


def short_value(value: Any) -> str:
    """A JSON value as a short text (80 characters at most)."""
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


# -- comparing -------------------------------------------------------------------------------

_DIFF_COLUMNS = (
    ("verdict", "verdict"),
    ("name", "name"),
    ("why", None),
    ("A", "bytes"),
    ("B", None),
    ("dtype", "dtype"),
)


def compare_page(view: CompareView) -> Markup:
    """What changed from A to B, parameter by parameter."""
    a, b = view.a, view.b
    top = el(
        "p",
        "A: ",
        checkpoint_link(a),
        " \N{RIGHTWARDS ARROW} B: ",
        checkpoint_link(b),
        " ",
        link(f"/compare?{urlencode({'a': b.id, 'b': a.id})}", "(swap)"),
    )
    body: list[Any]
    if view.error or view.entries is None:
        body = [el("p", f"cannot compare: {view.error}", class_="error")]
    else:
        to = compare_entries_url(view)
        verdicts = [
            el("strong", _badge(v), f" {n}")
            if v == view.verdict
            else link(to(verdict=v, page=None), _badge(v), f" {n}")
            for v, n in view.counts.items()
        ]
        everything = (
            link(to(verdict=None, page=None), "all") if view.verdict else el("strong", "all")
        )
        info = view.entries
        rows = [_diff_row(d) for d in view.diffs]
        body = [
            el("p", "show: ", everything, " ", *verdicts, class_="verdicts"),
            controls(info, to, {"a": a.id, "b": b.id, "verdict": view.verdict}, "parameters"),
            table_of(_DIFF_COLUMNS, rows, info, to, empty="no parameter here", class_="diffs"),
            pager(info, to),
        ]
    note = el(
        "p",
        "Parameters matched by name whatever the layout (whole, packed, sharded). No tensor "
        "was loaded: equal digests are equal bytes; small values in packs are compared byte "
        "for byte.",
        class_="note",
    )
    return page(
        f"compare {a.run}@{a.step} / {b.run}@{b.step}",
        el("h1", "Compare"),
        top,
        note,
        el("section", *body, id="entries"),
    )


def _badge(verdict: str) -> Markup:
    return el("span", verdict, class_=f"verdict {verdict.replace(' ', '-')}")


def _side(param: Param | None) -> str:
    if param is None:
        return "-"
    if not param.is_array:
        return short_value(param.value)
    shape = "x".join(map(str, param.shape)) if param.shape is not None else "shards"
    where = ", ".join(param.components)
    return f"{shape} {human_bytes(param.nbytes)} ({where})"


def _diff_row(diff: TensorDiff) -> tuple[Any, ...]:
    dtype = {p.dtype for p in (diff.a, diff.b) if p is not None and p.dtype}
    return (
        _badge(diff.verdict),
        el("code", diff.name),
        diff.why,
        _side(diff.a),
        _side(diff.b),
        " / ".join(sorted(dtype)) or "-",
    )
