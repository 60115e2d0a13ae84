"""Times in CLI output say their zone: UTC, ``2026-12-02 19:01:22Z`` in text and ISO 8601 with
``+00:00`` in JSON and CSV, whatever the database hands back (SQLite: no zone; PostgreSQL: the
session's time zone, here set to one far from UTC)."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url
from tiny_runs import Site, make_site

from ckptstore.cli import main

TEXT_TIME = re.compile(r"\b\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ$")


@pytest.fixture
def site(db_url: str, tmp_path: Path) -> Site:
    return shifted_site(db_url, tmp_path)


@pytest.fixture
def pg_site(pg_schema_url: str, tmp_path: Path) -> Site:
    return shifted_site(pg_schema_url, tmp_path)


def shifted_site(db_url: str, tmp_path: Path) -> Site:
    """A site whose PostgreSQL sessions are not in UTC."""
    made = make_site(db_url, tmp_path)
    url = make_url(db_url)
    if url.get_backend_name() != "postgresql":
        return made
    # Read back in a session whose time zone is UTC+05:45 (and keep the schema's search_path).
    options = f"{url.query['options']} -cTimeZone=Asia/Kathmandu"
    shifted = url.update_query_dict({"options": options}).render_as_string(hide_password=False)
    return Site(shifted, made.store)


def cli(site: Site, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert main([*site.base, *args]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def utc(text: str) -> dt.datetime:
    when = dt.datetime.fromisoformat(text)
    assert when.utcoffset() == dt.timedelta(0), text
    assert text.endswith("+00:00"), text
    return when


def test_show_and_latest_give_times_in_utc(site: Site, capsys: pytest.CaptureFixture[str]) -> None:
    record = json.loads(cli(site, capsys, "--json", "show", "shared@2"))
    created, committed = utc(record["created_at"]), utc(record["committed_at"])
    now = dt.datetime.now(dt.UTC)
    assert now - dt.timedelta(minutes=10) < created <= committed <= now
    latest = json.loads(cli(site, capsys, "--json", "latest", "shared"))
    assert utc(latest["committed_at"]) >= committed
    listed = json.loads(cli(site, capsys, "--json", "ls", "shared"))
    assert [utc(c["created_at"]) for c in listed][1] == created

    text = cli(site, capsys, "show", "shared@2")
    shown = dict(line.strip().split(": ", 1) for line in text.splitlines() if ": " in line)
    for name, expected in (("created_at", created), ("committed_at", committed)):
        assert TEXT_TIME.search(shown[name]), shown[name]
        assert shown[name] == expected.strftime("%Y-%m-%d %H:%M:%SZ")


@pytest.mark.integration
def test_sql_gives_postgresql_times_in_utc(
    pg_site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    """(SQLite hands `sql` its times as the text it stores: no zone to convert.)"""
    site = pg_site
    query = "SELECT step, committed_at FROM checkpoint_summary WHERE run = 'shared' ORDER BY step"
    rows = json.loads(cli(site, capsys, "--json", "sql", query, "--allow-superuser"))
    assert [utc(r["committed_at"]).tzinfo for r in rows] == [dt.UTC] * 3
    table = cli(site, capsys, "sql", query, "--allow-superuser").splitlines()[2:]
    assert all(TEXT_TIME.search(line) for line in table), table
    data = cli(site, capsys, "sql", query, "--allow-superuser", "--format", "csv")
    assert [utc(r["committed_at"]) for r in csv.DictReader(io.StringIO(data))] == [
        utc(r["committed_at"]) for r in rows
    ]
