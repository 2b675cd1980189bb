"""The value types of `treadle`'s flags: each refuses a bad value with what it expected, which
the parser prints as `argument --flag: expected ...` with the command's usage."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["count", "json_object", "milliseconds", "positive_int"]


def positive_int(text: str) -> int:
    """A whole number of 1 or more."""
    return _whole_number(text, 1, "at least 1")


def count(text: str) -> int:
    """A whole number of 0 or more."""
    return _whole_number(text, 0, "0 or more")


def _whole_number(text: str, least: int, expected: str) -> int:
    """A whole number of `least` or more; below it, `expected ...` says what `expected` says."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def milliseconds(text: str) -> float:
    """A finite number of milliseconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not (value >= 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected 0 or more milliseconds, got {text}")
    return value


def json_object(text: str) -> dict[str, Any]:
    """A JSON object (`{...}`), parsed."""
    import json

    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value
