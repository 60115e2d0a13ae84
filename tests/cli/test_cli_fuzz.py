"""Generated arguments to every ``ckptstore`` subcommand, through ``ckptstore.cli.main``.

``--db`` and ``--store`` point at a real manifest and store (see :mod:`test_cli_inputs`), at
missing paths, at files that are not what they should be, or are empty; the other arguments mix
plausible values with unicode digits, control characters, ``@``, ``/``, ``..``, huge and negative
numbers, ``inf``/``nan`` and empty strings. Whatever the input:

- no exception escapes ``main`` (argparse's own exit aside) and nothing prints a traceback;
- the exit code is 0, 1, 2 or 3;
- an error (exit 2 or 3) says so in one line (``ckptstore: error: ...``), or, for a command
  line argparse cannot parse, its usage and one error line, with exit 2; a check that found
  problems (exit 1) reports on stdout;
- nothing printed carries a raw control character;
- nothing is created, except the files a successful ``export`` or ``plot`` was asked to write
  (those are checked for and removed).

Commands that change the manifest or the store (``verify`` marking, ``gc`` sweeping) may run
against the real site; it is restored after each example so every example starts the same.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli_inputs import EVIL, Site, build_site, tree

from ckptstore.cli import main
from ckptstore.manifest.db import head_revision

SETTINGS = settings(
    deadline=None,
    database=None,  # no .hypothesis directory in the repository
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

# -- generated arguments ------------------------------------------------------------------------

TRICKY = [
    "",
    " ",
    "@",
    "@1",
    "fuzz",
    "fuzz@1",
    "fuzz@2",
    "fuzz@0",
    "fuzz@-1",
    "fuzz@\u0661\u0662",
    "fuzz@\u00b2",
    "fuzz@9223372036854775807",
    "fuzz@9223372036854775808",
    "fuzz@" + "9" * 40,
    "fuzz@1.5",
    "fuzz@1e3",
    "fuzz@@1",
    EVIL,
    f"{EVIL}@1",
    "\x1b[31m",
    "\x1b]0;title\x07",
    "\u202e",
    "\n",
    "\t",
    "..",
    "../..",
    "/",
    "a/../b",
    "~nobody-ckpt",
    "inf",
    "-inf",
    "nan",
    "1e400",
    "-1",
    "0",
    "99999999999d",
    "3650d",
    "-5s",
    "6h",
    "x" * 300,
    "bad\udcffutf8",  # undecodable bytes on a real command line
    "$x^",
    "%s%n",
    "'",
    "\\",
    "-",
    "--",
]
ALPHABET = st.one_of(
    st.sampled_from(list("@/.-:_~$ 0123456789\x1b[]\n\t\u0661\u00b2\u202e\x07")),
    st.characters(blacklist_characters="\x00"),  # argv cannot hold NUL
)
TEXT = st.text(ALPHABET, max_size=24)
WORD = st.one_of(st.sampled_from(TRICKY), TEXT)
#: No URL of a real server: a request to one would wait on the network.
LOCAL_WORD = WORD.filter(lambda w: "://" not in w)
NUMBER = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)

REAL = object()  # stands for the real site's path
DB = st.one_of(
    st.sampled_from(
        [
            REAL,
            None,  # the default, ./.ckptstore/manifest.db: missing
            "typo.db",
            "nodir/sub/m.db",
            "notdb.txt",
            "empty.db",
            "adir",
            "",
            "store",
            "sqlite:///missing.db",
            "sqlite://",
            "postgresql://nobody@127.0.0.1:1/x",
            "mysql://host/db",
        ]
    ),
    LOCAL_WORD,
)
STORE = st.one_of(
    st.sampled_from(
        [
            REAL,
            None,
            "newdir",
            "nodir/sub/store",
            "afile",
            "adir",
            "notdb.txt",
            "",
            "s3://Bad_Bucket/x",
            "s3://ab",
            "s3://",
            "ftp://host/x",
            "file://host/x",
        ]
    ),
    LOCAL_WORD,
)
TARGET = st.one_of(WORD, st.tuples(WORD, st.one_of(NUMBER, WORD)).map("@".join))
EXPORT_DIR = st.one_of(
    st.sampled_from(["out/e", "out", "afile", "afile/sub", "adir/e", "", "nodir/deep/e"]),
    TEXT.map(lambda t: f"out/{t}"),
)
PLOT_OUT = st.one_of(
    st.sampled_from(
        ["out/p.png", "out/p.svg", "out/p", "out/p.xyz", "nodir/p.png", "afile/p.png", "", "adir"]
    ),
    st.tuples(TEXT, st.sampled_from([".png", ".pdf", ".PNG", "", ".x"])).map(
        lambda t: f"out/{t[0]}{t[1]}"
    ),
)


def flag(name: str, values: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    """Absent, or ``--name=VALUE`` (the ``=`` form lets a value start with '-')."""
    return st.one_of(st.just([]), values.map(lambda v: [f"--{name}={v}"]))


def switch(name: str) -> st.SearchStrategy[list[str]]:
    return st.sampled_from([[], [f"--{name}"]])


def command(*parts: st.SearchStrategy[list[str]]) -> st.SearchStrategy[list[str]]:
    return st.tuples(*parts).map(lambda lists: [a for part in lists for a in part])


def words(*fixed: str) -> st.SearchStrategy[list[str]]:
    return st.just(list(fixed))


def one(values: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    return values.map(lambda v: [v])


#: (argv after the global options, the output a success writes or None).
COMMANDS: st.SearchStrategy[tuple[list[str], str | None]] = st.one_of(
    words("runs").map(lambda a: (a, None)),
    command(words("ls"), one(WORD), switch("all")).map(lambda a: (a, None)),
    command(words("show"), one(TARGET), switch("entries")).map(lambda a: (a, None)),
    command(words("latest"), one(WORD)).map(lambda a: (a, None)),
    command(
        words("verify"),
        st.one_of(st.just([]), one(TARGET)),
        flag("sample", st.one_of(NUMBER, WORD)),
        switch("no-mark"),
    ).map(lambda a: (a, None)),
    command(
        words("gc"),
        switch("dry-run"),
        flag(
            "grace",
            st.one_of(
                WORD,
                st.tuples(NUMBER, st.sampled_from(["", "s", "m", "h", "d"])).map("".join),
            ),
        ),
    ).map(lambda a: (a, None)),
    command(
        words("sql"),
        one(
            st.one_of(
                st.sampled_from(
                    [
                        "SELECT 1",
                        "SELECT name FROM runs",
                        "SELECT * FROM run_summary",
                        "DELETE FROM runs",
                        "ATTACH DATABASE 'x.db' AS x",
                        "PRAGMA journal_mode=DELETE",
                        "VACUUM INTO 'copy.db'",
                    ]
                ),
                WORD,
            )
        ),
        flag("format", st.one_of(st.sampled_from(["table", "csv", "json"]), WORD)),
    ).map(lambda a: (a, None)),
    st.tuples(TARGET, EXPORT_DIR, flag("format", st.one_of(st.sampled_from(["torch"]), WORD))).map(
        lambda t: (["export", t[0], t[1], *t[2]], t[1])
    ),
    words("du").map(lambda a: (a, None)),
    st.tuples(WORD, st.one_of(st.just("train:loss"), WORD), PLOT_OUT).map(
        lambda t: (["plot", t[0], f"--metric={t[1]}", f"--output={t[2]}"], t[2])
    ),
    words("db", "current").map(lambda a: (a, None)),
)

# -- the site -------------------------------------------------------------------------------------


@dataclass
class FuzzSite:
    """The site, and a pristine copy of its manifest and store."""

    site: Site
    pristine: Path

    def restore(self) -> None:
        """Put the manifest and the store back as they were, for the next example."""
        if self.site.db.read_bytes() != (self.pristine / "manifest.db").read_bytes():
            shutil.copy2(self.pristine / "manifest.db", self.site.db)
        if tree(self.site.store) != tree(self.pristine / "store"):
            shutil.rmtree(self.site.store)
            shutil.copytree(self.pristine / "store", self.site.store)


@pytest.fixture(scope="module")
def fuzz_site(tmp_path_factory: pytest.TempPathFactory) -> FuzzSite:
    site = build_site(tmp_path_factory.mktemp("fuzz-site"))
    pristine = tmp_path_factory.mktemp("pristine")
    shutil.copy2(site.db, pristine / "manifest.db")
    shutil.copytree(site.store, pristine / "store")
    return FuzzSite(site, pristine)


@pytest.fixture
def fuzz(fuzz_site: FuzzSite, monkeypatch: pytest.MonkeyPatch) -> FuzzSite:
    monkeypatch.chdir(fuzz_site.site.root)
    monkeypatch.delenv("CKPTSTORE_DB", raising=False)
    monkeypatch.delenv("CKPTSTORE_STORE", raising=False)
    return fuzz_site


def run_checked(
    fuzz: FuzzSite, capsys: pytest.CaptureFixture[str], argv: list[str], output: str | None
) -> int:
    """Run ``argv`` and assert everything the module docstring promises; afterwards the site
    is as it was, whatever happened (so that a failure does not spill into the next example)."""
    root = fuzz.site.root
    before = tree(root)
    try:
        return check(root, before, capsys, argv, output)
    finally:
        remove(root, tree(root) - before)
        fuzz.restore()


def check(
    root: Path,
    before: set[str],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    output: str | None,
) -> int:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: usage errors and --help
        code = exc.code if isinstance(exc.code, int) else -1
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert code in (0, 1, 2, 3), (code, err)
    for line in (out + err).splitlines():
        assert line.isprintable(), f"raw control characters printed: {line!r}"
    lines = err.splitlines()
    if code == 1:  # a check found problems: the report is on stdout
        assert len(lines) <= 1, err
    elif code == 2 and err.startswith("usage: "):
        assert sum(": error: " in line for line in lines) == 1, err
        assert ": error: " in lines[-1], err
    elif code != 0:
        assert len(lines) == 1, err
        assert lines[0].startswith("ckptstore: error: "), err
    created = tree(root) - before
    if code == 0 and output is not None:
        target = (root / output).resolve()
        written = {e for e in created if wrote(root, e, target)}
        remove(root, written)
        created -= written
    assert sorted(created) == [], f"{argv} created {sorted(created)}"
    return code


def wrote(root: Path, entry: str, target: Path) -> bool:
    """Whether a successful export/plot to ``target`` made ``entry``: the target itself, a
    file below it, or a directory on the way to it."""
    path = (root / entry.split(":", 1)[1]).resolve()
    return path == target or target in path.parents or path in target.parents


def remove(root: Path, entries: set[str]) -> None:
    paths = sorted((root / e.split(":", 1)[1] for e in entries), key=lambda p: len(p.parts))
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def options(fuzz: FuzzSite, db: object, store: object) -> list[str]:
    site = fuzz.site
    db = site.db if db is REAL else db
    store = site.store if store is REAL else store
    return [f"--db={db}"] * (db is not None) + [f"--store={store}"] * (store is not None)


# -- the properties -------------------------------------------------------------------------------


@settings(SETTINGS, max_examples=800)
@given(db=DB, store=STORE, json_flag=st.booleans(), after=st.booleans(), command=COMMANDS)
def test_any_arguments_give_one_line_and_create_nothing(
    fuzz: FuzzSite,
    capsys: pytest.CaptureFixture[str],
    db: object,
    store: object,
    json_flag: bool,
    after: bool,
    command: tuple[list[str], str | None],
) -> None:
    """``after``: the global options follow the subcommand's arguments instead."""
    argv, output = command
    opts = [*options(fuzz, db, store), *(["--json"] if json_flag else [])]
    run_checked(fuzz, capsys, [*argv, *opts] if after else [*opts, *argv], output)


@settings(SETTINGS, max_examples=400)
@given(command=COMMANDS.filter(lambda c: c[0][0] != "db"), json_flag=st.booleans())
def test_arguments_against_the_real_site(
    fuzz: FuzzSite,
    capsys: pytest.CaptureFixture[str],
    command: tuple[list[str], str | None],
    json_flag: bool,
) -> None:
    """The same properties, always with the real database and store, so that the arguments
    themselves get past opening them."""
    argv, output = command
    json = ["--json"] if json_flag else []
    code = run_checked(fuzz, capsys, [*fuzz.site.base, *json, *argv], output)
    if argv[0] in ("runs", "du"):
        assert code == 0


@settings(SETTINGS, max_examples=25)
@given(revision=st.one_of(st.sampled_from(["head", "heads", "base", "-1", "+1", "0001"]), WORD))
def test_db_upgrade_against_the_real_database(
    fuzz: FuzzSite, capsys: pytest.CaptureFixture[str], revision: str
) -> None:
    """The one writer: only ever pointed at the real database, which must stay at head."""
    base = fuzz.site.base
    run_checked(fuzz, capsys, [*base, "db", "upgrade", revision], None)
    assert main([*base, "db", "current"]) == 0
    assert head_revision() in capsys.readouterr().out
