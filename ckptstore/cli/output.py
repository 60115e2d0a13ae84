"""Tables for people, JSON for scripts, progress bars on stderr.

Every command prints through :func:`emit`: with ``--json`` the payload's records as
``dataclasses.asdict`` gives them (so a field added to a record appears there at once), else
the command's text, or a table of the columns it declares.

Times are shown in UTC with the zone said: ``2026-12-02 19:01:22Z`` in text, ISO 8601 with
``+00:00`` (and microseconds) in JSON and CSV. The manifest stores UTC; SQLite hands times back
without a zone, PostgreSQL in the session's time zone, and both are converted here.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ckptstore.formatting import as_utc, dumps, json_value
from ckptstore.names import printable

#: What ``du`` and ``runs`` mean by their byte columns and ratios (the one definition is
#: :class:`ckptstore.manifest.reporting.Usage`), for their ``--help``.
RATIOS_HELP = (
    "Bytes of committed checkpoints. logical: tensor data they hold; referenced: raw bytes of "
    "the blobs each one references (indexes and pack tables included), summed over them; "
    "unique: those blobs' raw bytes counted once; stored: what they take in the store. "
    "dedup = referenced / unique (1.00x: no checkpoint shares a blob with another); "
    "compression = unique / stored."
)


@dataclass(frozen=True, slots=True)
class Column:
    """A table column: its heading, the record field it shows and how (default: as it is)."""

    head: str
    field: str
    format: Callable[[Any], Any] | None = None

    def value(self, record: Any) -> Any:
        """What this column shows for ``record``."""
        value = getattr(record, self.field)
        return value if self.format is None else self.format(value)


def emit(
    args: argparse.Namespace,
    payload: Any,
    *,
    columns: Sequence[Column] = (),
    empty: str = "",
    text: str | None = None,
    as_json: bool = False,
) -> None:
    """Print ``payload`` (a record, a list of records or a dict of them) as JSON with
    ``--json`` (or ``as_json``); else ``text`` if given, else a table of ``columns`` over the
    records (``empty`` when there are none)."""
    if args.json or as_json:
        print(dumps(jsonable(payload)))
    elif text is not None:
        print(text)
    else:
        print(render(payload, columns) if payload else empty)


def jsonable(payload: Any) -> Any:
    """``payload`` with every dataclass as a dict of its fields (nested records included)."""
    if dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        return dataclasses.asdict(payload)
    if isinstance(payload, Mapping):
        return {key: jsonable(value) for key, value in payload.items()}
    if isinstance(payload, list | tuple):
        return [jsonable(value) for value in payload]
    return payload


def render(records: Sequence[Any], columns: Sequence[Column]) -> str:
    """A table with one row per record and the given columns."""
    return table([c.head for c in columns], [[c.value(r) for c in columns] for r in records])


def cell(value: Any) -> str:
    """``value`` as a table shows it; text from the manifest (run, component and metric
    names, keys) is escaped so that it cannot drive the terminal."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dt.datetime):
        return as_utc(value).strftime("%Y-%m-%d %H:%M:%SZ")
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"), default=json_value)
    return printable(value)


def quoted(name: object) -> str:
    """``'name'``, escaped for a terminal, for messages."""
    return f"'{printable(name)}'"


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns under a heading and a rule; every cell through :func:`cell`
    (headings too: ``sql`` takes them from the query)."""
    columns = [printable(c) for c in columns]
    text = [[cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in text]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in text]
    return "\n".join(lines)


def csv_value(value: Any) -> Any:
    """``value`` for a CSV cell: text escaped as in a table, times as in JSON."""
    if isinstance(value, str):
        return printable(value)
    return json_value(value) if isinstance(value, dt.datetime) else value


class Bar:
    """A tqdm progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, total: int | None, desc: str, unit: str, enabled: bool) -> None:
        """A bar of ``total`` ``unit``s (None: unknown), shown only if ``enabled``."""
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)

    def update(self, n: int = 1) -> None:
        """Advance by ``n``."""
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Take the bar off the terminal."""
        if self._bar is not None:
            self._bar.close()


@contextmanager
def progress(total: int | None, desc: str, unit: str, enabled: bool) -> Iterator[Bar]:
    """A :class:`Bar` for the duration of the block."""
    bar = Bar(total, desc, unit, enabled)
    try:
        yield bar
    finally:
        bar.close()
