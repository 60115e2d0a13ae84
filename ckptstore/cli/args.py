"""Names and ``RUN@STEP`` targets as the command line gives them, checked before any lookup."""

from __future__ import annotations

import re

from ckptstore import names
from ckptstore.cli.output import quoted
from ckptstore.errors import ConfigError

#: One to nineteen ASCII digits (``str.isdigit`` also accepts other scripts' digits).
DIGITS = re.compile(r"[0-9]{1,19}", re.ASCII)


def parse_target(text: str) -> tuple[str, int | None]:
    """``RUN`` or ``RUN@STEP`` (``ckptstore.names.parse_target``), the run name checked for
    lookup."""
    name, step = names.parse_target(text)
    return lookup_name(name), step


def lookup_name(text: str, what: str = "run name") -> str:
    """``text`` if it can be looked up at all: a name the manifest could hold."""
    if "\x00" in text:
        raise ConfigError(f"{what} {quoted(text)} contains a NUL character")
    try:
        text.encode()
    except UnicodeEncodeError:  # undecodable bytes on the command line (surrogate escapes)
        raise ConfigError(f"{what} {quoted(text)} is not valid UTF-8") from None
    return text
