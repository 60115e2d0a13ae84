"""The reliability suite's report: one summary line per family of torture.

Tests add their counts with the ``reliability_report`` fixture::

    reliability_report.add("crash points", killed=1, resumed_verified=1, lost=0)

and the session ends with lines such as ``crash points: 24 killed, 24 resumed verified, 0 lost``
(counts summed over the tests; the keys keep their order, underscores read as spaces). These are
the figures docs/reliability.md quotes from a ``make stress`` run.

``sqlite_url`` is a fresh SQLite manifest for the cases that need no PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest


class ReliabilityReport:
    def __init__(self) -> None:
        self.families: dict[str, dict[str, int]] = {}

    def add(self, family: str, **counts: int) -> None:
        totals = self.families.setdefault(family, {})
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + int(value)

    def lines(self) -> list[str]:
        return [f"{family}: {_render(totals)}" for family, totals in self.families.items()]


def _render(totals: Mapping[str, int]) -> str:
    return ", ".join(f"{value} {key.replace('_', ' ')}" for key, value in totals.items())


_REPORT = pytest.StashKey[ReliabilityReport]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_REPORT] = ReliabilityReport()


@pytest.fixture
def reliability_report(pytestconfig: pytest.Config) -> ReliabilityReport:
    return pytestconfig.stash[_REPORT]


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    report = config.stash.get(_REPORT, None)
    if report is None or not report.families:
        return
    terminalreporter.section("reliability")
    for line in report.lines():
        terminalreporter.write_line(line)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite manifest under the test's tmp dir (for the cases that need no PostgreSQL)."""
    return f"sqlite:///{tmp_path / 'manifest.db'}"
