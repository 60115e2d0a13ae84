"""The pages in a real browser: Debian's headless Chromium driven by Playwright.

Navigates runs -> lineage -> run -> checkpoint -> compare, checks that the charts are drawn
(on the SVG, not pixels), that hostile names stay text (no dialog, no element they would
create), that a training run's page updates itself after a new commit, and that nothing is
fetched from anywhere but the server. A screenshot of each page goes to the test's tmp dir.

Needs ``chromium-headless-shell`` (``apt-get install -y chromium-headless-shell``; Playwright's
own browser download needs the internet) and PyPI ``playwright``; ``make test`` installs both.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from playwright.sync_api import Browser, Page, sync_playwright
from web_sample import ESCAPED, HOSTILE, HOSTILE_ENTRY, Served

from ckptstore.checkpointer import open_run

CANDIDATES = ("chromium-headless-shell", "chromium", "chromium-browser")
LAUNCH_ARGS = [
    "--no-sandbox",  # tests run as root (CI); the sandbox refuses root
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-sync",
    "--no-first-run",
    "--metrics-recording-only",
    "--mute-audio",
]
TIMEOUT_MS = 15_000


def chromium() -> str:
    """The browser binary: $CKPTSTORE_CHROMIUM, else the first of CANDIDATES on PATH."""
    found = os.environ.get("CKPTSTORE_CHROMIUM") or next(
        (path for name in CANDIDATES if (path := shutil.which(name))), None
    )
    if found is None:
        pytest.fail(
            "no headless Chromium: apt-get install -y chromium-headless-shell (or set "
            "$CKPTSTORE_CHROMIUM to a Chromium binary); `make test` installs it"
        )
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium(), args=LAUNCH_ARGS)
        yield launched
        launched.close()


@dataclass
class Watched:
    """A page and what it did that it should not: dialogs, script errors, console errors
    (CSP violations among them), requests to anywhere but the server."""

    page: Page
    shots: Path
    dialogs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.shots / f"{name}.png"), full_page=True)
        assert (self.shots / f"{name}.png").stat().st_size > 1000

    def clean(self) -> None:
        assert self.dialogs == []
        assert self.errors == []
        assert self.foreign == []


@pytest.fixture
def watched(browser: Browser, served: Served, tmp_path: Path) -> Iterator[Watched]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    seen = Watched(page, tmp_path)

    def dialog(d: Any) -> None:
        seen.dialogs.append(d.message)
        d.dismiss()

    def request(r: Any) -> None:
        if not r.url.startswith(served.url):
            seen.foreign.append(r.url)

    page.on("dialog", dialog)
    page.on("pageerror", lambda exc: seen.errors.append(str(exc)))
    page.on("console", lambda m: m.type == "error" and seen.errors.append(m.text))
    page.on("request", request)
    yield seen
    context.close()


def test_runs_lineage_run_checkpoint_compare(watched: Watched, served: Served) -> None:
    page, ids = watched.page, served.sample.ids
    page.goto(served.url + "/")
    assert page.locator("table.runs tbody tr").count() >= 6
    watched.shot("runs")

    page.click("header nav >> text=Lineage")
    graph = page.locator('svg[data-chart="lineage"]')
    assert graph.bounding_box()["height"] > 50  # type: ignore[index]
    watched.shot("lineage")

    page.click('svg[data-chart="lineage"] a[data-run="base"]')
    page.wait_for_url("**/runs/base")
    loss = page.locator('svg[data-chart="metric:train:loss"]')
    assert loss.bounding_box()["width"] > 300  # type: ignore[index]
    points = loss.locator("polyline.line").get_attribute("points") or ""
    assert len(points.split()) == 8
    assert loss.locator("circle.mark").count() == 3  # the kept checkpoints
    assert page.locator('svg[data-chart="bytes"] rect.bar').count() == 16
    watched.shot("run")

    page.check(f'input[name="a"][value="{ids["base", 6]}"]')
    page.check(f'input[name="b"][value="{ids["base", 8]}"]')
    page.click("text=Compare A with B")
    page.wait_for_url("**/compare?*")
    assert page.locator("table.diffs span.verdict.differs").count() == 2
    watched.shot("compare-from-run")

    page.goto(f"{served.url}/runs/base")
    page.click('a.step:text-is("8")')
    page.wait_for_url(f"**/checkpoints/{ids['base', 8]}")
    names = page.locator("table.tensors code").all_inner_texts()
    assert {"embed", "w", "step"} <= set(names)
    watched.shot("checkpoint")

    page.click("text=compare with the previous committed checkpoint")
    page.wait_for_url(f"**/compare?a={ids['base', 6]}&b={ids['base', 8]}")
    assert "differs 2" in page.locator("p.verdicts").inner_text()
    watched.shot("compare")
    watched.clean()


def test_hostile_names_stay_text(watched: Watched, served: Served) -> None:
    page = watched.page
    page.goto(served.url + "/")
    link = page.locator("table.runs a.run", has_text=HOSTILE)
    assert link.inner_text() == HOSTILE
    assert page.get_by_text("esc\\x1b[31mred").count() == 1
    assert ESCAPED not in page.content()
    link.click()
    assert page.locator("h1").inner_text() == f"run {HOSTILE}"
    watched.shot("hostile-run")
    page.goto(f"{served.url}/checkpoints/{served.sample.ids[HOSTILE, 1]}")
    assert page.locator("table.tensors code").inner_text() == HOSTILE_ENTRY
    assert page.locator("main img, main b, main script").count() == 0
    page.wait_for_timeout(300)  # an onerror handler would have fired by now
    watched.shot("hostile-checkpoint")
    watched.clean()


def test_a_training_runs_page_updates_after_a_new_commit(watched: Watched, served: Served) -> None:
    page, sample = watched.page, served.sample
    page.goto(served.url + "/runs/live")
    assert page.locator(".live").is_visible()  # the polling script runs (CSP allows it)
    before = page.locator("a.step").count()
    with open_run("live", db=sample.db, store=sample.store, async_save=False) as run:
        latest = run.latest()
        assert latest is not None
        step = latest.step + 1
        run.save(step, {"m": torch.full((1,), float(step))}, metrics={"loss": 1 / step})
    page.locator(f'a.step:text-is("{step}")').wait_for()
    assert page.locator("a.step").count() == before + 1
    # The page may first show the save while it is pending (no chart point yet): its commit
    # changes the counts again and the page reloads once more.
    points = ""
    for _ in range(100):
        chart = page.locator('svg[data-chart="metric:loss"] polyline')
        points = (chart.get_attribute("points") if chart.count() else "") or ""
        if len(points.split()) == before + 1:
            break
        page.wait_for_timeout(100)
    assert len(points.split()) == before + 1
    watched.shot("live-after-commit")
    watched.clean()
