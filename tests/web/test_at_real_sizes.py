"""The web view at real sizes (issue 42, item 8): entry lists paged, filtered and sorted; compare
by parameter name across layouts; per-step curves; 404 pages; storage figures and commands.

A store of its own, built through the real APIs: ``wide`` (one plain checkpoint of 250 small
tensors, packed), ``plain``/``dcp`` (the same model saved whole and as a DCP checkpoint, then
changed), ``steps`` (50 steps logged per step, saves at 10, 20 and 30).
"""

from __future__ import annotations

import html as html_lib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from web_sample import Sample, Served

from ckptstore.checkpointer import open_run
from ckptstore.manifest.records import CheckpointInfo
from ckptstore.manifest.serving import open_readonly
from ckptstore.web.commands import for_checkpoint, location_label
from ckptstore.web.compare import params
from ckptstore.web.data import Site
from ckptstore.web.entries import Piece, TensorRow
from ckptstore.web.routes import App
from ckptstore.web.server import Server

WIDE = 250


def model(step: int) -> dict[str, torch.Tensor]:
    """A small model whose weight changes at step 3."""
    return {
        "weight": torch.full((8, 4), 2.0 if step >= 3 else 1.0),
        "bias": torch.arange(4, dtype=torch.float32),
    }


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from ckptstore.integrations import dcp as ckpt_dcp

    root = tmp_path_factory.mktemp("big")
    sample = Sample(str(root / "manifest.db"), str(root / "store"))
    with open_run("wide", db=sample.db, store=sample.store, async_save=False) as run:
        state = {f"layer{i:03d}.w": torch.full((i + 1,), float(i)) for i in range(WIDE)}
        sample.ids["wide", 1] = run.save(1, {"model": state}).wait().id
    with open_run("plain", db=sample.db, store=sample.store, async_save=False) as run:
        for step in (1, 3):
            sample.ids["plain", step] = run.save(step, {"model": model(step)}).wait().id
    with open_run("dcp", db=sample.db, store=sample.store) as run:
        for step in (1, 3):
            sample.ids["dcp", step] = ckpt_dcp.save({"model": model(step)}, run, step).id
    with open_run("steps", db=sample.db, store=sample.store, async_save=False) as run:
        for step in range(1, 51):
            run.log_metrics(step, {"loss": 1.0 / step, "lr": 0.1})
            if step % 10 == 0 and step <= 30:
                # A component of plain values: no tensor data (0 logical bytes), an index.
                state = {"m": torch.full((2,), float(step)), "opt": {"step": step}}
                kinds = {"opt": "optimizer"}
                run.save(
                    step, state, metrics={"loss": 1.0 / step}, trigger="period", kinds=kinds
                ).wait()
    site = Site(open_readonly(sample.db), sample.store, db_label=sample.db)
    server = Server("127.0.0.1", 0, App(site, poll_seconds=0.3))
    server.serve_in_thread()
    yield Served(server, sample)
    server.shutdown()
    server.server_close()
    site.close()


def page(served: Served, path: str, status: int = 200) -> str:
    got, headers, body = served.get(path)
    assert got == status, body[:600]
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    return body.decode()


def api(served: Served, path: str, status: int = 200) -> Any:
    got, headers, body = served.get("/api" + path)
    assert got == status, body[:600]
    assert headers["Content-Type"] == "application/json"
    return json.loads(body)


# -- 1. entries at real sizes ------------------------------------------------------------------


def test_a_checkpoints_entries_come_a_page_at_a_time(big: Served) -> None:
    ident = big.sample.ids["wide", 1]
    first = api(big, f"/checkpoints/{ident}")
    assert len(first["tensors"]) == 100
    assert first["entries"] | {"sorts": None} == {
        "total": WIDE, "count": WIDE, "page": 1, "pages": 3, "per_page": 100, "q": "",
        "sort": "component", "sorts": None,
    }  # fmt: skip
    last = api(big, f"/checkpoints/{ident}?page=3")
    assert [t["name"] for t in last["tensors"]][-1] == "layer249.w"
    assert len(last["tensors"]) == 50
    text = page(big, f"/checkpoints/{ident}?page=2")
    assert len(re.findall(r"<code>layer\d+\.w</code>", text)) == 100
    assert f'href="/checkpoints/{ident}?sort=component&amp;page=3#entries"' in text
    assert "page 2 of 3" in text


def test_filter_and_sort_by_query_string_with_links(big: Served) -> None:
    ident = big.sample.ids["wide", 1]
    found = api(big, f"/checkpoints/{ident}?q=LAYER24")  # any case
    assert [t["name"] for t in found["tensors"]] == [f"layer24{i}.w" for i in range(10)]
    assert (found["entries"]["total"], found["entries"]["count"]) == (10, WIDE)
    biggest = api(big, f"/checkpoints/{ident}?sort=-bytes")["tensors"]
    assert [t["nbytes"] for t in biggest[:3]] == [1000, 996, 992]
    text = page(big, f"/checkpoints/{ident}?sort=-bytes&q=layer1")
    # Headers sort (the active one the other way), the filter form keeps the sort.
    assert f'href="/checkpoints/{ident}?q=layer1&amp;sort=bytes#entries"' in text
    assert f'href="/checkpoints/{ident}?q=layer1&amp;sort=dtype#entries"' in text
    assert '<input type="hidden" name="sort" value="-bytes">' in text
    assert "100 of 250 entries" in text


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("sort=colour", "invalid sort 'colour': use one of name, component"),
        ("page=0", "page 0 does not exist: pages start at 1"),
        ("page=x", "invalid page 'x'"),
        ("page=4", "page 4 does not exist: there are 250, 3 page(s) of 100"),
        ("q=nomatch&page=2", "page 2 does not exist: 0 match"),
        ("q=" + "x" * 501, "use at most 500"),
    ],
)
def test_bad_list_values_are_400_with_the_fix(big: Served, query: str, message: str) -> None:
    ident = big.sample.ids["wide", 1]
    assert message in api(big, f"/checkpoints/{ident}?{query}", 400)["error"]
    assert message in html_lib.unescape(page(big, f"/checkpoints/{ident}?{query}", 400))
    compared = f"/compare?a={ident}&b={ident}&{query.replace('colour', 'size')}"
    assert api(big, compared, 400)["status"] == 400


def test_the_filter_text_is_escaped(big: Served) -> None:
    ident = big.sample.ids["wide", 1]
    text = page(big, f"/checkpoints/{ident}?q=%3Cscript%3Ex%3C/script%3E")
    assert "<script>x" not in text
    assert 'value="&lt;script&gt;x&lt;/script&gt;"' in text


# -- 2. compare by parameter name across layouts -----------------------------------------------


def test_a_whole_checkpoint_compares_with_a_dcp_one_by_name(big: Served) -> None:
    ids = big.sample.ids
    same = api(big, f"/compare?a={ids['plain', 1]}&b={ids['dcp', 1]}")
    verdicts = {d["name"]: (d["verdict"], d["why"]) for d in same["diffs"]}
    # Packed small tensors, read and compared byte for byte; not "unknown".
    assert verdicts["model.weight"][0] == "same bytes"
    assert verdicts["model.bias"][0] == "same bytes"
    changed = api(big, f"/compare?a={ids['plain', 1]}&b={ids['dcp', 3]}")
    verdicts = {d["name"]: d["verdict"] for d in changed["diffs"]}
    assert verdicts["model.weight"] == "differs"
    assert verdicts["model.bias"] == "same bytes"
    plain = api(big, f"/compare?a={ids['plain', 1]}&b={ids['plain', 3]}")
    assert {d["name"]: d["verdict"] for d in plain["diffs"]} == {
        "model.weight": "differs",
        "model.bias": "same bytes",
    }
    assert plain["counts"] == {
        "differs": 1, "not compared": 0, "only in A": 0, "only in B": 0, "same bytes": 1,
    }  # fmt: skip
    only = api(big, f"/compare?a={ids['plain', 1]}&b={ids['wide', 1]}&verdict=only%20in%20A")
    assert [d["name"] for d in only["diffs"]] == ["model.bias", "model.weight"]
    text = page(big, f"/compare?a={ids['plain', 1]}&b={ids['dcp', 3]}")
    assert '<span class="verdict differs">differs</span>' in text
    assert "<code>model.weight</code>" in text


def test_compare_pages_filters_and_sorts_too(big: Served) -> None:
    ids = big.sample.ids
    base = f"/compare?a={ids['wide', 1]}&b={ids['plain', 1]}"
    first = api(big, base)
    assert first["entries"]["total"] == WIDE + 2
    assert len(first["diffs"]) == 100
    assert [d["verdict"] for d in first["diffs"][:1]] == ["only in A"]
    found = api(big, base + "&q=bias")
    assert [(d["name"], d["verdict"]) for d in found["diffs"]] == [("model.bias", "only in B")]
    assert api(big, base + "&verdict=lost", 400)["error"].startswith("invalid verdict 'lost'")


def test_shards_of_a_plain_sharded_save_are_summed_by_name() -> None:
    def row(component: str, digest: str, ranks: tuple[int, ...]) -> TensorRow:
        return TensorRow(
            component, "w", "tensor", "float32", (2,), 8, ranks, (Piece(digest, 0, 8),)
        )

    found = params([row("policy/rank1", "b3:b", (1,)), row("policy/rank0", "b3:a", (0,))])
    assert list(found) == ["policy.w"]
    w = found["policy.w"]
    assert (w.nbytes, w.ranks, w.shape, w.contiguous) == (16, (0, 1), None, False)
    assert [p.digest for p in w.pieces] == ["b3:a", "b3:b"]  # in rank order


# -- 3. per-step curves ------------------------------------------------------------------------


def test_curves_use_every_logged_step_with_checkpoints_marked(big: Served) -> None:
    run = api(big, "/runs/steps")
    assert run["step_metrics"] == ["loss", "lr"]
    assert run["metrics"][:2] == ["loss", "lr"]
    steps = api(big, "/runs/steps/steps")
    assert len(steps["loss"]) == 50
    assert steps["loss"][9] == [10, 0.1]
    text = page(big, "/runs/steps")
    loss = re.search(r'<svg[^>]*data-chart="metric:loss".*?</svg>', text, re.S)
    assert loss is not None
    polyline = re.search(r'<polyline points="([^"]+)"', loss.group())
    assert polyline is not None
    assert len(polyline.group(1).split()) == 50  # every step, not the 3 checkpoints
    assert loss.group().count('class="mark') == 3
    assert "step 20: 0.05" in loss.group()


def test_curves_without_per_step_values_are_the_checkpoints(big: Served) -> None:
    text = page(big, "/runs/plain")
    assert "metric:" not in text or "no values recorded" not in text
    assert api(big, "/runs/plain")["step_metrics"] == []
    assert api(big, "/runs/plain/steps") == {}


# -- 4. a page for 404s ------------------------------------------------------------------------


def test_a_missing_page_is_a_page_of_the_site_and_the_api_stays_json(big: Served) -> None:
    text = page(big, "/no/such/page", 404)
    assert "<title>404 Not found - ckptstore</title>" in text
    assert '<a href="/">Back to the runs</a>' in text
    assert '<nav><a href="/" class="brand">' in text
    assert api(big, "/no/such/page", 404) == {
        "error": "no page at /api/no/such/page",
        "status": 404,
    }
    hostile = page(big, "/runs/%3Cb%3Ex", 404)
    assert "<b>x" not in hostile
    assert "&lt;b&gt;x" in hostile


# -- 5. storage figures and commands -----------------------------------------------------------


def test_storage_shows_no_compression_of_data_against_index_bytes(big: Served) -> None:
    text = page(big, "/storage")
    assert "0.00x" not in text  # the optimizer component holds no tensor data
    kinds = api(big, "/storage")["kinds"]
    assert any(k["logical_bytes"] == 0 and k["stored_bytes"] > 0 for k in kinds)


def test_commands_name_the_database_and_store_as_the_server_was_given_them(
    big: Served,
) -> None:
    assert location_label("runs/manifest.db") == "runs/manifest.db"
    masked = location_label("postgresql+psycopg://me:secret@db.example/ckpt")
    assert "secret" not in masked
    assert masked.startswith("postgresql+psycopg://me:")
    info: CheckpointInfo = _info(big)
    lines = for_checkpoint(info, "plain", "my runs/manifest.db", "my runs/store")
    assert (
        lines[0]
        == "ckptstore --db 'my runs/manifest.db' --store 'my runs/store' show plain@1 --entries"
    )
    assert "db='my runs/manifest.db', store='my runs/store'" in "\n".join(lines)


def _info(served: Served) -> CheckpointInfo:
    from ckptstore.web.data import find_checkpoint

    site = served.server.app.site
    return find_checkpoint(site, served.sample.ids["plain", 1])


def test_serve_passes_its_paths_as_given(big: Served, tmp_path: Path) -> None:
    """``ckptstore serve --db REL --store REL``: the page's commands say REL for both."""
    import os
    import subprocess
    import sys

    root = Path(big.sample.db).parent
    script = (
        "import json, sys, threading, urllib.request\n"
        "from ckptstore.cli.commands import serve\n"
        "from ckptstore.web import server as web\n"
        "made = []\n"
        "class Probe(web.Server):\n"
        "    def serve_forever(self, *a, **k):\n"
        "        serving = threading.Thread(target=web.Server.serve_forever, args=(self,))\n"
        "        serving.start()\n"
        "        url = self.url + 'api/checkpoints/%d' % int(sys.argv[1])\n"
        "        print(json.loads(urllib.request.urlopen(url, timeout=60).read())['commands'][0])\n"
        "        self.shutdown()\n"
        "        serving.join()\n"
        "serve.Server = Probe\n"
        "from ckptstore.cli.main import main\n"
        "sys.exit(main(['--db', 'manifest.db', '--store', './store', 'serve', '--port', '0',"
        " '--json']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(big.sample.ids["plain", 1])],
        cwd=root, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line == "ckptstore --db manifest.db --store ./store show plain@1 --entries"
