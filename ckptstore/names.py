"""The grammar of run and component names, and how names are shown safely.

Defined once here and enforced when a name is created (``open_run`` for a new run, ``save`` and
``ShardWriter.write`` for components), so every name in the manifest can be typed on the command
line (``RUN@STEP``), used as a file name by ``export`` and printed without side effects.

- A **run name**: 1-255 characters, no control or invisible formatting characters (NUL, ESC,
  newlines, bidi overrides, ...), no ``@`` (it separates run and step in ``RUN@STEP``), no
  leading or trailing whitespace.
- A **component name**: 1-255 characters, one or more ``/``-separated segments, each made of
  letters and digits of any script (``str.isalnum``; a combining mark may follow one, as
  Devanagari or Thai need) and ``._-+=:,``, none of them ``.`` or ``..`` (``policy``,
  ``policy/rank3``, ``optimizer/shard-0``, ``策略/秩3``). The name must be in NFKC form, so no
  compatibility look-alike of another name passes (fullwidth letters, a superscript ``²``, the
  ligature U+FB01 for ``fi``, a decomposed ``é``); spaces, control and format characters (bidi
  overrides, zero-width joiners) and every other punctuation are refused. So a component name is
  a safe file path (no separator but ``/``, no traversal, no backslash) that prints as it reads.
"""

from __future__ import annotations

import re
import unicodedata

from ckptstore.errors import ConfigError

MAX_NAME_LEN = 255
#: The punctuation a component segment may hold besides letters and digits.
_PUNCTUATION = frozenset("._+=:,-")
#: Combining marks: spacing (Mc) and not (Mn); enclosing ones (Me) draw over their neighbours.
_MARKS = frozenset({"Mn", "Mc"})


def _invisible(ch: str) -> bool:
    """Control (Cc), format (Cf: bidi overrides, zero-width), separators other than a space,
    surrogates and unassigned code points: nothing a person can see or type reliably."""
    category = unicodedata.category(ch)
    return category in {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"} or (
        category == "Zs" and ch != " "
    )


def check_run_name(name: object) -> str:
    """``name`` if it is a valid run name; else a ConfigError that says what is wrong."""
    if not isinstance(name, str):
        raise ConfigError(f"run name must be a string, got {type(name).__name__}")
    if not name or len(name) > MAX_NAME_LEN:
        raise ConfigError(f"run name must be 1-{MAX_NAME_LEN} characters, got {len(name)}")
    bad = sorted({ch for ch in name if _invisible(ch)})
    if bad:
        raise ConfigError(
            f"invalid run name {printable(name)!r}: it contains control or invisible "
            f"characters ({', '.join(f'U+{ord(c):04X}' for c in bad)}); use visible characters"
        )
    if "@" in name:
        raise ConfigError(
            f"invalid run name {printable(name)!r}: '@' separates run and step in RUN@STEP; "
            "use another character (e.g. '-')"
        )
    if name != name.strip():
        raise ConfigError(
            f"invalid run name {printable(name)!r}: it starts or ends with whitespace"
        )
    return name


# The common case, an ASCII name, in one match (ASCII is its own NFKC form): segments of ASCII
# letters, digits and the punctuation, none of them '.' or '..'. Anything else takes the full
# check below, which gives the error.
_ASCII_SEGMENT = rf"(?!\.\.?(?:/|\Z))[A-Za-z0-9{re.escape(''.join(sorted(_PUNCTUATION)))}]+"
_ASCII_COMPONENT = re.compile(rf"{_ASCII_SEGMENT}(?:/{_ASCII_SEGMENT})*")


def check_component_name(name: object) -> str:
    """``name`` if it is a valid component name; else a ConfigError naming the rule."""
    if not isinstance(name, str):
        raise ConfigError(f"component name must be a string, got {type(name).__name__}")
    if len(name) <= MAX_NAME_LEN and _ASCII_COMPONENT.fullmatch(name):
        return name
    if (
        not name
        or len(name) > MAX_NAME_LEN
        or not all(_segment_ok(s) and s not in (".", "..") for s in name.split("/"))
    ):
        raise ConfigError(
            f"invalid component name {printable(name)!r}: use 1-{MAX_NAME_LEN} characters in "
            "'/'-separated segments of letters and digits (any script) and ._-+=:, (no empty, "
            "'.' or '..' segment), e.g. 'policy' or 'policy/rank3'"
        )
    normal = unicodedata.normalize("NFKC", name)
    if normal != name:
        raise ConfigError(
            f"invalid component name {printable(name)!r}: it is not in NFKC form (a fullwidth "
            "or superscript character, a ligature or a decomposed accent, which could pass for "
            f"another name); use {printable(normal)!r}"
        )
    return name


def _segment_ok(segment: str) -> bool:
    """Letters and digits, each maybe followed by combining marks, and the punctuation."""
    after_alnum = False
    for ch in segment:
        if ch.isalnum():
            after_alnum = True
        elif unicodedata.category(ch) in _MARKS:
            if not after_alnum:
                return False
        elif ch in _PUNCTUATION:
            after_alnum = False
        else:
            return False
    return bool(segment)


_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")


def check_kind(kind: object) -> str:
    """A component kind ("state", "policy", "optimizer", "replay_buffer", ...): 1-32 lowercase
    letters, digits and underscores, starting with a letter (the manifest's column is 32)."""
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise ConfigError(
            f"invalid component kind {printable(repr(kind))}: use 1-32 lowercase letters, digits "
            "and '_', starting with a letter (e.g. 'policy', 'optimizer', 'state')"
        )
    return kind


MAX_STEP = 2**63 - 1  # the manifest stores steps as BIGINT


def check_step(step: object) -> int:
    """``step`` if it is an int in 0..2**63-1 (what the manifest can store); else ConfigError."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise ConfigError(f"step must be an integer, got {type(step).__name__} {step!r}")
    if not 0 <= step <= MAX_STEP:
        raise ConfigError(f"step must be between 0 and 2**63-1, got {step}")
    return step


_STEP_DIGITS = re.compile(r"[0-9]+")


def parse_target(text: str, *, what: str = "target") -> tuple[str, int | None]:
    """``RUN`` or ``RUN@STEP`` -> (run, step or None); STEP is ASCII digits within 0..2**63-1."""
    name, sep, step = text.rpartition("@")
    if not sep:
        return text, None
    if not name or not _STEP_DIGITS.fullmatch(step) or int(step) > MAX_STEP:
        raise ConfigError(
            f"{what} {printable(text)!r}: use RUN or RUN@STEP (STEP a whole number from 0 to "
            f"{MAX_STEP})"
        )
    return name, int(step)


_STEP_ID = re.compile(r"([0-9]+)|(?:.*/)?step-([0-9]+)/?")


def parse_step_id(value: object, *, what: str = "checkpoint_id") -> int:
    """The step a checkpoint id names: an int, ASCII digits (``"30"``), or a path whose last
    segment is ``step-N`` as torchtitan names its checkpoints (``"checkpoint/step-30"``,
    ``"s3://bucket/run/step-30/"``); else a ConfigError naming ``what`` and the forms."""
    digits: str | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        digits = str(value) if value >= 0 else None
    elif isinstance(value, str) and (found := _STEP_ID.fullmatch(value)):
        digits = found.group(1) or found.group(2)
    if digits is None or len(digits) > len(str(MAX_STEP)) or int(digits) > MAX_STEP:
        shown = printable(repr(value))
        shown = shown if len(shown) <= 80 else f"{shown[:60]}...({len(shown)} characters)"
        raise ConfigError(
            f"{what}={shown}: use a step (a whole number from 0 to {MAX_STEP}) or a path "
            "whose last part is step-N, e.g. 'checkpoint/step-30'"
        )
    return int(digits)


def printable(text: object) -> str:
    """``text`` safe to print on a terminal: control and invisible characters (ESC, NUL,
    newlines, bidi overrides) become ``\\x1b`` / ``\\u202e`` escapes; backslashes are doubled
    only where an escape could be mistaken for one."""
    value = str(text)
    if not any(_invisible(ch) or ch == "\\" for ch in value):
        return value
    out = []
    for ch in value:
        if ch == "\\":
            out.append("\\\\")
        elif _invisible(ch):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)
