"""The web tests' fixtures: the sample store (built once per session, see web_sample.py) and
``ckptstore serve``'s server over it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from web_sample import Sample, Served, build

from ckptstore.manifest.serving import open_readonly
from ckptstore.web.data import Site
from ckptstore.web.routes import App
from ckptstore.web.server import Server


@pytest.fixture(scope="session")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Sample:
    """The sample store (shared: tests only read it, but for ``live`` saves)."""
    return build(tmp_path_factory.mktemp("web"))


@pytest.fixture(scope="session")
def served(sample: Sample) -> Iterator[Served]:
    """``ckptstore serve``'s server over the sample, read-only, polling every 0.3 s."""
    site = Site(open_readonly(sample.db), sample.store, db_label=sample.db)
    server = Server("127.0.0.1", 0, App(site, poll_seconds=0.3))
    server.serve_in_thread()
    yield Served(server, sample)
    server.shutdown()
    server.server_close()
    site.close()
