"""Crash consistency and fencing on Google Cloud Storage (``gs://`` on the emulator of
tests/gcsserver.py, which has GCS's preconditions).

Crash points: the kill points of test_crash_points.py with the saving process's store on the
emulator (crash_gcs_child.py) and the resume check of that module (every committed checkpoint
loads exactly, nothing uncommitted is visible, GC with grace 0 leaves no orphan and no torn
object, the next save succeeds). Default run: three points on SQLite + the emulator (half of a
media upload's body sent, killed sending chunk 2 of a resumable upload, killed right after
COMMIT), and what a killed resumable upload leaves in the bucket (nothing). Stress tier: every
other point that applies to a remote store, and random kills during a stream of saves.

Fencing: two writers on one ``gs://`` run, each with its own store opened from the URL; the
newer writer's open fences the older one while the older one's save is uploading.
"""

from __future__ import annotations

import datetime as dt
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import test_crash_points as crash
import torch
from concurrency_child import FENCED, OPTIONS, differences, state
from gcs_fixtures import GCSStoreFactory
from test_concurrency_torture import assert_store_exact, record, statuses

from ckptstore import open_run
from ckptstore.cas import blob_key, digest_from_key
from ckptstore.cas.digest import digest_bytes
from ckptstore.cas.header import MAX_HEADER, decode_header
from ckptstore.errors import CkptStoreError, FencedError
from ckptstore.maintenance import collect_garbage
from ckptstore.objectstore import ObjectStore, open_store
from ckptstore.objectstore._gcs import GCSStore
from ckptstore.objectstore.base import PutData

CHILD = Path(__file__).with_name("crash_gcs_child.py")
DEFAULT_POINTS = ("put.partial.chunk", "put.part2", "commit.after-commit")


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[crash.Zygote]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(crash, "CHILD", CHILD)  # the zygote serves crash_gcs_child.py
        z = crash.Zygote(tmp_path_factory.mktemp("crash-zygote-gcs"))
    try:
        yield z
    finally:
        z.close()


def torn_objects(store: ObjectStore) -> list[str]:
    """Blob objects whose size is not the one their header declares (a write cut short that
    became visible): GCS stores an upload whole or not at all, so there must be none."""
    torn = []
    for info in store.list("cas/"):
        if digest_from_key(info.key) is None:
            continue
        head = store.get(info.key, (0, min(MAX_HEADER, info.size)))
        try:
            decode_header(memoryview(head), info.key, object_size=info.size)
        except CkptStoreError as exc:
            torn.append(f"{info.key}: {exc}")
    return torn


@pytest.fixture
def gcs_target(tmp_path: Path, gcs_store_factory: GCSStoreFactory) -> crash.Target:
    factory = gcs_store_factory
    store = factory()
    return crash.Target(
        db=f"sqlite:///{tmp_path / 'manifest.db'}",
        store=store,
        store_spec={
            "kind": "gcs",
            "bucket": factory.bucket,
            "prefix": factory.prefix,
            "endpoint_url": factory.endpoint_url,
        },
        workdir=tmp_path,
        # An unfinished resumable upload is no object (GCS drops the session after a week);
        # what a killed writer could leave behind is a torn one.
        leftovers=lambda: torn_objects(store),
    )


def _points(default: bool) -> list[Any]:
    chosen = [p for p in crash.POINTS if "s3" in p.backends]
    return [
        pytest.param(p, id=p.id)
        for p in chosen
        if (p.point in DEFAULT_POINTS and p.action == "sync") is default
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", _points(default=True))
def test_kill_point_sqlite_gcs(
    point: crash.Point, zygote: crash.Zygote, gcs_target: crash.Target, reliability_report: Any
) -> None:
    crash.kill_and_check(zygote, gcs_target, point, reliability_report)


@pytest.mark.stress
@pytest.mark.timeout(180)
@pytest.mark.parametrize("point", _points(default=False))
def test_kill_point_sqlite_gcs_stress(
    point: crash.Point, zygote: crash.Zygote, gcs_target: crash.Target, reliability_report: Any
) -> None:
    crash.kill_and_check(zygote, gcs_target, point, reliability_report)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "point",
    [
        crash.Point("put.part2", crash.PENDING, big=True),  # chunk 2 of a resumable upload
        crash.Point("put.partial.chunk", crash.PENDING, big=False),  # a media upload's body
    ],
    ids=["resumable", "media"],
)
def test_a_killed_upload_leaves_no_object_and_nothing_to_sweep(
    zygote: crash.Zygote,
    gcs_target: crash.Target,
    gcs_store_factory: GCSStoreFactory,
    point: crash.Point,
) -> None:
    """Killed while sending chunk 2 of a resumable upload, or half-way through a media
    upload's body: right after the kill (before any GC) the object does not exist, no object
    is torn, and GC has no unfinished upload to sweep (a resumable session is no object and
    costs nothing; GCS drops it after a week)."""
    status = zygote.wait(zygote.start(gcs_target.job(point)))
    assert status == -signal.SIGKILL, zygote.stderr_tail()
    assert gcs_target.progress()[-1:] == [f"kill {point.point}"], gcs_target.progress()
    assert torn_objects(gcs_target.store) == []
    # Complete objects only: those of the steps before, and what the killed save finished.
    root = f"{gcs_store_factory.prefix}/"
    names = gcs_store_factory.bucket_keys(prefix=root)
    assert names
    assert all(n.startswith(f"{root}cas/") for n in names), names

    def big_blob(step: int) -> str:
        big = crash.make_state(step, big=True)["model"]["big"]
        return blob_key(digest_bytes(memoryview(big.reshape(-1).view(torch.uint8).numpy())))

    if point.big:  # the object being sent, by name (a torn one is caught above either way)
        assert gcs_target.store.exists(big_blob(crash.BEFORE)), "the last committed big blob"
        assert not gcs_target.store.exists(big_blob(crash.TARGET)), "the killed upload is there"
    with open_run(crash.RUN, db=gcs_target.db, store=gcs_target.store, writable=False) as run:
        swept = collect_garbage(run.db, run.store, grace=dt.timedelta(0))
        assert (swept.incomplete, swept.incomplete_bytes) == (0, 0)
        assert crash.orphans(run) == []  # the killed save's finished uploads were orphans


@pytest.mark.stress
@pytest.mark.timeout(300)
def test_random_kills_during_a_stream_of_saves_sqlite_gcs(
    zygote: crash.Zygote, gcs_target: crash.Target, reliability_report: Any
) -> None:
    crash.random_kills(zygote, gcs_target, 10, seed=9, report=reliability_report)


# -- fencing -----------------------------------------------------------------------------------


class GatedGCSStore(GCSStore):
    """A GCSStore whose uploads, once ``armed``, wait: the first one calls ``hold(key)`` (which
    returns when the test lets the save go on); the others wait for it to return."""

    armed = False

    def __init__(self, hold: Callable[[str], None], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hold = hold
        self._gate = threading.Lock()
        self._open = threading.Event()

    def put(self, key: str, data: PutData) -> bool:
        if self.armed:
            with self._gate:
                if not self._open.is_set():
                    self._hold(key)
                    self._open.set()
        return super().put(key, data)


@pytest.mark.timeout(120)
def test_stale_writer_with_a_save_in_flight_is_fenced_on_gcs(
    gcs_store_url: str, tmp_path: Path, reliability_report: Any
) -> None:
    """Writer A's save is uploading to ``gs://`` when writer B (its own store, opened from the
    URL as another job's would be) opens the run: A's save, and its next one, fail with
    FencedError and nothing of them becomes visible; B's saves commit and load exactly; GC then
    leaves exactly the blobs of the committed checkpoints."""
    db_url = f"sqlite:///{tmp_path / 'manifest.db'}"
    entered, release = threading.Event(), threading.Event()

    def hold(_key: str) -> None:
        entered.set()
        release.wait(60)

    # Both stores reach the emulator through STORAGE_EMULATOR_HOST, as a user's jobs would.
    bucket, prefix = gcs_store_url.removeprefix("gs://").split("/", 1)
    a_store = GatedGCSStore(hold, bucket, prefix)
    b_store = open_store(gcs_store_url)
    name = "fenced"
    a = open_run(name, db=db_url, store=a_store, writer_options=OPTIONS)
    try:
        first = a.save(1, state(0, 1)).wait(60)
        a_store.armed = True
        in_flight = a.save(2, state(0, 2))
        assert entered.wait(60), "A's save never started uploading"
        with open_run(name, db=db_url, store=b_store, writer_options=OPTIONS) as b:
            assert a.epoch is not None
            assert b.epoch == a.epoch + 1
            ea, eb = a.epoch, b.epoch
            # Opening B marked A's pending row failed: A can never commit it.
            assert statuses(b) == [(1, "committed", ea), (2, "failed", ea)]
            latest = b.latest()
            assert latest is not None
            assert (latest.id, latest.step) == (first.id, 1)

            release.set()
            with pytest.raises(FencedError, match=FENCED):
                in_flight.wait(60)
            with pytest.raises(FencedError, match=FENCED):
                a.save(3, state(0, 3)).wait(60)

            for step in (2, 3):
                b.save(step, state(1, step)).wait(60)
            assert statuses(b) == [
                (1, "committed", ea),
                (2, "failed", ea),
                (2, "committed", eb),
                (3, "failed", ea),
                (3, "committed", eb),
            ]
            loaded = b.load()
            assert (loaded.info.step, loaded.info.writer_epoch) == (3, eb)
            lost = len(differences(loaded.state, state(1, 3)))
            lost += len(differences(b.load(step=2).state, state(1, 2)))
            lost += len(differences(b.load(step=1).state, state(0, 1)))
        record(reliability_report, saves=3, fenced=2, lost=lost)
        assert lost == 0
        # A's uploads were never committed: GC removes them and keeps exactly the 3 committed.
        assert assert_store_exact(db_url, b_store) == 3
        assert torn_objects(b_store) == []
    finally:
        release.set()
        a.close()  # every failure of A was reported: closing raises nothing
        a_store.close()
        b_store.close()
