"""Every ```bash and ```python block of README.md and docs/**/*.md runs as printed.

How a page runs (tests/docs/docblocks.py reads the blocks):

- Each page gets a fresh directory in which ``.venv`` is a symlink to the running virtual
  environment (``sys.prefix``) and ``trainer`` one to the checkout's ``trainer/`` (the
  reference trainer is run from a checkout, never installed: ``.venv/bin/python -m
  trainer.grpo`` works there as it does at the checkout root), and ``.cache`` one to the
  checkout's, when make has installed something there (Azurite, for docs/azure.md). Nothing
  else is there.
- Its blocks run in order in that directory: a ```bash block with ``bash -euo pipefail``; a
  ```python block whose first line is ``# NAME.py`` is written to NAME.py (a later bash block
  runs it); any other python block runs as a standalone script with ``.venv/bin/python``.
  Output shown in ```text blocks is not run and not compared: a block passes when it exits 0
  (the commands' output is other code's to test).
- The environment is the test process's without ``CKPTSTORE_DB``, ``CKPTSTORE_STORE``,
  ``VIRTUAL_ENV`` and ``PYTHONPATH``, and without the venv's ``bin`` on ``PATH``: a bare
  ``ckptstore`` or ``python -m trainer.grpo`` in a page fails here as in a fresh shell.
- Each block is its own test (id: page, block number, line, first line). A block depends on
  the page's earlier blocks: selecting one (``-k``) runs the earlier ones first, and when an
  earlier one failed, the later ones fail naming it. A block after ``<!-- docs-test: slow -->``
  is marked slow (``make test-slow``); when this session deselected it, later blocks run
  without it (so a block that needs a slow one is marked slow too).

Exceptions, the only ones: README's quick start is ``make demo`` / ``make test``. ``make test``
is not run here (CI runs it: it is this suite). ``make demo`` (slow) runs as the command it
stands for: the Makefile's demo recipe with its variables' defaults (``$(PY)`` is
``.venv/bin/python``), read from the Makefile (a ``make`` here would rebuild the venv it
cannot see). With gloo, torch occasionally aborts a rank at interpreter exit after the
script's last line ("terminate called without an active exception", see docs/dcp.md): a
one-command torchrun block that fails that way, with no rank raising, passes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from docblocks import ROOT, Block, all_blocks

BLOCKS = all_blocks()
FAST_TIMEOUT_S = 280
SLOW_TIMEOUT_S = 1200
TEARDOWN_ABORT = "terminate called without an active exception"
RANK_RAISED = re.compile(r"exitcode\s*:\s*1\b")
MAKE_TEST = re.compile(r"^make test(\s|$)")
MAKE_DEMO = re.compile(r"^make demo(\s|$)")


def demo_command() -> str:
    """The Makefile's ``make demo`` recipe, its variables given their defaults, for the page
    directory (``$(PY)`` is ``.venv/bin/python``)."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe is not None, "the Makefile has no demo target with a recipe"
    defaults = dict(re.findall(r"^(\w+) \?= ?(.*)$", makefile, re.M))
    defaults.update(PY=".venv/bin/python", VENV=".venv")
    command = "\n".join(x.strip().lstrip("@") for x in recipe.group(1).splitlines())
    command = re.sub(r"\$\((\w+)\)", lambda m: defaults.get(m.group(1), m.group(0)), command)
    assert "$(" not in command, f"the demo recipe uses a variable the test cannot set: {command}"
    return command


def as_run(block: Block) -> str:
    """The block's code as the test runs it: README's ``make`` lines replaced (see above)."""
    if block.page != "README.md":
        return block.code
    lines = []
    for line in block.code.splitlines():
        command = line.split("#", 1)[0].strip()
        if MAKE_TEST.match(command):
            continue  # CI runs it: it is this suite
        lines.append(demo_command() if MAKE_DEMO.match(command) else line)
    return "\n".join(lines) + "\n"


def child_env() -> dict[str, str]:
    """The environment a fresh shell would have: no ckptstore defaults, no active venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CKPTSTORE_DB", "CKPTSTORE_STORE", "VIRTUAL_ENV", "PYTHONPATH")
    }
    venv_bin = str(Path(sys.prefix) / "bin")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    env["PATH"] = os.pathsep.join(path or ["/usr/bin", "/bin"])
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class PageRun:
    """A page's directory and how far its blocks have run."""

    directory: Path
    done: int = 0  # blocks 1..done have run (or been passed over)
    failed: Block | None = None
    outputs: dict[int, str] = field(default_factory=dict)


@pytest.fixture(scope="session")
def page_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PageRun]:
    """One :class:`PageRun` per page, made on first use."""
    return {}


def page_run(runs: dict[str, PageRun], page: str, tmp: pytest.TempPathFactory) -> PageRun:
    """The page's run, with a fresh directory holding ``.venv`` and ``trainer`` links."""
    if page not in runs:
        directory = tmp.mktemp(re.sub(r"\W+", "-", page))
        (directory / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
        (directory / "trainer").symlink_to(ROOT / "trainer", target_is_directory=True)
        if (ROOT / ".cache").is_dir():  # what make installs there (Azurite, for docs/azure.md)
            (directory / ".cache").symlink_to(ROOT / ".cache", target_is_directory=True)
        runs[page] = PageRun(directory)
    return runs[page]


def execute(block: Block, directory: Path) -> tuple[bool, str]:
    """Run one block in ``directory``: (passed, its output)."""
    timeout = SLOW_TIMEOUT_S if block.slow else FAST_TIMEOUT_S
    if block.file_name is not None:
        (directory / block.file_name).write_text(block.code)
        return True, f"wrote {block.file_name}"
    if block.language == "python":
        script = directory / f".docs-block-{block.number}.py"
        script.write_text(block.code)
        argv = [str(directory / ".venv" / "bin" / "python"), script.name]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", as_run(block)]
    try:
        done = subprocess.run(
            argv,
            cwd=directory,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as stopped:
        out = stopped.stdout if isinstance(stopped.stdout, str) else ""
        return False, f"{out}\n[timed out after {timeout} s]"
    if done.returncode == 0:
        return True, done.stdout
    commands = [x for x in block.code.splitlines() if x.strip() and not x.startswith("#")]
    if (
        len(commands) == 1
        and "torchrun" in commands[0]
        and TEARDOWN_ABORT in done.stdout
        and not RANK_RAISED.search(done.stdout)
    ):
        return True, done.stdout  # gloo's teardown abort after the last line (see above)
    return False, f"{done.stdout}\n[exit status {done.returncode}]"


def report(block: Block, output: str) -> str:
    """A failure message: the block, then the tail of what it printed."""
    return f"{block.where}\n--- output (last 4000 characters) ---\n{output[-4000:]}"


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(
            b,
            id=b.test_id,
            marks=[pytest.mark.slow, pytest.mark.timeout(SLOW_TIMEOUT_S * 2)]
            if b.slow
            else [pytest.mark.timeout(FAST_TIMEOUT_S * 3)],
        )
        for b in BLOCKS
    ],
)
def test_docs_block_runs_as_printed(
    block: Block,
    request: pytest.FixtureRequest,
    page_runs: dict[str, PageRun],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The block (and, first, the page's earlier blocks that have not run) exits 0."""
    run = page_run(page_runs, block.page, tmp_path_factory)
    base = request.node.nodeid.split("[", 1)[0]
    selected = {item.nodeid for item in request.session.items}
    if run.failed is not None:
        pytest.fail(f"an earlier block of the page failed: {run.failed.where}")
    for earlier in [b for b in BLOCKS if b.page == block.page][run.done : block.number]:
        run.done = earlier.number
        if earlier is not block and earlier.slow and f"{base}[{earlier.test_id}]" not in selected:
            continue  # a slow block this session left out
        passed, output = execute(earlier, run.directory)
        run.outputs[earlier.number] = output
        if not passed:
            run.failed = earlier
            prefix = "" if earlier is block else "an earlier block of the page failed: "
            pytest.fail(prefix + report(earlier, output))


def test_every_page_has_blocks_and_names_its_files_once() -> None:
    """The runner finds blocks on every page that has code, and no two file blocks of a page
    write the same file (a later one would silently replace the first)."""
    pages = {b.page for b in BLOCKS}
    assert "README.md" in pages
    for page in pages:
        names = [b.file_name for b in BLOCKS if b.page == page and b.file_name]
        assert len(names) == len(set(names)), f"{page}: a file block written twice: {names}"


def test_blocks_are_read_with_their_tier_file_name_and_line() -> None:
    """A slow mark applies to the next block only; indented fences (in a list item) count;
    ```text and ```sql are shown, never run; ``# NAME.py`` makes a python block a file."""
    from docblocks import fenced_blocks

    text = (
        "# Page\n\n<!-- docs-test: slow -->\n\n```bash\nmake demo\n```\n\n"
        "```text\noutput\n```\n\n- item\n\n  ```python\n  # a.py\n  print(1)\n  ```\n"
        "```sql\nSELECT 1\n```\n"
    )
    found = fenced_blocks(text)
    assert [(line, lang, slow) for line, lang, _, slow in found] == [
        (6, "bash", True),
        (10, "text", False),
        (16, "python", False),
        (20, "sql", False),
    ]
    block = Block("p.md", 1, 16, "python", found[2][2], False)
    assert (block.file_name, block.code) == ("a.py", "# a.py\nprint(1)\n")
