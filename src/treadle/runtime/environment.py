"""Integer settings the runtime reads from environment variables."""

from __future__ import annotations

import logging
import os

__all__ = ["int_setting"]

log = logging.getLogger("treadle.runtime")


def int_setting(name: str, default: int) -> int:
    """The integer in environment variable `name`; `default` when unset, blank or not an integer
    (logged: a typo must not stop the program, nor pass silently)."""
    value = os.environ.get(name, "")
    try:
        return int(value) if value.strip() else default
    except ValueError:
        log.warning("%s=%r is not an integer; using %d", name, value, default)
        return default
