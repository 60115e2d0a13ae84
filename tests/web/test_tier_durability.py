"""What a checkpoint survives, on the web as in the CLI: a local (node-local tiers only) and a
committed (remote) checkpoint carry ``durability`` and ``replicas`` in the API, exactly as
``ckptstore ls --json`` and ``show --json`` print them, and the run and checkpoint pages show
them; a page reads the replica counts in one query, and without the ORM or torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from web_sample import Served

from ckptstore import TierConfig, open_run
from ckptstore.cli.main import main
from ckptstore.manifest import reading
from ckptstore.manifest.serving import open_readonly
from ckptstore.web.data import Site
from ckptstore.web.routes import App, Request


@dataclass(frozen=True)
class Tiered:
    """A store whose run ``tiered`` has step 1 drained (committed) and step 2 local only."""

    db: str
    store: str
    committed_id: int
    local_id: int
    app: App


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiered]:
    root = tmp_path_factory.mktemp("tiered")
    db, store = str(root / "manifest.db"), str(root / "store")
    tiers = TierConfig(local_dir=str(root / "tier-{node}"), node="a", fsync=False)
    with open_run("tiered", db=db, store=store, tiers=tiers, async_save=False) as run:
        committed = run.save(1, {"policy": {"w": torch.ones(10)}}).wait()
        run.drain()
        local = run.save(2, {"policy": {"w": torch.zeros(10)}}).wait()
    site = Site(open_readonly(db), store, db_label=db)
    yield Tiered(db, store, committed.id, local.id, App(site))
    site.close()


def get(app: App, *segments: str, **query: str) -> tuple[str, Any]:
    """(content type, body: parsed JSON, or the page's text)."""
    response = app.handle(Request(segments, query))
    assert response.status == 200
    body = response.body.decode()
    return response.content_type, json.loads(body) if segments[0] == "api" else body


def cli_json(t: Tiered, capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    capsys.readouterr()
    assert main(["--db", t.db, "--store", t.store, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_api_reports_local_and_remote_durability_as_the_cli_does(
    tiered: Tiered, capsys: pytest.CaptureFixture[str]
) -> None:
    _, listed = get(tiered.app, "api", "runs", "tiered", "checkpoints")
    assert [(c["step"], c["status"], c["durability"], c["replicas"]) for c in listed] == [
        (2, "local", "local", 1),
        (1, "committed", "remote", 1),
    ]
    assert listed == cli_json(tiered, capsys, "ls", "tiered")[::-1]  # newest first
    _, view = get(tiered.app, "api", "runs", "tiered")
    assert [c["checkpoint"] for c in view["checkpoints"]] == listed
    _, shown = get(tiered.app, "api", "checkpoints", str(tiered.local_id))
    assert shown["checkpoint"]["durability"] == "local"
    assert shown["checkpoint"]["replicas"] == 1
    assert shown["checkpoint"] == cli_json(tiered, capsys, "show", "tiered@2")
    _, remote = get(tiered.app, "api", "checkpoints", str(tiered.committed_id))
    assert remote["checkpoint"] == cli_json(tiered, capsys, "show", "tiered@1")


def test_run_page_has_a_durability_column(tiered: Tiered) -> None:
    content_type, page = get(tiered.app, "runs", "tiered")
    assert content_type == "text/html; charset=utf-8"
    assert "<th>durability</th>" in page
    cells = re.findall(r'<span class="durability ([a-z]+)">([^<]*)</span>', page)
    assert cells == [("local", "local, 1 tier copy"), ("remote", "remote, 1 tier copy")]
    assert "on node-local tiers only: a drain commits it" in page  # the local one's fate


def test_checkpoint_page_has_a_durability_line(tiered: Tiered) -> None:
    _, local = get(tiered.app, "checkpoints", str(tiered.local_id))
    line = re.search(r"<dt>durability</dt><dd>(.*?)</dd>", local)
    assert line, "no durability line"
    assert '<span class="durability local">local, 1 tier copy</span>' in line.group(1)
    assert "on node-local tiers only" in line.group(1)
    _, remote = get(tiered.app, "checkpoints", str(tiered.committed_id))
    line = re.search(r"<dt>durability</dt><dd>(.*?)</dd>", remote)
    assert line, "no durability line"
    assert "remote, 1 tier copy" in line.group(1)
    assert "the object store holds it" in line.group(1)


def test_a_page_reads_replica_counts_once(tiered: Tiered, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[int]] = []
    counts = reading.replica_counts

    def counted(db: Any, ids: Any) -> dict[int, int]:
        calls.append(list(ids))
        return counts(db, ids)

    monkeypatch.setattr(reading, "replica_counts", counted)
    get(tiered.app, "runs", "tiered")
    get(tiered.app, "api", "runs", "tiered", "checkpoints")
    assert calls == [[tiered.local_id, tiered.committed_id]] * 2


def test_unloadable_checkpoints_have_no_durability(served: Served) -> None:
    """The sample's ``base`` run has committed, deleted, failed and corrupt checkpoints (no
    tiers: committed ones have 0 tier copies)."""
    status, _, body = served.get("/api/runs/base/checkpoints?status=failed")
    assert status == 200
    (failed,) = json.loads(body)
    assert failed["durability"] is None
    status, _, body = served.get("/runs/base")
    page = body.decode()
    assert '<span class="durability none">-</span>' in page
    assert '<span class="durability remote">remote, 0 tier copies</span>' in page


def test_the_pages_import_neither_the_orm_nor_torch(tiered: Tiered) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from ckptstore.manifest.serving import open_readonly
        from ckptstore.web.data import Site
        from ckptstore.web.routes import App, Request

        site = Site(open_readonly({tiered.db!r}), {tiered.store!r}, db_label="db")
        app = App(site)
        for path in (
            ("runs", "tiered"),
            ("api", "runs", "tiered", "checkpoints"),
            ("checkpoints", "{tiered.local_id}"),
            ("api", "checkpoints", "{tiered.local_id}"),
        ):
            assert app.handle(Request(path, {{}})).status == 200, path
        site.close()
        loaded = [m for m in sys.modules if m == "torch" or m.startswith(
            ("torch.", "ckptstore.manifest._orm", "ckptstore.manifest.models"))]
        assert not loaded, loaded
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
