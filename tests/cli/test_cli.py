"""The ``ckptstore`` command and the maintenance layer behind it (verify, export, du), end to end.

Tests run on SQLite and PostgreSQL (``db_url``) over a real LocalStore unless their name says
otherwise. A store is
populated through ``open_run(...).save(...)``: two runs that share a tensor, retention that
deletes some checkpoints, and one failed save. Most commands run in-process through
``ckptstore.cli.main(argv)``; a few go through the installed console script in subprocesses
(each one imports torch, so they are few, and started in parallel).

The sql tests use ``plain_db_url`` (a fresh SQLite file or a fresh PostgreSQL *database*);
one test checks that a URL with its own ``options`` (a search_path) works too.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from ckptstore.cas import blob_key, digest_bytes
from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer import RetentionPolicy, open_run
from ckptstore.cli import main
from ckptstore.errors import ObjectStoreError, SaveError
from ckptstore.maintenance import verify
from ckptstore.maintenance.gc import gc_lease
from ckptstore.manifest import Database, head_revision
from ckptstore.manifest.models import BlobRow, BlobState, CheckpointBlobRow, CheckpointRow, Status
from ckptstore.objectstore import LocalStore, PutData
from ckptstore.serialize.compare import first_difference

CONSOLE = Path(sys.executable).parent / "ckptstore"
#: Tensors of 1 KiB and more get chunk blobs of their own (so small states still dedup).
OPTIONS = WriterOptions(pack_threshold=1024)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: alpha's reward per step; None: the save fails (the store refuses writes).
ALPHA_REWARDS: dict[int, float | None] = {1: 0.1, 2: 0.5, 3: 0.3, 4: 0.9, 5: None, 6: 0.2, 7: 0.4}
#: keep_top_k=2 by reward plus the latest: what each step ends as.
ALPHA_STATUS = {
    1: "deleted",
    2: "committed",
    3: "deleted",
    4: "committed",
    5: "failed",
    6: "deleted",
    7: "committed",
}


# -- states ----------------------------------------------------------------------------------------


def randn(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


EMBED = randn(7, 32, 64)  # in every checkpoint of both runs: one blob


def alpha_state(step: int) -> dict[str, Any]:
    return {
        "policy": {
            "embed": EMBED,
            "layers": [{"w": randn(100 + step, 32, 32), "b": randn(200 + step, 32)}],
            "norm": randn(300 + step, 64, dtype=torch.bfloat16),
            "mask": torch.arange(16) % (step + 1) == 0,
        },
        "optimizer": {
            "step": torch.tensor(step),
            "exp_avg": randn(400 + step, 32, 32),
            "param_groups": [{"lr": 1e-3 / step, "betas": [0.9, 0.95], "name": "adamw"}],
        },
    }


def beta_state(step: int) -> dict[str, Any]:
    return {
        "policy/rank0": {"embed": EMBED, "w": randn(500 + step, 16, 32)},
        "policy/rank1": {"w": randn(600 + step, 16, 32), "half": randn(700, 8, dtype=torch.half)},
    }


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """Entry path -> leaf, the way ckptstore names entries (keys here hold no '/' or '%')."""
    if isinstance(state, dict):
        items: Any = state.items()
    elif isinstance(state, list):
        items = enumerate(state)
    else:
        return {prefix: state}
    flat: dict[str, Any] = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}/{key}" if prefix else str(key)))
    return flat


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(actual: Any, expected: Any) -> None:
    diff = first_difference(actual, expected)
    assert diff is None, diff


def assert_components(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Components bit-exact (a load returns components in name order, not save order)."""
    assert sorted(actual) == sorted(expected)
    for name, state in expected.items():
        diff = first_difference(actual[name], state, name)
        assert diff is None, diff


# -- the populated store ---------------------------------------------------------------------------


class FlakyStore(LocalStore):
    """A real LocalStore whose writes fail while ``failing`` is set."""

    failing = False

    def put(self, key: str, data: PutData) -> bool:
        if self.failing:
            raise ObjectStoreError(f"injected failure writing {self.url}/{key}")
        return super().put(key, data)


@dataclass
class Populated:
    db_url: str
    root: Path
    work: Path  # a scratch directory for outputs, outside the store
    states: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)

    @property
    def base(self) -> list[str]:
        return ["--db", self.db_url, "--store", str(self.root)]

    def committed(self) -> list[tuple[str, int]]:
        return sorted(
            (run, step)
            for run, step in self.states
            if run == "beta" or ALPHA_STATUS[step] == "committed"
        )


def populate(db_url: str, root: Path, work: Path) -> Populated:
    pop = Populated(db_url, root, work)
    store = FlakyStore(root, fsync=False)
    retention = RetentionPolicy(keep_top_k=2, metric_name="train:reward")
    with open_run(
        "alpha",
        db=db_url,
        store=store,
        retention=retention,
        writer_options=OPTIONS,
        async_save=False,
        config={"model": "tiny"},
    ) as run:
        for step, reward in ALPHA_REWARDS.items():
            store.failing = reward is None
            try:
                run.save(
                    step,
                    alpha_state(step),
                    metrics={"train:reward": reward} if reward is not None else None,
                    training_info={"current_step": step},
                    trigger="period",
                )
            except SaveError:
                assert reward is None
            else:
                assert reward is not None
                pop.states["alpha", step] = alpha_state(step)
            finally:
                store.failing = False
        assert {c.step: c.status for c in run.checkpoints()} == ALPHA_STATUS
    with open_run("beta", db=db_url, store=store, writer_options=OPTIONS) as run:
        for step in (1, 2):
            run.save(step, beta_state(step)).wait()
            pop.states["beta", step] = beta_state(step)
    store.close()
    return pop


@pytest.fixture
def populated(db_url: str, tmp_path: Path) -> Populated:
    work = tmp_path / "work"
    work.mkdir()
    return populate(db_url, tmp_path / "store", work)


def cli(pop: Populated, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``ckptstore --db ... --store ... ARGS`` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main([*pop.base, *args])
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(pop: Populated, capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    code, out, err = cli(pop, capsys, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def assert_one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckptstore: error: "), err
    for needle in needles:
        assert needle in lines[0], err


def console(pop: Populated, *commands: list[str]) -> list[tuple[int, str, str]]:
    """Run several commands through the installed console script, in parallel."""
    procs = [
        subprocess.Popen(
            [str(CONSOLE), *pop.base, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=pop.work,
        )
        for args in commands
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def tree(path: Path) -> dict[str, bytes | str]:
    """Everything under ``path`` (not following links): relative path -> bytes or link target."""
    found: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = str(full.relative_to(path))
            if full.is_symlink():
                found[rel] = f"-> {os.readlink(full)}"
            elif full.is_file():
                found[rel] = full.read_bytes()
            else:
                found[rel] = "<dir>"
    return found


def committed_references(db: Database) -> set[str]:
    with db.read() as session:
        return set(
            session.scalars(
                select(CheckpointBlobRow.digest)
                .join(CheckpointRow, CheckpointRow.id == CheckpointBlobRow.checkpoint_id)
                .where(CheckpointRow.status == Status.COMMITTED)
            )
        )


# -- the console entry point -----------------------------------------------------------------------


def test_console_entry_point(sql_store: Populated) -> None:
    """The installed ``ckptstore`` script: JSON and CSV on stdout, exit codes, errors on stderr."""
    runs, csv, unknown = console(
        sql_store,
        ["--json", "runs"],
        [
            "sql",
            "SELECT run, committed, latest_step FROM run_summary ORDER BY run",
            "--format",
            "csv",
            *superuser_flag(sql_store.db_url),
        ],
        ["ls", "no-such-run"],
    )
    code, out, err = runs
    assert (code, err) == (0, "")
    assert [(r["run"], r["committed"]) for r in json.loads(out)] == [("alpha", 3), ("beta", 2)]

    code, out, err = csv
    assert code == 0, err
    if superuser_flag(sql_store.db_url):  # one warning line says what the flag allows
        (warning,) = err.splitlines()
        assert "--allow-superuser" in warning
    else:
        assert err == ""
    assert out.splitlines() == ["run,committed,latest_step", "alpha,3,7", "beta,2,2"]

    code, out, err = unknown
    assert (code, out) == (3, "")
    assert_one_line_error(err, "'no-such-run'")


# -- runs, ls, show, latest ------------------------------------------------------------------------


def test_runs(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    rows = {r["run"]: r for r in cli_json(populated, capsys, "runs")}
    assert sorted(rows) == ["alpha", "beta"]
    alpha, beta = rows["alpha"], rows["beta"]
    assert (alpha["checkpoints"], alpha["committed"], alpha["failed"]) == (7, 3, 1)
    assert (alpha["corrupt"], beta["corrupt"]) == (0, 0)
    assert (alpha["latest_step"], alpha["metric_name"], alpha["best_metric"]) == (
        7,
        "train:reward",
        0.9,
    )
    assert (beta["checkpoints"], beta["committed"], beta["failed"], beta["latest_step"]) == (
        2,
        2,
        0,
        2,
    )

    code, out, err = cli(populated, capsys, "runs")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split()[:6] == ["run", "ckpts", "committed", "failed", "corrupt", "latest"]
    assert lines[2].split()[:6] == ["alpha", "7", "3", "1", "0", "7"]
    assert lines[3].split()[:6] == ["beta", "2", "2", "0", "0", "2"]


def test_ls(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    visible = cli_json(populated, capsys, "ls", "alpha")
    assert [(r["step"], r["status"]) for r in visible] == [
        (s, st) for s, st in ALPHA_STATUS.items() if st != "deleted"
    ]
    everything = cli_json(populated, capsys, "ls", "alpha", "--all")
    assert [(r["step"], r["status"]) for r in everything] == list(ALPHA_STATUS.items())
    assert {r["step"]: r["metrics"] for r in everything if r["step"] != 5} == {
        s: {"train:reward": r} for s, r in ALPHA_REWARDS.items() if r is not None
    }
    assert {r["trigger"] for r in everything} == {"period"}

    code, out, err = cli(populated, capsys, "ls", "alpha", "--all")
    assert (code, err) == (0, "")
    rows = [line.split()[:2] for line in out.splitlines()[2:]]
    assert rows == [[str(s), st] for s, st in ALPHA_STATUS.items()]
    code, out, _ = cli(populated, capsys, "ls", "alpha")
    assert "deleted" not in out
    assert "failed" in out


def test_show(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    record = cli_json(populated, capsys, "show", "alpha@4")
    assert (record["run"], record["step"], record["status"], record["trigger"]) == (
        "alpha",
        4,
        "committed",
        "period",
    )
    assert record["metrics"] == {"train:reward": 0.9}
    assert record["training_info"] == {"current_step": 4}
    comps = {c["name"]: c for c in record["components"]}
    assert sorted(comps) == ["optimizer", "policy"]
    assert comps["policy"]["entries"] == len(flatten(alpha_state(4)["policy"]))
    assert comps["policy"]["index_digest"].startswith("b3:")
    assert record["logical_bytes"] == sum(c["logical_bytes"] for c in comps.values())
    assert "entries" not in record

    # Without a step: the newest committed checkpoint; --entries reads every index.
    record = cli_json(populated, capsys, "show", "alpha", "--entries")
    assert record["step"] == 7
    for name in ("policy", "optimizer"):
        expected = flatten(alpha_state(7)[name])
        entries = {e["path"]: e for e in record["entries"][name]}
        assert list(entries) == list(expected)
        for path, value in expected.items():
            entry = entries[path]
            if isinstance(value, torch.Tensor):
                assert entry["kind"] == "tensor"
                assert entry["shape"] == list(value.shape)
                assert entry["nbytes"] == value.nbytes
                assert entry["dtype"] == str(value.dtype).removeprefix("torch.")
            else:
                assert (entry["kind"], entry["value"]) == ("json", value)

    code, out, err = cli(populated, capsys, "show", "beta@1", "--entries")
    assert (code, err) == (0, "")
    assert re.search(r"^\s+step: 1$", out, re.M)
    assert re.search(r"^\s+status: committed$", out, re.M)
    assert "policy/rank0:" in out
    assert "policy/rank1:" in out

    # A step that retention deleted, or that failed, is not shown as a checkpoint.
    for target, status in (("alpha@3", "deleted"), ("alpha@5", "failed")):
        code, out, err = cli(populated, capsys, "show", target)
        assert (code, out) == (3, "")
        assert_one_line_error(err, status)


def test_json_flag_after_the_subcommand(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(populated, capsys, "show", "alpha", "--entries", "--json")
    assert code == 0, err
    assert json.loads(out)["step"] == 7


def test_latest(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(populated, capsys, "latest", "alpha") == (0, "7\n", "")
    record = cli_json(populated, capsys, "latest", "beta")
    assert (record["run"], record["step"]) == ("beta", 2)
    assert record["committed_at"]

    # A run without any committed checkpoint.
    with open_run("empty", db=populated.db_url, store=populated.root):
        pass
    code, out, err = cli(populated, capsys, "latest", "empty")
    assert (code, out) == (3, "")
    assert_one_line_error(err, "'empty'", "no committed checkpoint")


def test_error_exit_codes(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = str(populated.work / "out")
    unknown = [
        ["ls", "nope"],
        ["show", "nope"],
        ["show", "nope@1"],
        ["latest", "nope"],
        ["verify", "nope"],
        ["export", "nope@1", out_dir],
        ["plot", "nope", "--metric", "m", "-o", str(populated.work / "p.png")],
        ["show", "alpha@99"],
    ]
    for args in unknown:
        code, out, err = cli(populated, capsys, *args)
        assert (code, out) == (3, ""), args
        assert_one_line_error(err, "nope" if "nope" in args[1] else "99")
    bad_targets = [
        ["show", "alpha@x"],
        ["show", "@3"],
        ["verify", "alpha@-1"],
        ["export", "alpha@1.5", out_dir],
        ["export", "alpha", out_dir],  # export needs a step
    ]
    for args in bad_targets:
        code, out, err = cli(populated, capsys, *args)
        assert (code, out) == (2, ""), args
        assert_one_line_error(err)
    assert not Path(out_dir).exists()
    # argparse's own usage errors exit 2 as well.
    for args in (["ls"], ["frobnicate"], ["gc", "--grace", "soon"], ["gc", "--grace=-5s"]):
        with pytest.raises(SystemExit) as exc:
            main([*populated.base, *args])
        assert exc.value.code == 2, args


def test_db_current_and_upgrade(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(populated, capsys, "db", "current")
    assert (code, err) == (0, "")
    assert "up to date" in out
    assert head_revision() in out
    record = cli_json(populated, capsys, "db", "current")
    assert (record["current"], record["head"], record["state"]) == (
        head_revision(),
        head_revision(),
        "up to date",
    )
    record = cli_json(populated, capsys, "db", "upgrade")
    assert (record["changed"], record["to"]) == (False, head_revision())


# -- verify ----------------------------------------------------------------------------------------


def test_verify_a_healthy_store(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(populated, capsys, "verify")
    assert (code, err) == (0, "")
    assert out.strip().endswith(": OK")
    assert f"verified {len(populated.committed())} checkpoint(s)" in out

    db = Database(populated.db_url)
    try:
        distinct = committed_references(db)
    finally:
        db.close()
    report = cli_json(populated, capsys, "verify")
    assert (report["checkpoints"], report["blobs_checked"]) == (5, len(distinct))
    assert (report["problems"], report["corrupt_checkpoints"]) == ([], [])

    report = cli_json(populated, capsys, "verify", "beta")
    assert report["checkpoints"] == 2
    report = cli_json(populated, capsys, "verify", "alpha@4", "--sample", "3")
    assert (report["checkpoints"], report["blobs_checked"]) == (1, 3)
    report = cli_json(populated, capsys, "verify", "alpha@4", "--sample", "1000")
    assert report["blobs_checked"] > 3  # a sample larger than the checkpoint checks it all


def verify_state(step: int) -> dict[str, Any]:
    """Three components, each with a chunk of its own that changes with the step."""
    return {
        "policy": {"w": randn(10 + step, 4096), "shared": EMBED},
        "optimizer": {"m": randn(20 + step, 4096), "step": step},
        "value": {"v": randn(30 + step, 4096)},
    }


def chunk_key(t: torch.Tensor) -> str:
    return blob_key(digest_bytes(t.contiguous().numpy().tobytes()))


def damage(store: LocalStore) -> dict[str, tuple[str, str]]:
    """Flip a byte of step 2's policy chunk, truncate its optimizer chunk, delete its value
    chunk; returns component -> (key, expected kind)."""
    new = verify_state(2)
    flipped = chunk_key(new["policy"]["w"])
    truncated = chunk_key(new["optimizer"]["m"])
    missing = chunk_key(new["value"]["v"])
    path = store.root / flipped
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    path = store.root / truncated
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    (store.root / missing).unlink()
    return {
        "policy": (flipped, "corrupt"),
        "optimizer": (truncated, "corrupt"),
        "value": (missing, "missing"),
    }


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database(db_url)
    yield database
    database.close()


def test_verify_finds_damage_marks_corrupt_and_quarantines(db: Database, store: LocalStore) -> None:
    with open_run("vrun", db=db, store=store, writer_options=OPTIONS, async_save=False) as run:
        run.save(1, verify_state(1))
        run.save(2, verify_state(2))
        damaged = damage(store)
        expected = {
            ("vrun", 2, component, f"{store.url}/{key}", kind)
            for component, (key, kind) in damaged.items()
        }
        digests = {"b3:" + key.rsplit("/", 1)[1] for key, _ in damaged.values()}

        def snapshot() -> tuple[Any, ...]:
            with db.read() as session:
                blobs = {b.digest: b.state for b in session.scalars(select(BlobRow))}
            listing = {i.key: i.size for i in store.list("")}
            return [(c.step, c.status) for c in run.checkpoints()], blobs, listing

        # Report only: nothing changes.
        before = snapshot()
        report = verify(db, store, mark_corrupt=False)
        found = {(p.run, p.step, p.component, p.key, p.kind) for p in report.problems}
        assert found == expected
        assert all(p.detail for p in report.problems)
        assert report.corrupt_checkpoints == [("vrun", 2)]
        assert report.checkpoints == 2
        assert snapshot() == before

        # Marking: the checkpoint is corrupt, the damaged blobs condemned and moved aside.
        report = verify(db, store)
        assert {(p.run, p.step, p.component, p.key, p.kind) for p in report.problems} == expected
        rows = run.checkpoints()
        assert [(c.step, c.status) for c in rows] == [(1, "committed"), (2, "corrupt")]
        assert rows[1].error is not None
        assert "verify" in rows[1].error
        with db.read() as session:
            query = select(BlobRow.digest, BlobRow.state).where(BlobRow.digest.in_(digests))
            states = dict(session.execute(query).all())
        assert states == dict.fromkeys(digests, BlobState.CONDEMNED)
        keys = {i.key for i in store.list("")}
        assert not keys & {key for key, _ in damaged.values()}
        assert len([k for k in keys if k.startswith("quarantine/")]) == 2  # the missing one: none

        # Only step 1 is left to check, and it is intact.
        again = verify(db, store)
        assert (again.checkpoints, again.problems) == (1, [])

        # Resume falls back to step 1 (already marked: no need to skip anything).
        loaded = run.load()
        assert (loaded.info.step, loaded.skipped) == (1, ())
        assert_components(loaded.state, verify_state(1))

        # Redoing step 2 stores good bytes again under the same keys: bit-exact.
        info = run.save(3, verify_state(2)).wait()
        assert info.uploaded_bytes > 0
        keys = {i.key for i in store.list("cas/")}
        assert {key for key, _ in damaged.values()} <= keys
        loaded = run.load()
        assert (loaded.info.step, loaded.skipped) == (3, ())
        assert_components(loaded.state, verify_state(2))
        # The good bytes repaired step 2 as well: it is committed again, and verified.
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "committed"),
            (2, "committed"),
            (3, "committed"),
        ]
        final = verify(db, store)
        assert (final.checkpoints, final.problems) == (3, [])


def test_verify_sample_checks_at_most_n_blobs_per_checkpoint(
    db: Database, store: LocalStore
) -> None:
    with open_run("sample", db=db, store=store, writer_options=OPTIONS) as run:
        for step in (1, 2, 3):
            run.save(step, verify_state(step)).wait()
        whole = verify(db, store, run="sample", step=2)
        assert whole.blobs_checked >= 5
        for n in (1, 2, whole.blobs_checked - 1):
            report = verify(db, store, run="sample", step=2, sample=n)
            assert (report.checkpoints, report.blobs_checked) == (1, n)
        report = verify(db, store, sample=2)
        assert report.checkpoints == 3
        assert report.blobs_checked <= 3 * 2
        # A damaged blob is found when it is sampled.
        damage(store)
        report = verify(db, store, run="sample", step=2, sample=whole.blobs_checked)
        assert len(report.problems) == 3
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "committed"),
            (2, "corrupt"),
            (3, "committed"),
        ]


def test_verify_command_on_a_damaged_store(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str]
) -> None:
    with open_run("vrun", db=db_url, store=store, writer_options=OPTIONS) as run:
        run.save(1, verify_state(1)).wait()
        run.save(2, verify_state(2)).wait()
    damaged = damage(store)
    base = ["--db", db_url, "--store", str(store.root)]

    capsys.readouterr()
    code = main([*base, "verify", "--no-mark"])
    out, _ = capsys.readouterr()
    assert code == 1
    for component, (key, kind) in damaged.items():
        line = f"{kind.upper()}: run 'vrun' step 2 component {component!r}: {store.url}/{key}"
        assert line in out
    assert "3 problem(s) in 1 checkpoint(s)" in out

    code = main([*base, "--json", "verify"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert {(p["component"], p["kind"]) for p in report["problems"]} == {
        (c, kind) for c, (_, kind) in damaged.items()
    }
    assert report["corrupt_checkpoints"] == [{"run": "vrun", "step": 2}]
    with open_run("vrun", db=db_url, store=store, writable=False) as run:
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "committed"),
            (2, "corrupt"),
        ]


KEPT_LINE = re.compile(
    r"^  kept +(\d+) blobs  .+  for 2 corrupt checkpoint\(s\) \(repairable; "
    r"`ckptstore verify --recheck`, or --release-corrupt to let them go\)$",
    re.M,
)


def corrupt_shared_chunk(db_url: str, store: LocalStore) -> tuple[str, bytes]:
    """Steps 1 and 2 of run 'shared' both hold EMBED; one flipped byte of its chunk, found by
    `verify`, makes both corrupt. Returns the chunk's key and its good bytes."""
    with open_run("shared", db=db_url, store=store, writer_options=OPTIONS) as run:
        for step in (1, 2):
            run.save(step, verify_state(step)).wait()
    key = chunk_key(EMBED)
    good = (store.root / key).read_bytes()
    damaged = bytearray(good)
    damaged[-1] ^= 0xFF
    (store.root / key).write_bytes(bytes(damaged))
    assert main(["--db", db_url, "--store", str(store.root), "verify"]) == 1
    assert shared_statuses(db_url, store) == {1: "corrupt", 2: "corrupt"}
    return key, good


def shared_statuses(db_url: str, store: LocalStore) -> dict[int, str]:
    with open_run("shared", db=db_url, store=store, writable=False) as run:
        return {c.step: c.status for c in run.checkpoints()}


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_verify_recheck_commits_restored_checkpoints_again(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    key, good = corrupt_shared_chunk(db_url, store)
    base = ["--db", db_url, "--store", str(store.root), *(["--json"] if as_json else [])]

    # Nothing put back yet: the recheck finds the chunk missing (quarantined) and repairs none.
    capsys.readouterr()
    assert main([*base, "verify", "--recheck"]) == 1
    out = capsys.readouterr().out
    assert "REPAIRED" not in out
    assert shared_statuses(db_url, store) == {1: "corrupt", 2: "corrupt"}

    # An operator restores the object; report-only recheck changes nothing, so both are still
    # marked corrupt: still exit 1.
    store.put(key, good)
    assert main([*base, "verify", "--recheck", "--no-mark"]) == 1
    out = capsys.readouterr().out
    if as_json:
        still = [(c["run"], c["step"]) for c in json.loads(out)["still_corrupt"]]
        assert still == [("shared", 1), ("shared", 2)]
    else:
        assert "2 checkpoint(s) still marked corrupt" in out
    assert shared_statuses(db_url, store) == {1: "corrupt", 2: "corrupt"}

    assert main([*base, "verify", "--recheck"]) == 0
    out = capsys.readouterr().out
    if as_json:
        report = json.loads(out)
        assert report["repaired"] == [{"run": "shared", "step": 1}, {"run": "shared", "step": 2}]
        assert (report["problems"], report["corrupt_checkpoints"]) == ([], [])
    else:
        assert out.splitlines()[:2] == [
            "REPAIRED: run 'shared' step 1 is committed again",
            "REPAIRED: run 'shared' step 2 is committed again",
        ]
        assert out.strip().endswith(": OK")
    assert shared_statuses(db_url, store) == {1: "committed", 2: "committed"}
    capsys.readouterr()
    assert main([*base, "verify"]) == 0


def test_gc_keeps_corrupt_checkpoints_blobs_until_released(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt_shared_chunk(db_url, store)
    base = ["--db", db_url, "--store", str(store.root)]
    objects = {i.key for i in store.list("cas/")}

    # Dry run or not, no grace at all: the corrupt checkpoints' blobs stay, and gc says why.
    for dry_run in (["--dry-run"], []):
        capsys.readouterr()
        assert main([*base, "gc", "--grace", "0", *dry_run]) == 0
        out = capsys.readouterr().out
        kept = KEPT_LINE.search(out)
        assert kept is not None, out
        assert int(kept.group(1)) > 0
        assert re.search(r"delete\s+0 blobs", out)
    assert {i.key for i in store.list("cas/")} == objects
    capsys.readouterr()
    assert main([*base, "--json", "gc", "--grace", "0", "--dry-run"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["corrupt_checkpoints"], report["release_corrupt"]) == (2, False)
    assert report["kept_for_corrupt"] == int(kept.group(1))
    assert report["kept_for_corrupt_bytes"] > 0

    # Given up on: --release-corrupt lets them go (a dry run first counts them).
    assert main([*base, "--json", "gc", "--grace", "0", "--dry-run", "--release-corrupt"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["release_corrupt"] is True
    assert dry["condemned"] > 0
    assert {i.key for i in store.list("cas/")} == objects
    assert main([*base, "gc", "--grace", "0", "--release-corrupt"]) == 0
    out = capsys.readouterr().out
    assert not KEPT_LINE.search(out)
    assert "released" in out
    assert not any(store.list("cas/")), "released blobs are deleted"


# -- du --------------------------------------------------------------------------------------------


def test_du(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    usage = cli_json(populated, capsys, "du")
    runs = {u["run"]: u for u in usage["runs"]}
    total = usage["total"]
    assert sorted(runs) == ["alpha", "beta"]

    db = Database(populated.db_url)
    try:
        with db.read() as session:
            blobs = {b.digest: b for b in session.scalars(select(BlobRow))}
            all_rows = sum(b.stored_bytes for b in blobs.values())
        per_run: dict[str, set[str]] = {}
        logical: dict[str, int] = {}
        referenced: dict[str, int] = {}
        for name in ("alpha", "beta"):
            with open_run(name, db=db, store=populated.root, writable=False) as run:
                committed = run.checkpoints([Status.COMMITTED])
                logical[name] = sum(c.logical_bytes for c in committed)
                per_run[name] = set()
                referenced[name] = 0
                with db.read() as session:
                    for c in committed:
                        refs = set(
                            session.scalars(
                                select(CheckpointBlobRow.digest).where(
                                    CheckpointBlobRow.checkpoint_id == c.id
                                )
                            )
                        )
                        per_run[name] |= refs
                        referenced[name] += sum(blobs[d].logical_bytes for d in refs)
    finally:
        db.close()

    def on_disk(digests: set[str]) -> int:
        return sum((populated.root / blob_key(d)).stat().st_size for d in digests)

    everything = per_run["alpha"] | per_run["beta"]
    for name, expected_count in (("alpha", 3), ("beta", 2)):
        u = runs[name]
        assert u["checkpoints"] == expected_count
        assert u["logical_bytes"] == logical[name]
        assert u["unique_bytes"] == sum(blobs[d].logical_bytes for d in per_run[name])
        assert u["stored_bytes"] == on_disk(per_run[name])
        assert u["referenced_bytes"] == referenced[name]
        assert u["dedup_ratio"] == pytest.approx(u["referenced_bytes"] / u["unique_bytes"])
        assert u["compression_ratio"] == pytest.approx(u["unique_bytes"] / u["stored_bytes"])
    assert total["run"] == "TOTAL"
    assert total["checkpoints"] == 5
    assert total["logical_bytes"] == logical["alpha"] + logical["beta"]
    assert total["unique_bytes"] == sum(blobs[d].logical_bytes for d in everything)
    assert total["stored_bytes"] == on_disk(everything)
    # The runs share the embedding: the total counts it once.
    assert total["unique_bytes"] < runs["alpha"]["unique_bytes"] + runs["beta"]["unique_bytes"]
    assert runs["alpha"]["dedup_ratio"] > 1  # the embedding is in all three checkpoints
    # Deleted checkpoints' blobs are still stored until a GC: counted in the rows' total only.
    assert usage["all_blob_rows_stored_bytes"] == all_rows > total["stored_bytes"]

    code, out, err = cli(populated, capsys, "du")
    assert (code, err) == (0, "")
    assert [line.split()[:2] for line in out.splitlines()[2:5]] == [
        ["alpha", "3"],
        ["beta", "2"],
        ["TOTAL", "5"],
    ]


# -- gc through the command ------------------------------------------------------------------------


def test_gc_command(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    db = Database(populated.db_url)
    try:
        with db.read() as session:
            rows_before = session.scalar(select(func.count()).select_from(BlobRow))
        needed = committed_references(db)
        garbage = rows_before - len(needed)
        assert garbage > 0  # the deleted checkpoints' own blobs

        # The default grace (6 h) keeps everything this young.
        dry = cli_json(populated, capsys, "gc", "--dry-run")
        assert (dry["dry_run"], dry["condemned"], dry["swept"], dry["orphans"]) == (True, 0, 0, 0)
        dry = cli_json(populated, capsys, "gc", "--dry-run", "--grace", "0s")
        assert (dry["condemned"], dry["orphans"]) == (garbage, 0)
        assert dry["condemned_bytes"] > 0
        with db.read() as session:
            assert session.scalar(select(func.count()).select_from(BlobRow)) == rows_before

        with gc_lease(db, holder="someone-else"):
            code, out, err = cli(populated, capsys, "gc", "--grace", "0")
            assert (code, out) == (3, "")
            assert_one_line_error(err, "someone-else")

        code, out, err = cli(populated, capsys, "gc", "--grace", "0m")
        assert (code, err) == (0, "")
        assert re.search(rf"condemn\s+{garbage} blobs", out)
        assert re.search(rf"delete\s+{garbage} blobs", out)
        with db.read() as session:
            assert set(session.scalars(select(BlobRow.digest))) == needed
        assert cli_json(populated, capsys, "gc", "--grace", "0")["swept"] == 0
    finally:
        db.close()
    assert cli(populated, capsys, "verify")[0] == 0
    for (name, step), state in populated.states.items():
        if (name, step) in populated.committed():
            with open_run(name, db=populated.db_url, store=populated.root, writable=False) as run:
                assert_components(run.load(step=step).state, state)


# -- export ----------------------------------------------------------------------------------------


def test_export_safetensors_round_trips(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = populated.work / "alpha-4"
    code, out, err = cli(populated, capsys, "export", "alpha@4", str(out_dir))
    assert (code, err) == (0, "")
    files = {out_dir / "optimizer.safetensors", out_dir / "policy.safetensors"}
    assert {Path(line) for line in out.split()} == files
    assert {p for p in out_dir.rglob("*") if p.is_file()} == files  # no leftovers
    saved = alpha_state(4)
    for name in ("policy", "optimizer"):
        path = out_dir / f"{name}.safetensors"
        expected = flatten(saved[name])
        tensors = load_file(str(path))
        assert sorted(tensors) == sorted(p for p, v in expected.items() if torch.is_tensor(v))
        for entry, value in tensors.items():
            assert_same(value, expected[entry])
            assert torch.equal(as_bytes(value), as_bytes(expected[entry]))
        with safe_open(str(path), framework="pt") as f:
            values = json.loads(f.metadata()["ckptstore.values"])
        assert values == {p: v for p, v in expected.items() if not torch.is_tensor(v)}

    # Nested component names become directories; --json lists the files.
    out_dir = populated.work / "beta-2"
    record = cli_json(populated, capsys, "export", "beta@2", str(out_dir))
    assert sorted(record["files"]) == [
        str(out_dir / "policy" / "rank0.safetensors"),
        str(out_dir / "policy" / "rank1.safetensors"),
    ]
    for rank in (0, 1):
        tensors = load_file(str(out_dir / "policy" / f"rank{rank}.safetensors"))
        expected = beta_state(2)[f"policy/rank{rank}"]
        assert sorted(tensors) == sorted(expected)
        assert_same({k: tensors[k] for k in expected}, expected)


def test_export_torch_format(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = populated.work / "torch"
    for target, state in (("alpha@7", alpha_state(7)), ("beta@1", beta_state(1))):
        code, out, err = cli(
            populated, capsys, "export", target, str(out_dir / target), "--format", "torch"
        )
        assert (code, err) == (0, "")
        for name, component in state.items():
            path = out_dir / target / f"{name}.pt"
            assert str(path) in out.split()
            assert_same(torch.load(path, weights_only=False), component)
            # Plain tensors, containers and numbers: loadable without unpickling code, too.
            assert_same(torch.load(path, weights_only=True), component)


def test_export_refuses_names_that_leave_the_directory(
    db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    parent = tmp_path / "exports"
    out_dir = parent / "out"
    out_dir.mkdir(parents=True)
    (parent / "outside").mkdir()
    (out_dir / "link").symlink_to(parent / "outside", target_is_directory=True)
    bad_components = ["../../etc/x", "../escape", "/etc/passwd", "a/../../b", "link/x", "a\\..\\b"]
    tensor_value = randn(1, 8)
    with open_run("nasty", db=db_url, store=root, writer_options=OPTIONS) as run:
        for step in range(1, len(bad_components) + 1):
            run.save(step, {"policy": {"w": tensor_value}}).wait()
        # A well-named component whose entry path climbs out.
        entry_step = len(bad_components) + 1
        run.save(entry_step, {"policy": {"..": {"..": {"etc": {"x": tensor_value}}}}}).wait()
    # save() refuses such names now; a manifest written before it did may still hold them.
    database = Database(db_url)
    try:
        with database.engine.begin() as conn:
            for step, name in enumerate(bad_components, start=1):
                conn.execute(
                    text(
                        "UPDATE components SET name = :name WHERE checkpoint_id = "
                        "(SELECT id FROM checkpoints WHERE step = :step)"
                    ),
                    {"name": name, "step": step},
                )
    finally:
        database.close()
    base = ["--db", db_url, "--store", str(root)]
    before = tree(parent)

    for fmt in ("safetensors", "torch"):
        for step, name in enumerate(bad_components, start=1):
            capsys.readouterr()
            code = main([*base, "export", f"nasty@{step}", str(out_dir), "--format", fmt])
            out, err = capsys.readouterr()
            assert (code, out) == (2, ""), name
            assert_one_line_error(err, repr(name))
            assert tree(parent) == before, name
        capsys.readouterr()
        code = main([*base, "export", f"nasty@{entry_step}", str(out_dir), "--format", fmt])
        out, err = capsys.readouterr()
        assert (code, out) == (3, "")
        assert_one_line_error(err, "../../etc/x", "refusing")
        assert tree(parent) == before
    assert not (tmp_path / "etc").exists()


# -- plot ------------------------------------------------------------------------------------------


def test_plot(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    png = populated.work / "reward.png"
    code, out, err = cli(
        populated, capsys, "plot", "alpha", "--metric", "train:reward", "-o", str(png)
    )
    assert (code, out, err) == (0, f"{png}\n", "")
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000
    # Committed and deleted checkpoints with the metric; the failed save has none.
    record = cli_json(
        populated, capsys, "plot", "alpha", "--metric", "train:reward", "-o", str(png)
    )
    assert record == {"file": str(png), "points": 6}

    nothing = populated.work / "nothing.png"
    code, out, err = cli(
        populated, capsys, "plot", "beta", "--metric", "train:reward", "-o", str(nothing)
    )
    assert (code, out) == (3, "")
    assert_one_line_error(err, "'beta'", "train:reward")
    assert not nothing.exists()


# -- sql -------------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def plain_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh manifest whose tables live in the connection's default schema: a SQLite file,
    or a new PostgreSQL database (not a schema selected through the URL) on the test server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'plain.db'}"
        return
    base = make_url(request.getfixturevalue("pg_url"))
    name = f"ckpt_cli_{secrets.token_hex(6)}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def sql_store(plain_db_url: str, tmp_path: Path) -> Populated:
    work = tmp_path / "work"
    work.mkdir()
    return populate(plain_db_url, tmp_path / "store", work)


def test_sql_formats(sql_store: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    query = (
        "SELECT r.name AS run, c.step AS step, c.status AS status FROM checkpoints c"
        " JOIN runs r ON r.id = c.run_id WHERE r.name = 'alpha' ORDER BY c.step"
    )
    expected = [("alpha", s, st) for s, st in ALPHA_STATUS.items()]
    flags = superuser_flag(sql_store.db_url)

    code, out, err = cli(sql_store, capsys, "sql", query, *flags)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == ["run", "step", "status"]
    assert [tuple(line.split()) for line in lines[2:]] == [(r, str(s), st) for r, s, st in expected]

    code, out, err = cli(sql_store, capsys, "sql", query, "--format", "json", *flags)
    assert (code, err) == (0, "")
    assert json.loads(out) == [{"run": r, "step": s, "status": st} for r, s, st in expected]
    assert json.loads(cli(sql_store, capsys, "--json", "sql", query, *flags)[1]) == json.loads(out)

    # The views for people; csv for scripts.
    code, out, err = cli(
        sql_store,
        capsys,
        "sql",
        "SELECT run, checkpoints, failed FROM run_summary ORDER BY run",
        "--format",
        "csv",
        *flags,
    )
    assert (code, err) == (0, "")
    assert out.splitlines() == ["run,checkpoints,failed", "alpha,7,1", "beta,2,0"]

    code, out, err = cli(sql_store, capsys, "sql", "SELECT 1 AS one WHERE 1 = 0", *flags)
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == "one"


#: Not a query: refused by the statement-kind check before anything connects (exit 2).
NOT_A_QUERY = [
    "INSERT INTO runs (name, writer_epoch, higher_is_better) VALUES ('evil', 0, TRUE)",
    "UPDATE checkpoints SET status = 'deleted'",
    "DELETE FROM checkpoint_blobs",
    "DELETE FROM runs",
    "CREATE TABLE evil (a INTEGER)",
    "DROP VIEW run_summary",
    "DROP TABLE blobs",
    "COMMIT; DELETE FROM runs",
    "ROLLBACK; DELETE FROM runs",
]
#: A query that would write: it passes the kind check, and the database refuses it (exit 3).
WRITING_QUERY = "WITH gone AS (DELETE FROM runs RETURNING id) SELECT count(*) FROM gone"
#: What the database says: SQLite has no DELETE inside WITH; PostgreSQL allows none in the
#: subquery that `ckptstore sql` wraps every query in.
SQLITE_REFUSAL = re.compile(r'near "DELETE": syntax error')
POSTGRES_REFUSAL = re.compile(r"data-modifying statement must be at the top level")


def superuser_flag(db_url: str) -> list[str]:
    """The tests connect to PostgreSQL as its superuser, which `sql` refuses unless told."""
    return [] if db_url.startswith("sqlite") else ["--allow-superuser"]


def table_contents(db_url: str) -> dict[str, Any]:
    db = Database(db_url)
    try:
        with db.read() as session:
            contents: dict[str, Any] = {
                table: session.execute(text(f"SELECT * FROM {table} ORDER BY 1")).all()
                for table in ("runs", "checkpoints", "components", "blobs", "checkpoint_blobs")
            }
            contents["run_summary"] = session.execute(
                text("SELECT * FROM run_summary ORDER BY 1")
            ).all()
            contents["tables"] = sorted(
                session.execute(
                    text("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")
                    if db.is_sqlite
                    else text(
                        "SELECT table_name FROM information_schema.tables"
                        " WHERE table_schema = current_schema()"
                    )
                ).scalars()
            )
        return contents
    finally:
        db.close()


def test_sql_refuses_every_write(sql_store: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    before = table_contents(sql_store.db_url)
    assert len(before["runs"]) == 2
    assert "evil" not in before["tables"]
    flags = superuser_flag(sql_store.db_url)
    for statement in NOT_A_QUERY:
        code, out, err = cli(sql_store, capsys, "sql", statement, *flags)
        assert (code, out) == (2, ""), statement
        assert_one_line_error(err, "read-only")
        assert table_contents(sql_store.db_url) == before, statement
    code, out, err = cli(sql_store, capsys, "sql", WRITING_QUERY, *flags)
    assert (code, out) == (3, "")
    assert_one_line_error(err)
    refusal = SQLITE_REFUSAL if sql_store.db_url.startswith("sqlite") else POSTGRES_REFUSAL
    assert refusal.search(err), err
    assert table_contents(sql_store.db_url) == before
    # Still a working manifest afterwards.
    assert cli(sql_store, capsys, "latest", "alpha") == (0, "7\n", "")


@pytest.mark.integration
def test_sql_honours_options_in_the_postgresql_url(
    pg_schema_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with open_run("alpha", db=pg_schema_url, store=tmp_path / "store") as run:
        run.save(1, {"policy": {"w": randn(1, 8)}}).wait()
    base = ["--db", pg_schema_url, "--store", str(tmp_path / "store")]
    capsys.readouterr()
    # The test server's login is its superuser.
    code = main([*base, "--json", "sql", "SELECT name FROM runs", "--allow-superuser"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out) == [{"name": "alpha"}]


def test_sql_attach_creates_no_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db_url = f"sqlite:///{tmp_path / 'manifest.db'}"
    with open_run("alpha", db=db_url, store=tmp_path / "store") as run:
        run.save(1, {"policy": {"w": randn(1, 8)}}).wait()
    target = tmp_path / "created-by-sql.db"
    capsys.readouterr()
    main(["--db", db_url, "sql", f"ATTACH DATABASE '{target}' AS evil"])
    assert not target.exists()
