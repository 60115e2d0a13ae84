"""Object-store faults (issue #6, family 2): saves and loads through a faulty S3 endpoint.

Every request between the S3Store and a real SeaweedFS goes through :class:`FaultProxy`, which
answers some of them with 503 SlowDown, 500 InternalError, a reset connection (before or after
the server acted), a truncated body, a slow answer or no answer at all. The checkpointer runs
for real on a real SQLite manifest. After every torture:

- every committed checkpoint loads back bit-exact (``torch.equal`` on every tensor) through the
  faulty proxy and straight from the server, and ``verify`` re-hashes every blob there;
  a truncated body is detected (content length), retried, and never returned as data;
- nothing uncommitted is visible to ``latest``; a failed save leaves a ``failed`` row with no
  components and no blob references;
- a hung request costs at most the read timeout per attempt: a save or load ends (succeeds or
  fails) within a bound, never hangs.

Families: ``store faults`` (saves, faults injected, loaded exact, lost), ``store outages``
(failed cleanly, recovered, committed partial), ``hung requests`` (bounded, hung).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from faultproxy import KINDS, TRANSIENT_KINDS, FaultProxy
from manifest_rows import child_rows

from ckptstore.checkpointer import open_run
from ckptstore.errors import ObjectStoreError, SaveError
from ckptstore.maintenance import verify
from ckptstore.manifest import Database
from ckptstore.objectstore import RetryPolicy, S3Store
from ckptstore.serialize.compare import first_difference
from ckptstore.testing.factories import MiB, S3Endpoint, S3StoreFactory

pytestmark = pytest.mark.integration

#: Millisecond backoff: a fault costs no waiting, only attempts. Eight attempts at a 10% fault
#: rate fail with probability 1e-8 per request.
RETRY = RetryPolicy(max_attempts=8, base_delay=0.001, max_delay=0.02)
#: Socket timeouts for the faulty store: a ``hang`` costs one read timeout per attempt.
READ_TIMEOUT = 0.5
CONNECT_TIMEOUT = 1.0
#: Multipart above 5 MiB in 5 MiB parts (S3's minimum), so the 8 MiB tensor goes up in two parts.
MULTIPART = {"multipart_threshold": 5 * MiB, "part_size": 5 * MiB}
#: float32 elements of the multipart tensor: 8 MiB, still above the threshold once compressed
#: (the auto policy codes a slow store's floats: randn's exponents save about a sixth).
BIG = (8 * MiB) // 4

#: A component identical in every checkpoint: later saves find its blob already stored.
FROZEN = torch.randn(4096, generator=torch.Generator().manual_seed(7))


def state(step: int, *, big: int = 0) -> dict[str, Any]:
    """A small checkpoint (tens of KB) that differs at every step; ``big`` float32 elements
    more in one tensor (stored as a chunk of its own, multipart above the threshold)."""
    gen = torch.Generator().manual_seed(1000 + step)
    policy: dict[str, Any] = {
        "w": torch.randn(4096, generator=gen),
        "b": torch.randn(32, generator=gen).to(torch.bfloat16),
    }
    if big:
        policy["big"] = torch.randn(big, generator=gen)
    return {
        "policy": policy,
        "optimizer": {
            "step": torch.tensor(step, dtype=torch.int64),
            "exp_avg": torch.randn(2048, generator=gen),
            "param_groups": [{"lr": 1e-4 * step, "betas": [0.9, 0.95]}],
        },
        "frozen": {"embed": FROZEN},
    }


def mismatch(loaded: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """None if ``loaded`` equals ``expected`` exactly (components in any order)."""
    if sorted(loaded) != sorted(expected):
        return f"components {sorted(loaded)} != {sorted(expected)}"
    for name, value in expected.items():
        diff = first_difference(loaded[name], value, name)
        if diff is not None:
            return diff
    return None


@pytest.fixture
def proxy(seaweed_endpoint: S3Endpoint) -> Iterator[FaultProxy]:
    assert seaweed_endpoint.endpoint_url is not None
    with FaultProxy(seaweed_endpoint.endpoint_url, seed=6) as faulty:
        yield faulty
    assert faulty.errors == [], f"the fault proxy itself failed: {faulty.errors}"


@pytest.fixture
def db_path(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'manifest.db'}"


@pytest.fixture
def faulty_store(
    seaweed_store_factory: S3StoreFactory, proxy: FaultProxy
) -> Callable[..., S3Store]:
    """S3Stores that reach SeaweedFS through the proxy (same bucket and prefix as the
    factory's direct stores)."""

    def make(**options: Any) -> S3Store:
        options.setdefault("retry", RETRY)
        options.setdefault("read_timeout", READ_TIMEOUT)
        options.setdefault("connect_timeout", CONNECT_TIMEOUT)
        store = seaweed_store_factory(endpoint_url=proxy.endpoint_url, **options)
        assert isinstance(store, S3Store)
        return store

    return make


# -- (a) transient faults --------------------------------------------------------------------------


def torture_saves(
    *,
    db: str,
    proxy: FaultProxy,
    store: S3Store,
    direct: S3Store,
    steps: int,
    rate: float,
    big_every: int = 0,
    big: int = 0,
) -> dict[str, int]:
    """``steps`` saves at ``rate`` faults; every checkpoint then loads back exactly through the
    faults and straight from the server, and ``verify`` re-hashes every blob there."""
    expected = {
        s: state(s, big=big if big_every and s % big_every == 0 else 0) for s in range(1, steps + 1)
    }
    proxy.configure(rate=rate, kinds=KINDS)
    with open_run("faulty", db=db, store=store) as run:
        handles = [run.save(s, expected[s], training_info={"current_step": s}) for s in expected]
        infos = [h.wait() for h in handles]
        assert [(i.step, i.status) for i in infos] == [(s, "committed") for s in expected]
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (s, "committed") for s in expected
        ]
        faults_while_saving = proxy.total_injected
        exact_faulty = 0
        for s, want in expected.items():
            loaded = run.load(s)
            diff = mismatch(loaded.state, want)
            assert diff is None, f"step {s} through the faulty proxy: {diff}"
            exact_faulty += 1
        latest = run.latest()
        assert latest is not None
        assert latest.step == steps
        resumed = run.load()
        assert resumed.info.step == steps
        assert resumed.skipped == ()
        assert mismatch(resumed.state, expected[steps]) is None
        # A read that failed for good would have marked a checkpoint corrupt: none may be.
        assert {c.status for c in run.checkpoints()} == {"committed"}
    injected = proxy.total_injected
    proxy.off()
    # Then without the proxy at all: what the server holds is exactly what was saved.
    exact_clean = 0
    with open_run("faulty", db=db, store=direct, writable=False) as reader:
        for s, want in expected.items():
            diff = mismatch(reader.load(s).state, want)
            assert diff is None, f"step {s} after the faults stopped: {diff}"
            exact_clean += 1
    database = Database(db)
    try:
        report = verify(database, direct, mark_corrupt=False)
    finally:
        database.close()
    assert report.problems == []
    assert report.checkpoints == steps
    assert faults_while_saving >= 1, f"no fault was injected during {steps} saves"
    return {
        "saves": steps,
        "faults_injected": injected,
        "loaded_exact": min(exact_faulty, exact_clean),
        "lost": steps - min(exact_faulty, exact_clean),
    }


def test_saves_and_loads_through_ten_percent_transient_faults(
    db_path: str,
    proxy: FaultProxy,
    faulty_store: Callable[..., S3Store],
    seaweed_store_factory: S3StoreFactory,
    reliability_report: Any,
) -> None:
    figures = torture_saves(
        db=db_path,
        proxy=proxy,
        store=faulty_store(),
        direct=seaweed_store_factory(),
        steps=15,
        rate=0.10,
    )
    reliability_report.add("store faults", **figures)
    assert figures["lost"] == 0
    assert set(proxy.injected) <= set(KINDS)
    assert proxy.hanging == 0


@pytest.mark.stress
@pytest.mark.timeout(240)
def test_stress_many_saves_through_faults_with_multipart_blobs(
    db_path: str,
    proxy: FaultProxy,
    faulty_store: Callable[..., S3Store],
    seaweed_store_factory: S3StoreFactory,
    reliability_report: Any,
) -> None:
    """60 saves at 10% faults; every 6th also holds an 8 MiB tensor (about 6.7 MiB once the
    float codec has coded its exponents), uploaded in two parts (the multipart threshold
    lowered to S3's minimum part size)."""
    figures = torture_saves(
        db=db_path,
        proxy=proxy,
        store=faulty_store(**MULTIPART),
        direct=seaweed_store_factory(**MULTIPART),
        steps=60,
        rate=0.10,
        big_every=6,
        big=BIG,
    )
    reliability_report.add("store faults", **figures)
    assert figures["lost"] == 0
    # With some 1000 requests at 10%, every kind of fault was injected.
    assert set(proxy.injected) == set(KINDS), proxy.injected


@pytest.mark.stress
@pytest.mark.timeout(240)
def test_stress_a_quarter_of_all_requests_faulted(
    db_path: str,
    proxy: FaultProxy,
    faulty_store: Callable[..., S3Store],
    seaweed_store_factory: S3StoreFactory,
    reliability_report: Any,
) -> None:
    """30 saves with one request in four faulted, retried up to 12 times (a request then fails
    for good with probability 0.25**12 = 6e-8)."""
    patient = RetryPolicy(max_attempts=12, base_delay=0.001, max_delay=0.02)
    figures = torture_saves(
        db=db_path,
        proxy=proxy,
        store=faulty_store(retry=patient),
        direct=seaweed_store_factory(),
        steps=30,
        rate=0.25,
    )
    reliability_report.add("store faults", **figures)
    assert figures["lost"] == 0


@pytest.mark.parametrize("kind", TRANSIENT_KINDS)
def test_every_fault_kind_is_absorbed_by_a_save_and_a_load(
    kind: str,
    db_path: str,
    proxy: FaultProxy,
    faulty_store: Callable[..., S3Store],
    reliability_report: Any,
) -> None:
    """Each kind alone, on every other request: the save commits and the load is exact.
    (``truncate`` and ``reset_mid`` need a response body: on a save's HEADs and PUTs they
    lose the whole answer instead, counted as ``reset_after``.)"""
    store = faulty_store()
    want = state(1)
    faults = 1 if kind == "hang" else 3  # a hang costs a read timeout
    with open_run("one-kind", db=db_path, store=store) as run:
        proxy.configure(rate=0.5, kinds=[kind], max_faults=faults, seed=11)
        info = run.save(1, want).wait()
        assert info.status == "committed"
        saved_with = proxy.total_injected
        before_load = proxy.injected[kind]
        proxy.configure(max_faults=faults)
        loaded = run.load()
        assert loaded.info.step == 1
        assert loaded.skipped == ()
        diff = mismatch(loaded.state, want)
        assert {c.status for c in run.checkpoints()} == {"committed"}
    reliability_report.add(
        "store faults",
        saves=1,
        faults_injected=proxy.total_injected,
        loaded_exact=int(diff is None),
        lost=int(diff is not None),
    )
    assert diff is None
    assert saved_with == faults, f"{saved_with} faults hit the save, not {faults}"
    assert proxy.injected[kind] > before_load, f"no {kind} fault hit the load"


def test_truncated_bodies_are_detected_never_returned_as_data(
    db_path: str,
    proxy: FaultProxy,
    faulty_store: Callable[..., S3Store],
    reliability_report: Any,
) -> None:
    """Every GET cut short: the load fails with a clear error, nothing is marked corrupt (the
    stored bytes are fine); half the GETs cut short: the load retries and is exact."""
    store = faulty_store()
    want = state(3)
    with open_run("truncated", db=db_path, store=store) as run:
        run.save(3, want).wait()
        proxy.always("truncate", match=lambda method, path: method == "GET")
        with pytest.raises(ObjectStoreError) as failure:
            run.load()
        message = str(failure.value)
        assert store.url in message, message
        assert "/cas/" in message, message
        assert proxy.injected["truncate"] == RETRY.max_attempts
        assert [(c.step, c.status) for c in run.checkpoints()] == [(3, "committed")]
        proxy.configure(rate=0.5, max_faults=4)
        loaded = run.load()
        diff = mismatch(loaded.state, want)
    reliability_report.add(
        "store faults",
        saves=1,
        faults_injected=proxy.total_injected,
        loaded_exact=int(diff is None),
        lost=int(diff is not None),
    )
    assert diff is None
    assert proxy.injected["truncate"] > RETRY.max_attempts


# -- (b) permanent failure -------------------------------------------------------------------------

OUTAGES = ["internal", "slowdown", "reset", "down"]


@pytest.mark.parametrize("outage", OUTAGES)
def test_store_outage_fails_the_save_cleanly_and_the_next_save_recovers(
    outage: str,
    db_path: str,
    proxy: FaultProxy,
    faulty_store: Callable[..., S3Store],
    reliability_report: Any,
) -> None:
    store = faulty_store()
    first, second, third = state(1), state(2), state(3)
    with open_run("outage", db=db_path, store=store) as run:
        run.save(1, first).wait()
        if outage == "down":
            proxy.down()
        else:
            proxy.always(outage)
        pending = run.save(2, second)  # the snapshot succeeds; the upload cannot
        # The background failure surfaces at the next save, which starts nothing.
        with pytest.raises(SaveError) as at_next:
            run.save(3, third)
        with pytest.raises(SaveError) as at_wait:
            pending.wait()
        for message in (str(at_next.value), str(at_wait.value)):
            assert "step 2" in message, message
            assert store.url in message, message
            assert "/cas/" in message, message
        if outage == "down":
            assert proxy.endpoint_url in str(at_next.value)
        latest = run.latest()
        assert latest is not None
        assert latest.step == 1
        rows = {c.step: c for c in run.checkpoints()}
        assert sorted((s, c.status) for s, c in rows.items()) == [(1, "committed"), (2, "failed")]
        assert rows[2].error
        assert store.url in rows[2].error
        partial = child_rows(run, rows[2].id)
        assert partial == (0, 0), f"the failed save left (components, refs) = {partial}"
        failed_cleanly = 1
        # The store comes back: the next save commits and resume loads it exactly.
        if outage == "down":
            proxy.up()
        else:
            proxy.off()
        assert run.save(3, third).wait().status == "committed"
        resumed = run.load()
        assert resumed.info.step == 3
        assert mismatch(resumed.state, third) is None
        assert mismatch(run.load(1).state, first) is None
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "committed"),
            (2, "failed"),
            (3, "committed"),
        ]
    reliability_report.add(
        "store outages",
        failed_cleanly=failed_cleanly,
        recovered=1,
        committed_partial=int(partial != (0, 0)),
    )
    if outage != "down":
        assert proxy.injected[outage] >= RETRY.max_attempts


# -- (c) hung requests -----------------------------------------------------------------------------


class Outcome:
    """Runs ``fn`` in a thread; ``elapsed`` once it ended, ``hung`` if it outlived ``bound``."""

    def __init__(self, fn: Callable[[], Any], bound: float) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._fn = fn
        thread = threading.Thread(target=self._target, name="bounded-call", daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(bound)
        self.elapsed = time.monotonic() - started
        self.hung = thread.is_alive()
        self.thread = thread

    def _target(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:
            self.error = exc


HUNG_RETRY = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05)
#: Attempts x read timeout, twice over for slack on a busy 2-core machine.
HUNG_BOUND = 2 * HUNG_RETRY.max_attempts * READ_TIMEOUT + 10


@pytest.mark.timeout(120)
def test_hung_requests_are_bounded_by_the_read_timeout(
    db_path: str,
    proxy: FaultProxy,
    faulty_store: Callable[..., S3Store],
    reliability_report: Any,
) -> None:
    store = faulty_store(retry=HUNG_RETRY)
    outcomes: dict[str, Outcome] = {}
    with open_run("hung", db=db_path, store=store) as run:
        want = state(1)
        run.save(1, want).wait()

        # Every request hangs: the save fails within attempts x read timeout, with a clear error.
        proxy.always("hang")
        outcomes["save, store hung"] = Outcome(lambda: run.save(2, state(2)).wait(), HUNG_BOUND)
        # A read of a hung store fails the same way, and marks nothing corrupt.
        outcomes["load, store hung"] = Outcome(lambda: run.load(1), HUNG_BOUND)
        # Two requests hang, then the store answers again: the retries succeed.
        proxy.release_hung()
        proxy.configure(rate=1.0, kinds=["hang"], max_faults=2)
        outcomes["save, two hangs"] = Outcome(lambda: run.save(3, state(3)).wait(), HUNG_BOUND)
        proxy.configure(max_faults=2)
        outcomes["load, two hangs"] = Outcome(lambda: run.load(3), HUNG_BOUND)
        proxy.off()
        for outcome in outcomes.values():
            outcome.thread.join(60)

        hung = sum(o.hung for o in outcomes.values())
        reliability_report.add("hung requests", bounded=len(outcomes) - hung, hung=hung)
        assert hung == 0, {k: o.elapsed for k, o in outcomes.items()}

        failed_save = outcomes["save, store hung"].error
        assert isinstance(failed_save, SaveError), failed_save
        assert store.url in str(failed_save)
        assert "/cas/" in str(failed_save)
        assert "timeout" in str(failed_save).lower(), str(failed_save)
        failed_load = outcomes["load, store hung"].error
        assert isinstance(failed_load, ObjectStoreError), failed_load
        assert "timeout" in str(failed_load).lower(), str(failed_load)
        # At least one full round of attempts, each a read timeout.
        for name in ("save, store hung", "load, store hung"):
            assert outcomes[name].elapsed >= HUNG_RETRY.max_attempts * READ_TIMEOUT * 0.9

        assert outcomes["save, two hangs"].error is None, outcomes["save, two hangs"].error
        loaded = outcomes["load, two hangs"]
        assert loaded.error is None, loaded.error
        assert mismatch(loaded.result.state, state(3)) is None
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "committed"),
            (2, "failed"),
            (3, "committed"),
        ]
        assert mismatch(run.load(1).state, want) is None
    assert proxy.injected["hang"] >= 2 * HUNG_RETRY.max_attempts + 4
    assert proxy.hanging == 0


@pytest.mark.timeout(60)
def test_a_timed_out_wait_neither_fakes_nor_swallows_the_outcome(
    db_path: str,
    proxy: FaultProxy,
    faulty_store: Callable[..., S3Store],
    reliability_report: Any,
) -> None:
    """``handle.wait(timeout)`` on a save stuck behind a hung store gives up after ``timeout``
    with a TimeoutError (the save is still running: it has not failed, and may yet commit);
    the save's real outcome must still surface later, at ``finalize`` (or the next save, or
    ``close``): a failure may never vanish."""
    store = faulty_store(retry=HUNG_RETRY)
    with open_run("timed-wait", db=db_path, store=store) as run:
        run.save(1, state(1)).wait()
        proxy.always("hang")
        handle = run.save(2, state(2))
        started = time.monotonic()
        with pytest.raises((TimeoutError, SaveError)) as timed_out:
            handle.wait(timeout=0.2)
        waited = time.monotonic() - started
        reliability_report.add("hung requests", bounded=int(waited < HUNG_BOUND), hung=0)
        still_running = not handle.done()
        # The store stays hung, so the save fails for good after its retries.
        try:
            run.finalize()
        except SaveError as exc:
            surfaced: SaveError | None = exc
        else:
            surfaced = None
        proxy.off()
        rows = [(c.step, c.status) for c in run.checkpoints()]
    assert rows == [(1, "committed"), (2, "failed")]
    assert still_running
    assert surfaced is not None, "the failed save at step 2 was never reported"
    assert type(timed_out.value) is TimeoutError, repr(timed_out.value)
    assert "step 2" in str(surfaced)
    assert store.url in str(surfaced)


# -- multipart uploads: a fault at each stage ----------------------------------------------------

MULTIPART_STAGES: dict[str, Callable[[str, str], bool]] = {
    "create": lambda method, path: method == "POST" and path.endswith("?uploads"),
    "part": lambda method, path: method == "PUT" and "partNumber=" in path,
    "complete": lambda method, path: method == "POST" and "uploadId=" in path,
}
MULTIPART_CASES = [
    pytest.param(
        stage,
        kind,
        id=f"{stage}-{kind}",
        # The lost answer to a completed upload is the hard case: always in the fast tier.
        marks=() if (stage, kind) == ("complete", "reset_after") else pytest.mark.stress,
    )
    for stage in MULTIPART_STAGES
    for kind in ("reset_after", "reset", "internal", "slowdown", "truncate", "reset_mid")
]


@pytest.mark.parametrize(("stage", "kind"), MULTIPART_CASES)
def test_a_fault_at_each_multipart_stage_is_absorbed(
    stage: str,
    kind: str,
    db_path: str,
    proxy: FaultProxy,
    faulty_store: Callable[..., S3Store],
    seaweed_store_factory: S3StoreFactory,
    reliability_report: Any,
) -> None:
    """An 8 MiB tensor goes up in two parts; one request of ``stage`` gets the fault (a
    ``truncate`` of an answer with no body, e.g. a part's, loses the answer: ``reset_after``).
    The save commits, the object is complete, and it loads back exactly."""
    store = faulty_store(**MULTIPART)
    want = state(1, big=BIG)
    with open_run("multipart", db=db_path, store=store) as run:
        proxy.configure(rate=1.0, kinds=[kind], match=MULTIPART_STAGES[stage], max_faults=1)
        info = run.save(1, want).wait()
        injected = proxy.total_injected
        proxy.off()
        assert info.status == "committed"
    with open_run("multipart", db=db_path, store=seaweed_store_factory(), writable=False) as run:
        diff = mismatch(run.load().state, want)
    reliability_report.add(
        "store faults",
        saves=1,
        faults_injected=injected,
        loaded_exact=int(diff is None),
        lost=int(diff is not None),
    )
    assert diff is None
    assert injected == 1, proxy.injected
