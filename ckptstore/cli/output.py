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
import logging
import sys
import time
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


#: The widest metrics cell a table shows; ``--json`` has every value in full.
METRICS_WIDTH = 60


def compact_metrics(metrics: Mapping[str, Any] | None, width: int = METRICS_WIDTH) -> str:
    """``metrics`` as a table shows them: ``name=value`` pairs, floats to 4 significant
    digits, cut at ``width`` characters with ``...`` (``-`` when there are none)."""
    if not metrics:
        return "-"
    text = " ".join(f"{name}={_short(value)}" for name, value in metrics.items())
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def _short(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)  # a count, exact
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), default=json_value)


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


#: Whether progress bars show: None (the default) on a terminal only, True (``-v`` or
#: ``--progress``) on any stderr, False (``--json``) never. ``main`` sets it.
_SHOW_PROGRESS: bool | None = None

log = logging.getLogger("ckptstore.cli")


def show_progress(mode: bool | None) -> None:
    """Where bars show from now on: None on a terminal only, True on any stderr (a log file,
    a CI console), False nowhere."""
    global _SHOW_PROGRESS
    _SHOW_PROGRESS = mode


class Bar:
    """A tqdm progress bar on stderr (never stdout): on a terminal, or anywhere with ``-v`` /
    ``--progress``; never with ``--json``. With ``-v`` each phase and the total are also
    logged (INFO), so a log file says what took the time."""

    def __init__(self, total: int | None, desc: str, unit: str, enabled: bool) -> None:
        """A bar of ``total`` ``unit``s (None: unknown), shown only if ``enabled``."""
        self._bar: Any = None
        self.desc, self.unit, self.count = desc, unit, 0
        self._started = time.monotonic()
        if not enabled or _SHOW_PROGRESS is False:
            return
        log.info("%s: started%s", desc, "" if total is None else f" ({total} {unit})")
        tty = sys.stderr.isatty()
        if tty or _SHOW_PROGRESS:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                desc=desc,
                unit=unit,
                file=sys.stderr,
                leave=not tty,  # on a terminal the result replaces it; in a log it stays
                mininterval=0.1 if tty else 1.0,
                dynamic_ncols=tty,
            )

    def update(self, n: int = 1) -> None:
        """Advance by ``n``."""
        self.count += n
        if self._bar is not None:
            self._bar.update(n)

    def phase(self, name: str, total: int | None = None) -> None:
        """Name the step now under way (``gc: sweep``); with its ``total``, the bar starts
        again from 0 of it (the logged count goes on)."""
        desc = f"{self.desc}: {name}"
        self._log("%s (%d %s so far, %.1fs)", desc, self.count, self.unit, self._elapsed())
        if self._bar is not None:
            # Drawn now (a phase may end within mininterval); reset draws it itself.
            self._bar.set_description_str(desc, refresh=total is None)
            if total is not None:
                self._bar.reset(total=total)

    def close(self) -> None:
        """Take the bar off the terminal (in a log, its last state stays)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        log.info("%s: %d %s in %.1fs", self.desc, self.count, self.unit, self._elapsed())

    def _log(self, message: str, *args: object) -> None:
        """``log.info``, on a line of its own while the bar is drawn."""
        if self._bar is None or not log.isEnabledFor(logging.INFO):
            log.info(message, *args)
            return
        with self._bar.external_write_mode(file=sys.stderr):
            log.info(message, *args)

    def _elapsed(self) -> float:
        return time.monotonic() - self._started


@contextmanager
def progress(total: int | None, desc: str, unit: str, enabled: bool) -> Iterator[Bar]:
    """A :class:`Bar` for the duration of the block."""
    bar = Bar(total, desc, unit, enabled)
    try:
        yield bar
    finally:
        bar.close()
