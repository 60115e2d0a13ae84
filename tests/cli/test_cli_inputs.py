"""Bad command-line input: one line on stderr naming the argument, the documented exit code,
and nothing created on disk.

Exit codes: 2 for usage and configuration errors (a missing or wrong ``--db``/``--store``, a
malformed ``RUN@STEP``, an output path that cannot be written), 3 for store and database errors
(an unknown run, an unreachable server). Read commands open only what exists: a typo in a path
must fail, not create an empty database or store and report it healthy.

Every test runs in a site (a tmp dir, also the working directory) that holds a real SQLite
manifest and local store with run ``fuzz`` (steps 1 and 2, metric ``train:loss``), a run whose
name carries a terminal escape sequence (written through SQL: ``open_run`` refuses such names),
and a few traps: a text file, an empty file, a directory.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ckptstore.checkpointer import open_run
from ckptstore.cli import main
from ckptstore.cli.commands import du as du_command
from ckptstore.manifest.db import head_revision
from ckptstore.objectstore import _s3, _s3_client

#: A run name that would recolour the terminal and reverse the text after it if printed raw.
EVIL = "evil\x1b[31m\u202ename"
#: Every command that reads; none may create a database or a store.
READS: list[list[str]] = [
    ["runs"],
    ["ls", "fuzz"],
    ["show", "fuzz@1"],
    ["show", "fuzz", "--entries"],
    ["latest", "fuzz"],
    ["verify"],
    ["verify", "fuzz@1", "--sample", "1", "--no-mark"],
    ["gc", "--dry-run"],
    ["gc"],
    ["du"],
    ["sql", "SELECT name FROM runs"],
    ["export", "fuzz@1", "out/export"],
    ["plot", "fuzz", "--metric", "train:loss", "-o", "out/plot.png"],
    ["db", "current"],
]
#: The reads that open the object store as well.
STORE_READS = [argv for argv in READS if argv[0] in ("verify", "gc", "export")] + [
    ["show", "fuzz", "--entries"]
]


@dataclass
class Site:
    root: Path
    db: Path
    store: Path

    @property
    def base(self) -> list[str]:
        return ["--db", str(self.db), "--store", str(self.store)]


def build_site(root: Path) -> Site:
    """A small real store and manifest under ``root``, plus the traps."""
    site = Site(root, root / "manifest.db", root / "store")
    with open_run("fuzz", db=site.db, store=site.store, async_save=False) as run:
        for step in (1, 2):
            run.save(
                step,
                {"policy": {"w": torch.arange(16, dtype=torch.float32) * step}},
                metrics={"train:loss": 1.0 / step},
            )
    with sqlite3.connect(site.db) as conn:
        conn.execute(
            "INSERT INTO runs (name, writer_epoch, higher_is_better) VALUES (?, 0, 1)", (EVIL,)
        )
    conn.close()
    (root / "notdb.txt").write_text("just some text, not a database\n" * 10)
    (root / "empty.db").write_bytes(b"")
    (root / "adir").mkdir()
    (root / "afile").write_text("a file where a directory is expected\n")
    (root / "out").mkdir()
    return site


def tree(root: Path) -> set[str]:
    """Every path under ``root`` with its kind (contents aside: reads may touch the database)."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath, name)
            kind = "dir" if full.is_dir() and not full.is_symlink() else "file"
            found.add(f"{kind}:{full.relative_to(root)}")
    return found


@pytest.fixture(scope="module")
def site_root(tmp_path_factory: pytest.TempPathFactory) -> Site:
    return build_site(tmp_path_factory.mktemp("site"))


@pytest.fixture
def site(site_root: Site, monkeypatch: pytest.MonkeyPatch) -> Iterator[Site]:
    """The site as the working directory, no defaults from the environment; afterwards the
    outputs are cleared and nothing else may have appeared."""
    monkeypatch.chdir(site_root.root)
    monkeypatch.delenv("CKPTSTORE_DB", raising=False)
    monkeypatch.delenv("CKPTSTORE_STORE", raising=False)
    root = site_root.root
    before = tree(root)
    yield site_root
    for path in sorted((root / "out").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    created = tree(root) - before
    # Removed before the verdict, so that one failure does not spill into the next test.
    for entry in sorted(created, key=len):
        path = root / entry.split(":", 1)[1]
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    assert sorted(created) == [], "created by the command"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``ckptstore ARGV`` in-process: (exit code, stdout, stderr); argparse's exits included."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


def assert_error(err: str, *needles: str) -> None:
    """One line, ours, with each needle, and no raw control characters."""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckptstore: error: "), err
    assert lines[0].isprintable(), err
    for needle in needles:
        assert needle in lines[0], err


def assert_usage_error(err: str, *needles: str) -> None:
    """argparse's form: the usage, then one error line (ours are exit 2 as well)."""
    assert err.startswith("usage: "), err
    last = err.splitlines()[-1]
    assert ": error: " in last, err
    assert all(line.isprintable() for line in err.splitlines()), err
    for needle in needles:
        assert needle in last, err


# -- A: reads create nothing ------------------------------------------------------------------


@pytest.mark.parametrize("argv", READS, ids=lambda a: "-".join(a[:2]))
def test_every_read_of_the_real_site_works_and_leaves_no_trace(
    site: Site, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """The positive control; the fixture checks that nothing was left (no -wal/-shm either)."""
    code, out, err = run_cli(capsys, *site.base, *argv)
    assert (code, err) == (0, "")
    assert out


@pytest.mark.parametrize("db", ["typo.db", "nodir/sub/m.db", ".ckptstore/manifest.db"])
@pytest.mark.parametrize("argv", READS, ids=lambda a: "-".join(a[:2]))
def test_a_missing_database_is_an_error_and_nothing_is_created(
    site: Site, capsys: pytest.CaptureFixture[str], db: str, argv: list[str]
) -> None:
    code, out, err = run_cli(capsys, "--db", db, "--store", str(site.store), *argv)
    assert (code, out) == (2, "")
    assert_error(err, "no manifest database at", str(site.root / db), "nothing was created")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["verify", "--store", "newdir"], "no object store at"),
        (["gc", "--dry-run", "--store=newdir"], "no object store at"),
        (["runs", "--db", "typo.db"], "no manifest database at"),
        (["db", "current", "--db", "typo.db"], "no manifest database at"),
    ],
)
def test_db_and_store_may_follow_the_subcommand(
    site: Site, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, out, err = run_cli(capsys, "--db", str(site.db), *argv)
    assert (code, out) == (2, "")
    assert_error(err, needle)


def test_without_db_the_default_must_exist_too(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, "verify")
    assert code == 2
    assert_error(err, str(site.root / ".ckptstore" / "manifest.db"))


@pytest.mark.parametrize("argv", READS, ids=lambda a: "-".join(a[:2]))
def test_an_empty_db_option_is_refused_not_replaced_by_the_default(
    site: Site, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run_cli(capsys, "--db", "", "--store", str(site.store), *argv)
    assert (code, out) == (2, "")
    assert_error(err, "empty")


@pytest.mark.parametrize(
    ("db", "needle"),
    [("notdb.txt", "not a SQLite database"), ("empty.db", "empty"), ("adir", "adir")],
)
@pytest.mark.parametrize("argv", [["runs"], ["verify"], ["db", "current"]], ids="-".join)
def test_a_db_that_is_not_a_database_is_refused_untouched(
    site: Site, capsys: pytest.CaptureFixture[str], db: str, needle: str, argv: list[str]
) -> None:
    path = site.root / db
    before = path.read_bytes() if path.is_file() else None
    code, out, err = run_cli(capsys, "--db", db, "--store", str(site.store), *argv)
    assert (code, out) == (2, "")
    assert_error(err, str(path), needle)
    assert (path.read_bytes() if path.is_file() else None) == before


@pytest.mark.parametrize("store", ["newdir", "nodir/sub/store", ".ckptstore/store"])
@pytest.mark.parametrize("argv", STORE_READS, ids=lambda a: "-".join(a[:2]))
def test_a_missing_store_is_an_error_and_nothing_is_created(
    site: Site, capsys: pytest.CaptureFixture[str], store: str, argv: list[str]
) -> None:
    code, out, err = run_cli(capsys, "--db", str(site.db), "--store", store, *argv)
    assert (code, out) == (2, "")
    assert_error(err, "no object store at", str(site.root / store), "nothing was created")


@pytest.mark.parametrize(
    ("db", "needle"),
    [("~nobody-ckpt/m.db", "~nobody-ckpt"), ("x" * 300, "x" * 300), ("nodir/" + "y" * 300, "y")],
    ids=["unknown-home", "long-name", "long-name-below-a-missing-dir"],
)
@pytest.mark.parametrize("argv", [["runs"], ["sql", "SELECT 1"], ["db", "current"]], ids="-".join)
def test_a_db_path_the_os_refuses_is_a_configuration_error(
    site: Site, capsys: pytest.CaptureFixture[str], db: str, needle: str, argv: list[str]
) -> None:
    code, out, err = run_cli(capsys, "--db", db, *argv)
    assert (code, out) == (2, "")
    assert_error(err, needle)


@pytest.mark.parametrize(
    ("store", "needle"),
    [
        ("~nobody-ckpt/store", "invalid local store path '~nobody-ckpt/store'"),
        ("x" * 300, "File name too long"),
        ("nodir/" + "y" * 300, "no object store at"),
    ],
    ids=["unknown-home", "long-name", "long-name-below-a-missing-dir"],
)
def test_a_store_path_the_os_refuses_is_a_configuration_error(
    site: Site, capsys: pytest.CaptureFixture[str], store: str, needle: str
) -> None:
    code, out, err = run_cli(capsys, "--db", str(site.db), "--store", store, "verify")
    assert (code, out) == (2, "")
    assert_error(err, needle)


@pytest.mark.parametrize(
    ("store", "needle"),
    [
        ("", "empty store URL"),
        ("afile", "not a directory"),
        ("s3://Bad_Bucket/x", "invalid S3 bucket name 'Bad_Bucket'"),
        ("s3://ab/x", "3-63 characters"),
        ("s3://my..bucket/x", "'..'"),
        ("s3://10.0.0.1/x", "IP address"),
        ("ftp://host/x", "unsupported store URL scheme"),
        ("s3://[oops/x", "invalid store URL"),
    ],
)
def test_a_wrong_store_is_a_configuration_error(
    site: Site, capsys: pytest.CaptureFixture[str], store: str, needle: str
) -> None:
    code, out, err = run_cli(capsys, "--db", str(site.db), "--store", store, "verify")
    assert (code, out) == (2, "")
    assert_error(err, needle)


def test_db_upgrade_is_the_one_command_that_creates_a_database(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "--db", "out/new/m.db", "db", "upgrade")
    assert (code, err) == (0, "")
    assert f"-> {head_revision()}" in out
    assert (site.root / "out" / "new" / "m.db").is_file()
    code, out, err = run_cli(capsys, "--db", "out/new/m.db", "db", "current")
    assert (code, err) == (0, "")


# -- B: malformed arguments -------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "fuzz@9223372036854775808",  # 2**63: beyond a signed 64-bit step
        "fuzz@99999999999999999999999999999",
        "fuzz@\u0661\u0662",  # Arabic-Indic digits pass str.isdigit()
        "fuzz@\u00b2",  # so does a superscript two
        "fuzz@-1",
        "fuzz@+1",
        "fuzz@1.5",
        "fuzz@ 1",
        "fuzz@1e3",
        "fuzz@",
        "@1",
    ],
)
@pytest.mark.parametrize("command", ["show", "verify", "export"])
def test_a_malformed_step_is_a_usage_error(
    site: Site, capsys: pytest.CaptureFixture[str], target: str, command: str
) -> None:
    extra = ["out/export"] if command == "export" else []
    code, out, err = run_cli(capsys, *site.base, command, target, *extra)
    assert (code, out) == (2, "")
    assert_error(err, "RUN@STEP", "9223372036854775807")


def test_the_largest_step_is_looked_up(site: Site, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, *site.base, "show", "fuzz@9223372036854775807")
    assert (code, out) == (3, "")
    assert_error(err, "9223372036854775807")


@pytest.mark.parametrize(
    ("grace", "needle"),
    [
        ("inf", "invalid grace"),
        ("nan", "invalid grace"),
        ("-inf", "invalid grace"),
        ("1e400", "invalid grace"),
        ("1e400d", "invalid grace"),
        ("99999999999d", "longer than 3650 days"),
        ("3651d", "longer than 3650 days"),
        ("\u0663s", "invalid grace"),
        ("soon", "invalid grace"),
        ("", "invalid grace"),
        ("-5s", "negative"),
    ],
)
def test_an_absurd_grace_is_a_usage_error(
    site: Site, capsys: pytest.CaptureFixture[str], grace: str, needle: str
) -> None:
    code, out, err = run_cli(capsys, *site.base, "gc", "--dry-run", f"--grace={grace}")
    assert (code, out) == (2, "")
    assert_usage_error(err, "argument --grace", needle)


def test_the_longest_grace_is_accepted(site: Site, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, *site.base, "gc", "--dry-run", "--grace", "3650d")
    assert (code, err) == (0, "")
    assert "grace 3650 days" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "--sample=--"],
        ["gc", "--grace=--"],
        ["plot", "fuzz", "--metric=--", "-o", "out/p.png"],
        ["plot", "fuzz", "--metric", "train:loss", "-o--"],
        ["export", "fuzz@1", "out/x", "--format=--"],
        ["--db=--", "runs"],
    ],
    ids=lambda a: a[-1],
)
def test_an_attached_double_dash_is_not_a_value(
    site: Site, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """Python 3.11's argparse turns `--opt=--` into an empty list and skips the option's type."""
    code, out, err = run_cli(capsys, *site.base, *argv)
    assert (code, out) == (2, "")
    assert_usage_error(err, "expected one argument")


@pytest.mark.parametrize("sample", ["-1", "0", "1.5", "x", "\u0661", "", "1" * 30])
def test_a_sample_below_one_is_a_usage_error(
    site: Site, capsys: pytest.CaptureFixture[str], sample: str
) -> None:
    code, out, err = run_cli(capsys, *site.base, "verify", f"--sample={sample}")
    assert (code, out) == (2, "")
    assert_usage_error(err, "argument --sample", ">= 1")


def test_a_sample_of_one_checks_one_blob_per_checkpoint(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, *site.base, "verify", "--sample", "1", "--no-mark")
    assert (code, err) == (0, "")
    assert "verified 2 checkpoint(s), 2 blob(s)" in out


@pytest.mark.parametrize(
    ("directory", "needle"),
    [
        ("afile", "it exists and is not a directory"),
        ("afile/sub", "afile' is not a directory"),
        ("afile/sub/deeper", "afile' is not a directory"),
        ("", "empty string"),
    ],
)
def test_export_checks_its_directory_before_anything_else(
    site: Site, capsys: pytest.CaptureFixture[str], directory: str, needle: str
) -> None:
    # Checked before the database is opened: a missing --db does not come first.
    for base in (site.base, ["--db", "typo.db"]):
        code, out, err = run_cli(capsys, *base, "export", "fuzz@1", directory)
        assert (code, out) == (2, "")
        assert_error(err, "cannot export to", needle)


def test_export_into_an_unwritable_directory_is_refused(
    site: Site, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = site.root / "out" / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root may write anywhere: let the check see what a user would
        access = os.access
        monkeypatch.setattr(
            os, "access", lambda p, mode: access(p, mode) and Path(p) != locked.absolute()
        )
    try:
        code, out, err = run_cli(capsys, *site.base, "export", "fuzz@1", "out/locked/x")
    finally:
        locked.chmod(0o700)
    assert (code, out) == (2, "")
    assert_error(err, "out/locked' is not writable")
    assert list(locked.iterdir()) == []


def test_export_makes_its_directory_only_for_a_checkpoint_that_exists(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, *site.base, "export", "fuzz@7", "out/a/b")
    assert (code, out) == (3, "")
    assert_error(err, "step 7")
    assert not (site.root / "out" / "a").exists()
    code, out, err = run_cli(capsys, *site.base, "export", "fuzz@2", "out/a/b")
    assert (code, err) == (0, "")
    assert (site.root / "out" / "a" / "b" / "policy.safetensors").is_file()


@pytest.mark.parametrize(
    ("output", "needle"),
    [
        ("nodir/plot.png", "the directory 'nodir' does not exist"),
        ("out/no/plot.png", "the directory 'out/no' does not exist"),
        ("afile/plot.png", "'afile' is not a directory"),
        ("out/plot.xyz", "unknown image format '.xyz'; use one of"),
        ("out/plot", "no file extension"),
        ("adir", "no file extension"),
        ("", "empty"),
    ],
)
def test_plot_checks_its_output_before_the_database(
    site: Site, capsys: pytest.CaptureFixture[str], output: str, needle: str
) -> None:
    for base in (site.base, ["--db", "typo.db"]):
        code, out, err = run_cli(
            capsys, *base, "plot", "fuzz", "--metric", "train:loss", "-o", output
        )
        assert (code, out) == (2, "")
        assert_error(err, needle)


def test_plot_refuses_to_overwrite_a_directory(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    (site.root / "out" / "dir.png").mkdir()
    code, out, err = run_cli(
        capsys, *site.base, "plot", "fuzz", "--metric", "train:loss", "-o", "out/dir.png"
    )
    assert (code, out) == (2, "")
    assert_error(err, "cannot write a file there")


@pytest.mark.parametrize("output", ["out/p.svg", "out/p.PDF", "out/p.png"])
def test_plot_formats_and_names_that_matplotlib_would_parse(
    site: Site, capsys: pytest.CaptureFixture[str], output: str
) -> None:
    code, _, err = run_cli(
        capsys, *site.base, "plot", "fuzz", "--metric", "train:loss", "-o", output
    )
    assert (code, err) == (0, "")
    assert (site.root / output).stat().st_size > 0


def test_an_unreachable_database_server_is_one_line(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "--db", "postgresql://nobody@127.0.0.1:1/x", "runs")
    assert (code, out) == (3, "")
    assert_error(err, "127.0.0.1")


def test_an_unreachable_store_endpoint_is_one_error_without_retry_warnings(
    site: Site,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The store's default policy is built in _s3_client.retry_policy.
    fast = _s3.RetryPolicy(max_attempts=4, base_delay=0.001, max_delay=0.01)
    monkeypatch.setattr(_s3_client, "RetryPolicy", lambda: fast)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    with caplog.at_level("DEBUG", "ckptstore.objectstore"):
        code, out, err = run_cli(capsys, "--db", str(site.db), "--store", "s3://bucket/p", "verify")
    assert (code, out) == (3, "")
    # The store is asked once, when the command opens it (S3Store.check_usable).
    assert_error(err, "http://127.0.0.1:1", "did not answer", "check the endpoint")
    logged = [r for r in caplog.records if r.name == "ckptstore.objectstore"]
    assert logged, "the retries are logged, at DEBUG"
    assert all(r.levelname == "DEBUG" for r in logged)


# -- B: names are printed escaped -------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["runs"], ["du"], ["ls", EVIL], ["latest", EVIL], ["show", EVIL]],
    ids=lambda a: a[0],
)
def test_a_name_with_an_escape_sequence_is_printed_escaped(
    site: Site, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run_cli(capsys, *site.base, *argv)
    assert code in (0, 3)
    shown = out + err
    assert "\x1b" not in shown
    assert "\u202e" not in shown
    assert "evil\\x1b[31m\\u202ename" in shown
    assert all(line.isprintable() for line in shown.splitlines())
    if code:
        assert_error(err)


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "\x1b[2J"],
        ["show", "\x1b]0;title\x07@1"],
        ["verify", "\x1b[2J"],
        ["plot", "fuzz", "--metric", "\x1b[31m", "-o", "out/p.png"],
        ["export", "\x1b[2J@1", "out/x"],
        ["ls", "bad\udcffutf8"],  # undecodable bytes on a real command line
        ["show", "bad\udcff@1"],
        ["frobnicate\x1b[2J"],
        ["gc", "--grace", "\x1b[2J"],
        ["runs", "\x1b[2J"],
    ],
    ids=lambda a: a[0],
)
def test_input_echoed_in_an_error_is_escaped(
    site: Site, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run_cli(capsys, *site.base, *argv)
    assert code in (2, 3)
    assert out == ""
    assert "\x1b" not in err
    assert all(line.isprintable() for line in err.splitlines()), err
    if not err.startswith("usage:"):
        assert_error(err)


# -- what main lets through -------------------------------------------------------------------


def test_a_key_error_is_a_store_error(
    site: Site, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def lookup(*_args: object) -> None:
        raise KeyError("train:loss")

    monkeypatch.setattr(du_command, "disk_usage", lookup)
    code, out, err = run_cli(capsys, *site.base, "du")
    assert (code, out) == (3, "")
    assert_error(err, "train:loss")


def test_an_unexpected_exception_is_a_bug_and_stays_visible(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(du_command, "disk_usage", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main([*site.base, "du"])
