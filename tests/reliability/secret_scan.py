"""Looking for a secret everywhere it could leak: every log record (DEBUG, tracebacks included),
every exception text with its whole chain, stdout, stderr and every database cell.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hostile import OPTIONS, SECRETS, assert_exact, weights
from sqlalchemy import create_engine, inspect, text

from ckptstore.cas import blob_key
from ckptstore.checkpointer import open_run
from ckptstore.cli import main
from ckptstore.errors import CkptStoreError
from ckptstore.objectstore import ObjectStore
from ckptstore.serialize.load import read_index


@dataclass
class Scanner:
    """Counts every text it is shown and keeps those that contain a secret."""

    secrets: tuple[str, ...]
    texts: int = 0
    leaks: list[tuple[str, str]] = field(default_factory=list)

    def text(self, where: str, value: str) -> None:
        self.texts += 1
        for secret in self.secrets:
            if secret in value:
                start = value.index(secret)
                self.leaks.append((where, value[max(0, start - 120) : start + 40]))

    def exception(self, where: str, exc: BaseException) -> None:
        """The exception's text, its notes, and the whole chain as a traceback prints it."""
        seen: set[int] = set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            self.text(f"{where}: {type(current).__name__}", str(current))
            self.text(f"{where}: repr", repr(current))
            current = current.__cause__ or current.__context__
        self.text(f"{where}: traceback", "".join(traceback.format_exception(exc)))

    def records(self, where: str, records: list[logging.LogRecord]) -> None:
        formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
        for record in records:
            self.text(f"{where}: log {record.name}", formatter.format(record))

    def database(self, url: str) -> None:
        engine = create_engine(url)
        try:
            with engine.connect() as conn:
                inspector = inspect(conn)
                names = inspector.get_table_names() + inspector.get_view_names()
                assert {"runs", "checkpoints", "blobs", "components"} <= set(names)
                for name in names:
                    for row in conn.execute(text(f'SELECT * FROM "{name}"')):
                        self.text(f"database {name}", repr(tuple(row)))
        finally:
            engine.dispose()

    def summary(self) -> str:
        """Where the secret showed up: one line per place, with a count and an excerpt."""
        places: dict[str, tuple[int, str]] = {}
        for where, excerpt in self.leaks:
            count, first = places.get(where, (0, excerpt))
            places[where] = (count + 1, first)
        return "\n".join(f"{n} x {where}: ...{first}..." for where, (n, first) in places.items())

    def report(self, reliability_report: Any) -> None:
        reliability_report.add(SECRETS, scanned_texts=self.texts, leaked=len(self.leaks))


class Recorder(logging.Handler):
    """Every record at DEBUG and above, from every logger (botocore, urllib3, sqlalchemy...)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def record_everything() -> Iterator[Recorder]:
    """Every log record of the block, DEBUG and above, kept by one handler on the root logger."""
    root = logging.getLogger()
    recorder = Recorder()
    handlers, level = root.handlers[:], root.level
    root.handlers = [recorder]
    root.setLevel(logging.DEBUG)
    try:
        yield recorder
    finally:
        root.handlers = handlers
        root.setLevel(level)


def scan_cli(
    scanner: Scanner, capsys: pytest.CaptureFixture[str], base: list[str], *commands: list[str]
) -> list[int]:
    """Run each command with every log record kept; scan its records, stdout and stderr."""
    codes = []
    for argv in commands:
        capsys.readouterr()
        with record_everything() as recorder:
            codes.append(main([*base, *argv]))
        out, err = capsys.readouterr()
        scanner.text(f"cli {argv[0]} stdout", out)
        scanner.text(f"cli {argv[0]} stderr", err)
        scanner.records(f"cli {argv[0]}", recorder.records)
    return codes


#: What each of CLI_READS exits with after ``workload``: its resume past a damaged blob leaves a
#: checkpoint marked corrupt, which keeps ``verify`` at 1 until it is repaired or released.
CLI_READS_EXIT = [0, 0, 0, 0, 1, 1, 0, 0, 0]


CLI_READS = [
    ["runs"],
    ["ls", "r"],
    ["show", "--entries", "r"],
    ["latest", "r"],
    ["--json", "verify", "--no-mark"],
    ["verify"],
    ["gc", "--dry-run"],
    ["du"],
    ["sql", "SELECT * FROM checkpoints"],
]


def workload(
    scanner: Scanner,
    db: str,
    store: ObjectStore,
    broken: list[Callable[[], Any]],
) -> None:
    """Saves, loads, a resume past a damaged blob, and ``broken`` calls that must fail."""
    with record_everything() as recorder:
        with open_run("r", db=db, store=store, writer_options=OPTIONS) as run:
            run.save(1, {"policy": weights(1)}, metrics={"loss": 1.0}).wait()
            info = run.save(2, {"policy": weights(2)}).wait()
            assert_exact(run.load(step=2).state["policy"], weights(2))
            scanner.text("repr", f"{run!r} {run.db!r} {run.store!r} {info!r}")
            index = read_index(store, info.components[0].index_digest)
            key = blob_key(index.entry("w").segments[0].digest)
            damaged = bytearray(store.get(key))
            damaged[-1] ^= 1
            store.delete([key])
            store.put(key, bytes(damaged))
            loaded = run.load()  # logs the corrupt step at ERROR
            assert loaded.info.step == 1
            scanner.text("skipped", repr(loaded.skipped))
        for call in broken:
            with pytest.raises(CkptStoreError) as info:
                call()
            scanner.exception("broken call", info.value)
    scanner.records("workload", recorder.records)
    assert any(r.levelno >= logging.ERROR for r in recorder.records)
