"""Building HTML so that text from the manifest can only ever be text.

Every string that is not already :class:`Markup` is escaped where it is put into a page: run,
component, tensor and metric names, errors, config values. Control and invisible characters
(ESC, bidi overrides) are shown as escapes (``\\x1b``), as the CLI prints them
(:func:`ckptstore.names.printable`), and ``& < > " '`` become entities. Pages are built from
:func:`el`, which escapes its text children and attribute values, so no page formats a name
into HTML by hand.
"""

from __future__ import annotations

import functools
import html
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from ckptstore.names import printable


class Markup(str):
    """HTML that is safe as it is (built by this module, or escaped already)."""

    __slots__ = ()


def esc(value: object) -> Markup:
    """``value`` as text in HTML: invisible characters as escapes, then entities."""
    if isinstance(value, Markup):
        return value
    text = str(value)
    # Most text is plain ASCII (numbers, coordinates, names): printable() leaves it unchanged.
    if not (text.isascii() and text.isprintable() and "\\" not in text):
        text = printable(text)
    return Markup(html.escape(text, quote=True))


def join(parts: Iterable[Any]) -> Markup:
    """The parts one after the other, each escaped unless it is Markup."""
    return Markup("".join(_child(p) for p in parts))


def _child(part: Any) -> str:
    if part is None:
        return ""
    if isinstance(part, Markup):
        return part
    if isinstance(part, str | int | float):
        return esc(part)
    return join(part)


def attrs(values: Mapping[str, Any]) -> Markup:
    """Attributes: ``class_`` is ``class``, ``data_x`` is ``data-x``; None and False are left
    out, True is the bare name; every value escaped."""
    out = []
    for key, value in values.items():
        if value is None or value is False:
            continue
        name = _attribute(key)
        out.append(f" {name}" if value is True else f' {name}="{esc(value)}"')
    return Markup("".join(out))


@functools.cache
def _attribute(key: str) -> str:
    return key.rstrip("_").replace("_", "-")


def el(tag: str, *children: Any, **attributes: Any) -> Markup:
    """``<tag attributes>children</tag>``."""
    inside = attrs(attributes) if attributes else ""
    return Markup(f"<{tag}{inside}>{join(children)}</{tag}>")


def void(tag: str, **attributes: Any) -> Markup:
    """An element without content (``<input ...>``, ``<meta ...>``)."""
    return Markup(f"<{tag}{attrs(attributes)}>")


def link(href: str, *children: Any, **attributes: Any) -> Markup:
    """``<a href=...>``."""
    return el("a", *children, href=href, **attributes)


def table(
    headers: Sequence[Any], rows: Iterable[Sequence[Any]], *, empty: str = "none", **attributes: Any
) -> Markup:
    """A table with a header row; ``empty`` instead when there are no rows."""
    body = [el("tr", *(el("td", cell) for cell in row)) for row in rows]
    if not body:
        return el("p", empty, class_="empty")
    head = el("thead", el("tr", *(el("th", h) for h in headers)))
    return el("table", head, el("tbody", *body), **attributes)


def pre(lines: Iterable[str], **attributes: Any) -> Markup:
    """Lines of text in a ``<pre>``, each escaped (the line breaks kept)."""
    return el("pre", Markup("\n".join(esc(line) for line in lines)), **attributes)


def pretty_json(value: Any) -> Markup:
    """``value`` as indented JSON text in a ``<pre>`` (control characters in strings are
    JSON escapes already)."""
    return pre(json.dumps(value, indent=2, sort_keys=True, default=str).splitlines(), class_="json")


# -- URLs -------------------------------------------------------------------------------------


def run_url(name: str, **query: Any) -> str:
    """The page of the run ``name`` (any characters: the name is one quoted path segment)."""
    return f"/runs/{quote(name, safe='')}" + _query(query)


def checkpoint_url(checkpoint_id: int, **query: Any) -> str:
    """The page of one checkpoint."""
    return f"/checkpoints/{checkpoint_id}" + _query(query)


def compare_url(a: int, b: int) -> str:
    """The comparison of two checkpoints."""
    return "/compare" + _query({"a": a, "b": b})


def _query(values: Mapping[str, Any]) -> str:
    kept = {k: v for k, v in values.items() if v is not None}
    return f"?{urlencode(kept)}" if kept else ""
