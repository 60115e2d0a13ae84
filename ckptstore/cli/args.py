"""Names and ``RUN@STEP`` targets as the command line gives them, checked before any lookup."""

from __future__ import annotations

import re

from ckptstore.cli.output import quoted
from ckptstore.errors import ConfigError

#: Steps are stored as signed 64-bit integers.
MAX_STEP = 2**63 - 1
#: One to nineteen ASCII digits (``str.isdigit`` also accepts other scripts' digits).
DIGITS = re.compile(r"[0-9]{1,19}", re.ASCII)


def parse_target(text: str) -> tuple[str, int | None]:
    """``RUN`` or ``RUN@STEP``, STEP in ASCII digits from 0 to 2**63-1."""
    name, sep, step = text.rpartition("@")
    if not sep:
        return lookup_name(text), None
    if not name or not DIGITS.fullmatch(step) or int(step) > MAX_STEP:
        raise ConfigError(
            f"{quoted(text)}: use RUN or RUN@STEP (STEP a whole number from 0 to {MAX_STEP})"
        )
    return lookup_name(name), int(step)


def lookup_name(text: str, what: str = "run name") -> str:
    """``text`` if it can be looked up at all: a name the manifest could hold."""
    if "\x00" in text:
        raise ConfigError(f"{what} {quoted(text)} contains a NUL character")
    try:
        text.encode()
    except UnicodeEncodeError:  # undecodable bytes on the command line (surrogate escapes)
        raise ConfigError(f"{what} {quoted(text)} is not valid UTF-8") from None
    return text
