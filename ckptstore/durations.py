"""Durations as people write them, parsed in one place (``gc --grace``, the trainer's
``checkpoint_must_save_by``): ``30s``, ``15m``, ``6h``, ``2d``, a plain number of seconds, or
``DD:HH:MM:SS``."""

from __future__ import annotations

import math
import re

from ckptstore.errors import ConfigError

#: Longer than any sensible grace or budget; bounds what a timedelta can hold, too.
MAX_SECONDS = 3650 * 86400
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_SUFFIXED = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd]?)")
_CLOCK = re.compile(r"([0-9]+):([0-9]{1,2}):([0-9]{1,2}):([0-9]{1,2})")


def parse_duration(text: str, *, what: str = "duration") -> float:
    """Seconds in ``text``; a ConfigError naming ``what`` and the accepted forms otherwise."""
    value = str(text).strip()
    clock = _CLOCK.fullmatch(value)
    if clock:
        days, hours, minutes, seconds = (int(g) for g in clock.groups())
        if hours > 23 or minutes > 59 or seconds > 59:
            raise ConfigError(
                f"{what}={value!r}: hours, minutes and seconds must be within 23:59:59 "
                "(format DD:HH:MM:SS)"
            )
        total = float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    else:
        match = _SUFFIXED.fullmatch(value)
        if not match:
            raise ConfigError(f"invalid {what} {value!r}: use e.g. 30s, 15m, 6h, 2d or DD:HH:MM:SS")
        total = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if not math.isfinite(total) or total > MAX_SECONDS:
        raise ConfigError(f"invalid {what} {value!r}: longer than 3650 days")
    return total
