"""A page of a long list of entries: a name filter, a sort and a page, from the query string.

A checkpoint of a real model has hundreds of state-dict names (800 rows, tens of thousands of
pixels on one page): the checkpoint and compare pages, and their JSON, show one page of them
(:data:`PER_PAGE`), filtered by ``q`` (a substring of the name, any case) and sorted by
``sort`` (a key the page offers; ``-key`` for descending). A value the page cannot use is a
:class:`~ckptstore.errors.ConfigError` naming the valid ones (the server answers 400).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ckptstore.errors import ConfigError

T = TypeVar("T")

#: Entries on one page.
PER_PAGE = 100
#: The longest filter text accepted.
MAX_FILTER = 500
_MAX_PAGE_DIGITS = 9


@dataclass(frozen=True, slots=True)
class Slice:
    """What the query asks for: the filter text, the sort key (``-`` first: descending) and
    the page (from 1)."""

    q: str
    sort: str
    page: int

    @property
    def key(self) -> str:
        """The sort key without its direction."""
        return self.sort.removeprefix("-")

    @property
    def descending(self) -> bool:
        """Whether the sort is descending."""
        return self.sort.startswith("-")


@dataclass(frozen=True, slots=True)
class PageInfo:
    """Where a page of a filtered, sorted list is: how many match the filter (``total``) of
    how many in all (``count``), the page of ``pages``, the filter and sort it shows, and the
    sort keys it offers."""

    total: int
    count: int
    page: int
    pages: int
    per_page: int
    q: str
    sort: str
    sorts: tuple[str, ...]


def parse(query: Mapping[str, str], sorts: Sequence[str], default: str) -> Slice:
    """The slice ``query`` asks for (``q``, ``sort``, ``page``); ConfigError for a value
    that is no sort key of ``sorts``, no page number or too long a filter."""
    q = query.get("q", "")
    if len(q) > MAX_FILTER:
        raise ConfigError(f"the filter q= is {len(q)} characters: use at most {MAX_FILTER}")
    sort = query.get("sort", "") or default
    if sort.removeprefix("-") not in sorts:
        keys = ", ".join(sorts)
        raise ConfigError(
            f"invalid sort {sort!r}: use one of {keys} (a leading '-' sorts descending)"
        )
    text = query.get("page", "1") or "1"
    if not text.isascii() or not text.isdigit() or len(text) > _MAX_PAGE_DIGITS:
        raise ConfigError(f"invalid page {text!r}: use a whole number from 1")
    if int(text) < 1:
        raise ConfigError(f"page {text} does not exist: pages start at 1")
    return Slice(q, sort, int(text))


def take(
    rows: Sequence[T],
    where: Slice,
    name: Callable[[T], str],
    keys: Mapping[str, Callable[[T], Any]],
) -> tuple[list[T], PageInfo]:
    """The page of ``rows`` that ``where`` asks for: those whose ``name`` contains ``where.q``
    (any case), sorted by ``keys[where.key]`` then by name; ConfigError past the last page."""
    needle = where.q.casefold()
    kept = [r for r in rows if needle in name(r).casefold()] if needle else list(rows)
    key = keys[where.key]
    kept.sort(key=lambda r: (key(r), name(r)), reverse=where.descending)
    pages = max(1, math.ceil(len(kept) / PER_PAGE))
    if where.page > pages:
        matching = f"{len(kept)} match" if where.q else f"there are {len(kept)}"
        raise ConfigError(
            f"page {where.page} does not exist: {matching}, {pages} page(s) of {PER_PAGE}"
        )
    start = (where.page - 1) * PER_PAGE
    return kept[start : start + PER_PAGE], PageInfo(
        len(kept),
        len(rows),
        where.page,
        pages,
        PER_PAGE,
        where.q,
        where.sort,
        tuple(keys),
    )


def sized(value: int | None) -> int:
    """A size for sorting: unknown (None) before every known one."""
    return -1 if value is None else value
