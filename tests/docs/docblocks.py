"""The code blocks of the README and the docs pages, as the docs test runs them.

A page is README.md or a Markdown file under docs/. Its fenced blocks are read in order; the
ones the test runs are ```bash and ```python blocks (```text, ```sql, ```yaml, ```json and the
rest are shown, never run). A python block whose first line is ``# NAME.py`` (a comment may
follow) is a file: it is written to NAME.py in the page's directory for a later bash block to
run; any other python block is a standalone script. ``<!-- docs-test: slow -->`` on the line
before a block (blank lines between are allowed) puts it in the slow tier.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_LANGUAGES = ("bash", "python")
SLOW_MARK = "<!-- docs-test: slow -->"
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
FILE_LINE = re.compile(r"^# (?P<name>[\w.-]+\.py)(?:\s|$)")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: str  # relative to the repository root, e.g. "docs/tiers.md"
    number: int  # 1-based among the page's blocks that run
    line: int  # 1-based line of the block's first code line
    language: str
    code: str
    slow: bool

    @property
    def first_line(self) -> str:
        """The block's first non-blank line (what a failure and the test id quote)."""
        return next((x.strip() for x in self.code.splitlines() if x.strip()), "")

    @property
    def file_name(self) -> str | None:
        """NAME.py for a python block that starts with ``# NAME.py``; else None."""
        if self.language != "python":
            return None
        found = FILE_LINE.match(self.code.splitlines()[0] if self.code else "")
        return found.group("name") if found else None

    @property
    def where(self) -> str:
        """``page, block N (line L): first line`` -- how a failure names the block."""
        return f"{self.page}, block {self.number} (line {self.line}): {self.first_line}"

    @property
    def test_id(self) -> str:
        """A short, stable pytest id: page, block number, line and the first line's words."""
        words = re.sub(r"[^A-Za-z0-9_.@/-]+", "_", self.first_line).strip("_")[:48]
        return f"{self.page}#{self.number}:L{self.line}:{words}"


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def fenced_blocks(text: str) -> list[tuple[int, str, str, bool]]:
    """Every fenced block of ``text``: (line of its first code line, language, code, slow).

    Indented fences (a block inside a list item) count; their indentation is removed.
    """
    lines = text.splitlines()
    found: list[tuple[int, str, str, bool]] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = len(opening.group("indent")), opening.group("fence")
        language = opening.group("info").strip().split(" ")[0].lower()
        previous = i - 1
        while previous >= 0 and not lines[previous].strip():
            previous -= 1
        slow = previous >= 0 and lines[previous].strip() == SLOW_MARK
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = lines[j].strip()
            if closing.startswith(fence[0] * len(fence)) and closing.strip(fence[0]) == "":
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        if j == len(lines):
            raise ValueError(f"line {i + 1}: a fenced block that never closes")
        found.append((i + 2, language, "\n".join(body) + "\n", slow))
        i = j + 1
    return found


def page_blocks(path: Path) -> list[Block]:
    """The blocks of one page that the test runs, numbered in order."""
    page = path.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    for line, language, code, slow in fenced_blocks(path.read_text()):
        if language in RUN_LANGUAGES:
            blocks.append(Block(page, len(blocks) + 1, line, language, code, slow))
    return blocks


def all_blocks() -> list[Block]:
    """Every block the docs test runs, page by page."""
    return [block for path in pages() for block in page_blocks(path)]
