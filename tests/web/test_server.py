"""``ckptstore serve`` over HTTP: what each page and API answer holds, that names stay text,
that nothing but GET and HEAD is answered, and the token and host rules."""

from __future__ import annotations

import datetime as dt
import html as html_lib
import json
import re
import shutil
import time
import urllib.parse
from html import escape as html_escape
from pathlib import Path
from typing import Any

import pytest
import torch
from web_sample import (
    ESCAPED,
    HOSTILE,
    HOSTILE_ENTRY,
    HOSTILE_METRIC,
    TRACKER,
    Sample,
    Served,
)

from ckptstore.checkpointer import open_run
from ckptstore.cli.main import main
from ckptstore.errors import ConfigError
from ckptstore.manifest.serving import open_readonly
from ckptstore.web.data import Site
from ckptstore.web.routes import App
from ckptstore.web.server import Server, check_bind

TOKEN = "a-token-of-sixteen-chars"


def html(served: Served, path: str) -> str:
    status, headers, body = served.get(path)
    assert status == 200, body[:500]
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    return body.decode()


def api(served: Served, path: str) -> Any:
    status, headers, body = served.get("/api" + path)
    assert status == 200, body[:500]
    assert headers["Content-Type"] == "application/json"
    return json.loads(body)


def cli_json(sample: Sample, capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    capsys.readouterr()
    assert main(["--db", sample.db, "--store", sample.store, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def chart(page: str, name: str) -> str:
    """The SVG element of the chart ``name`` in ``page``."""
    attribute = re.escape(html_escape(name))
    match = re.search(rf'<svg[^>]*data-chart="{attribute}".*?</svg>', page, re.S)
    assert match, f"no chart {name!r}"
    return match.group()


# -- pages and their API twins -----------------------------------------------------------------


def test_runs_page_lists_runs_with_counts_and_parents(served: Served) -> None:
    page = html(served, "/")
    assert 'href="/runs/base"' in page
    assert 'href="/runs/child"' in page
    child = served.sample.ids["base", 8]
    assert f'href="/checkpoints/{child}"' in page
    assert "base@8" in page
    filtered = html(served, "/?q=CHI")
    assert 'href="/runs/child"' in filtered
    assert 'href="/runs/base"' not in filtered
    runs = api(served, "/runs?q=base")["runs"]
    assert [r["summary"]["run"] for r in runs] == ["base"]
    assert runs[0]["counts"] == {"committed": 3, "corrupt": 1, "deleted": 4, "failed": 1}


def test_api_records_are_the_clis_json(
    served: Served, sample: Sample, capsys: pytest.CaptureFixture[str]
) -> None:
    assert [r["summary"] for r in api(served, "/runs")["runs"]] == cli_json(sample, capsys, "runs")
    listed = cli_json(sample, capsys, "ls", "base", "--all")
    assert api(served, "/runs/base/checkpoints") == listed[::-1]  # newest first
    shown = api(served, f"/checkpoints/{sample.ids['base', 8]}")["checkpoint"]
    assert shown == cli_json(sample, capsys, "show", "base@8")
    assert api(served, "/storage")["usage"] == cli_json(sample, capsys, "du")


def test_run_page_explains_every_checkpoints_fate(served: Served) -> None:
    page = html(served, "/runs/base")
    assert f'href="{TRACKER}"' in page
    fates = {h["point"]["step"]: h["fate"] for h in api(served, "/runs/base/history")}
    assert fates[8] == {
        "verdict": "kept",
        "why": "latest; step a multiple of 4; top 2 by train:loss (#2)",
    }
    assert fates[6] == {"verdict": "kept", "why": "top 2 by train:loss (#1)"}
    assert fates[4] == {"verdict": "kept", "why": "step a multiple of 4"}
    assert fates[5] == {"verdict": "deleted", "why": "deleted by retention"}
    assert fates[9]["verdict"] == "failed"
    assert "injected failure" in fates[9]["why"]
    assert fates[3]["verdict"] == "corrupt"
    assert "corrupt" in fates[3]["why"]
    for why in ("top 2 by train:loss (#1)", "deleted by retention", "injected failure"):
        assert why in page


def test_run_page_draws_metric_timing_and_byte_charts(served: Served) -> None:
    page = html(served, "/runs/base")
    loss = chart(page, "metric:train:loss")
    # Every save with the metric is on the line; the kept ones (4, 6, 8) are marked.
    points = re.search(r'<polyline points="([^"]+)"', loss)
    assert points
    assert len(points.group(1).split()) == 8
    assert len(re.findall(r"<circle", loss)) == 3
    assert "step 6: 0.3 (kept: top 2 by train:loss (#1))" in loss
    assert "metric:train:reward" in page
    assert len(re.findall(r"<polyline", chart(page, "seconds"))) == 2
    bars = chart(page, "bytes")
    assert len(re.findall(r'class="bar s0"', bars)) == 8  # uploaded, one per save
    assert "reused" in bars


def test_run_page_pages_and_filters(served: Served) -> None:
    view = api(served, "/runs/base?status=deleted")
    assert [c["checkpoint"]["step"] for c in view["checkpoints"]] == [7, 5, 2, 1]
    assert (view["page"], view["pages"]) == (1, 1)
    assert api(served, "/runs/base?page=2")["checkpoints"] == []


def test_checkpoint_page_shows_components_names_and_commands(served: Served) -> None:
    ident = served.sample.ids["base", 8]
    page = html(served, f"/checkpoints/{ident}")
    for text in ("policy", "embed", "float32", "training info", "--db"):
        assert text.lower() in page.lower()
    view = api(served, f"/checkpoints/{ident}")
    rows = {(t["component"], t["name"]): t for t in view["tensors"]}
    assert rows["policy", "w"]["shape"] == [64]
    assert rows["policy", "w"]["nbytes"] == 256
    assert rows["policy", "w"]["stored_bytes"] > 0
    assert rows["policy", "w"]["codecs"]
    assert rows["optimizer", "step"]["value"] == 8
    assert view["layout"] == "plain"
    assert view["previous_id"] == served.sample.ids["base", 6]
    assert "ckptstore --db" in view["commands"][0]
    assert "show base@8 --entries" in view["commands"][0]
    assert any("export base@8 ./base-8" in line for line in view["commands"])
    assert [line["run"] for line in view["ancestry"]] == ["base"]
    assert [f["run"] for f in view["forks"]] == ["child"]


def test_dcp_checkpoint_rows_are_its_fqns(served: Served) -> None:
    view = api(served, f"/checkpoints/{served.sample.ids['dcp', 2]}")
    assert view["layout"] == "dcp"
    rows = {t["name"]: t for t in view["tensors"]}
    assert set(rows) == {"model.weight", "model.bias", "epoch"}
    assert rows["model.weight"]["shape"] == [8, 4]
    assert rows["model.weight"]["dtype"] == "float32"
    assert rows["model.weight"]["ranks"] == [0]
    assert rows["model.weight"]["nbytes"] == 128
    assert rows["epoch"]["kind"] == "value"
    assert any("ckpt_dcp.load(state_dict, run, 2)" in line for line in view["commands"])


def test_compare_proves_what_changed_by_content_address(served: Served) -> None:
    ids = served.sample.ids
    view = api(served, f"/compare?a={ids['base', 7]}&b={ids['base', 8]}")
    verdicts = {d["name"]: d["verdict"] for d in view["diffs"]}
    assert verdicts == {
        "policy.w": "differs",
        "optimizer.step": "differs",
        "policy.embed": "same bytes",
    }
    assert view["counts"]["differs"] == 2
    assert view["counts"]["same bytes"] == 1
    across = api(served, "/compare?a=base@8&b=child@10")  # RUN@STEP, across a fork
    assert {(d["name"], d["verdict"]) for d in across["diffs"]} >= {
        ("policy.embed", "same bytes"),
        ("policy.w", "differs"),
    }
    page = html(served, f"/compare?a={ids['base', 7]}&b={ids['base', 8]}")
    assert 'class="verdict differs"' in page
    assert "same bytes</span> 1" in page


def test_storage_page_shows_usage_kinds_gc_and_damage(served: Served) -> None:
    view = api(served, "/storage")
    assert {k["kind"] for k in view["kinds"]} >= {"policy", "optimizer"}
    assert view["gc"]["corrupt_checkpoints"] == 1
    assert view["gc"]["kept_for_corrupt"] >= 1
    assert [c["step"] for c in view["corrupt"]] == [3]
    assert len(view["damaged"]) == 1
    assert len(view["quarantined"]) == 1
    page = html(served, "/storage")
    assert "What gc would do" in page
    assert "base@3" in page


def test_lineage_is_a_graph_of_links(served: Served) -> None:
    lines = {ln["run"]: ln for ln in api(served, "/lineage")}
    assert (lines["child"]["parent_run"], lines["child"]["parent_step"]) == ("base", 8)
    graph = chart(html(served, "/lineage"), "lineage")
    hostile = urllib.parse.quote(HOSTILE, safe="")
    assert f'href="/runs/{hostile}"' in graph
    assert "@8" in graph


def test_changes_move_when_a_run_saves(served: Served, sample: Sample) -> None:
    before = api(served, "/runs/live/changes")["changes"]
    assert api(served, "/runs/live/changes")["changes"] == before
    everything = api(served, "/changes")["changes"]
    with open_run("live", db=sample.db, store=sample.store, async_save=False) as run:
        latest = run.latest()
        assert latest is not None
        step = latest.step + 1
        run.save(step, {"m": torch.full((1,), float(step))}, metrics={"loss": 1 / step})
    assert api(served, "/runs/live/changes")["changes"] != before
    assert api(served, "/changes")["changes"] != everything


# -- names stay text ---------------------------------------------------------------------------


def test_hostile_names_render_as_text(served: Served) -> None:
    runs = html(served, "/")
    assert "<script>alert" not in runs
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in runs
    assert "\x1b" not in runs
    assert "esc\\x1b[31mred" in runs
    run = html(served, "/runs/" + urllib.parse.quote(HOSTILE, safe=""))
    assert "<script>alert" not in run
    assert "<b>loss" not in run
    assert "&lt;b&gt;loss&lt;/b&gt;" in chart(run, f"metric:{HOSTILE_METRIC}")
    page = html(served, f"/checkpoints/{served.sample.ids[HOSTILE, 1]}")
    assert "<img" not in page
    assert "&lt;img src=x onerror=alert(2)&gt;" in page
    assert "&lt;script&gt;" in page
    assert "<script>alert" not in page
    # The JSON keeps names exact; it is served as JSON, never sniffed as HTML.
    _status, headers, body = served.get(f"/api/checkpoints/{served.sample.ids[HOSTILE, 1]}")
    assert json.loads(body)["tensors"][0]["name"] == HOSTILE_ENTRY
    assert headers["X-Content-Type-Options"] == "nosniff"
    esc_page = html(served, "/runs/" + urllib.parse.quote(ESCAPED, safe=""))
    assert "\x1b" not in esc_page


def test_every_page_forbids_inline_scripts_and_framing(served: Served) -> None:
    for path in ("/", "/runs/base", "/api/runs", "/nope"):
        _, headers, _ = served.get(path)
        policy = headers["Content-Security-Policy"]
        assert "script-src 'self'" in policy
        assert "frame-ancestors 'none'" in policy
        assert "unsafe-inline" not in policy
        assert headers["Referrer-Policy"] == "no-referrer"


# -- what is refused ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/runs/nope", 404, "no run named 'nope'"),
        ("/checkpoints/abc", 404, "no checkpoint with id 'abc'"),
        ("/checkpoints/987654", 404, "no checkpoint with id 987654"),
        ("/api/checkpoints/987654", 404, "no checkpoint with id 987654"),
        ("/no/such/page", 404, "no page at /no/such/page"),
        ("/static/nope.css", 404, "no such static file"),
        ("/runs/base?page=x", 400, "invalid page 'x'"),
        ("/runs/base?status=lost", 400, "unknown status 'lost'"),
        ("/compare?a=1", 400, "compare needs b="),
        ("/api/compare?a=base@3&b=base@8", 404, "is marked corrupt"),
        # Issue 40 (2): percent-escapes that are not UTF-8 were a 500 and a traceback.
        ("/runs/%ff", 400, "not UTF-8"),
        ("/api/runs/%ff", 400, "not UTF-8"),
        ("/%ff", 400, "not UTF-8"),
        ("/runs/%C3%28", 400, "not UTF-8"),
    ],
)
def test_bad_paths_ids_and_parameters(served: Served, path: str, status: int, message: str) -> None:
    got, _headers, body = served.get(path)
    assert got == status
    if path.startswith("/api/"):
        assert message in json.loads(body)["error"]
    else:  # a page of the site, the message escaped, a link home
        page = body.decode()
        assert message in html_lib.unescape(page)
        assert page.startswith("<!doctype html>")
        assert '<a href="/">Back to the runs</a>' in page


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "MKCOL"])
def test_only_get_and_head_are_answered(served: Served, method: str) -> None:
    status, headers, body = served.get("/runs/base", method=method)
    assert status == 405
    assert headers["Allow"] == "GET, HEAD"
    assert b"read-only" in body


def test_head_is_get_without_the_body(served: Served) -> None:
    status, headers, body = served.get("/runs/base", method="HEAD")
    assert status == 200
    assert body == b""
    assert int(headers["Content-Length"]) > 1000


def test_requests_to_another_host_name_are_refused(served: Served) -> None:
    port = served.server.server_address[1]
    status, _, body = served.get("/", headers={"Host": f"rebound.example:{port}"})
    assert status == 421
    assert b"127.0.0.1 or localhost" in body
    assert served.get("/", headers={"Host": f"localhost:{port}"})[0] == 200


def test_a_non_loopback_bind_needs_a_token() -> None:
    for host in ("0.0.0.0", "192.0.2.1", "example.com", "::"):
        with pytest.raises(ConfigError, match="without a token"):
            check_bind(host, None)
    with pytest.raises(ConfigError, match="at least 16"):
        check_bind("0.0.0.0", "short")
    check_bind("0.0.0.0", TOKEN)
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_bind(host, None)


def test_a_token_is_required_on_every_request(sample: Sample) -> None:
    site = Site(open_readonly(sample.db), sample.store, db_label=sample.db)
    server = Server("127.0.0.1", 0, App(site), token=TOKEN)
    server.serve_in_thread()
    served = Served(server, sample)
    try:
        assert served.get("/")[0] == 401
        assert (
            served.get("/api/runs", headers={"Authorization": "Bearer wrong-token-xxxxxx"})[0]
            == 401
        )
        assert served.get("/api/runs", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
        # The token in the URL becomes a cookie, and the URL loses it.
        opener = _no_redirects()
        response = opener.open(f"{served.url}/runs/base?token={TOKEN}&page=1")
        assert response.status == 303
        assert response.headers["Location"] == "/runs/base?page=1"
        cookie = response.headers["Set-Cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        assert served.get("/runs/base", headers={"Cookie": cookie.split(";")[0]})[0] == 200
        # With a token, any Host is fine (the token is the check).
        assert (
            served.get("/", headers={"Authorization": f"Bearer {TOKEN}", "Host": "a.example"})[0]
            == 200
        )
    finally:
        server.shutdown()
        server.server_close()
        site.close()


def _no_redirects() -> Any:
    import urllib.request

    class Keep(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    class Answer(urllib.request.HTTPErrorProcessor):
        def http_response(self, request: Any, response: Any) -> Any:
            return response

    return urllib.request.build_opener(Keep, Answer)


def test_gc_preview_is_what_gc_dry_run_reports(sample: Sample, tmp_path: Path) -> None:
    from ckptstore.maintenance import collect_garbage
    from ckptstore.manifest import Database
    from ckptstore.manifest.serving import gc_preview
    from ckptstore.objectstore import LocalStore

    shutil.copy(sample.db, tmp_path / "m.db")
    shutil.copytree(sample.store, tmp_path / "store")
    db, store = Database(tmp_path / "m.db", create=False), LocalStore(tmp_path / "store")
    readonly = open_readonly(str(tmp_path / "m.db"))
    grace = dt.timedelta(seconds=1)
    try:
        time.sleep(1.1)  # every blob claimed longer ago than the grace
        for collected in (False, True):  # before any gc, and after one condemned blobs
            report = collect_garbage(db, store, grace=grace, dry_run=True)
            with readonly.connect() as conn:
                preview = gc_preview(conn, grace, dt.datetime.now(dt.UTC))
            assert (preview.condemn, preview.condemn_bytes) == (
                report.condemned,
                report.condemned_bytes,
            )
            assert (preview.sweep, preview.sweep_bytes) == (report.swept, report.swept_bytes)
            assert (preview.kept_for_corrupt, preview.kept_for_corrupt_bytes) == (
                report.kept_for_corrupt,
                report.kept_for_corrupt_bytes,
            )
            if not collected:
                assert preview.condemn > 0  # the deleted checkpoints' own chunks
                collect_garbage(db, store, grace=grace)  # condemns them; sweeps none yet
                time.sleep(1.1)
            else:
                assert preview.sweep > 0
                assert preview.condemn == 0
    finally:
        readonly.close()
        db.close()
        store.close()
