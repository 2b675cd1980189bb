"""Checks of a session file's header and trailer fields: types, sizes and ranges.

A saved file is input like any other: each field `treadle.persist.reader` reads must be of the
type the writer writes, within sizes nobody writes by accident (so a crafted file cannot make a
loaded session carry a megabyte id or a count no store column holds) and finite (JSON readers
accept `NaN` and `1e999`). `FieldError` says which field and why; the reader turns it into a
`PersistenceError` naming the file and the line. Pure checks, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_COUNT", "MAX_NAME_CHARS", "MAX_PARENTS", "FieldError", "check_count",
           "check_header"]  # fmt: skip

#: Largest token or row count a file may hold (what a signed 64-bit column holds).
MAX_COUNT = 2**63 - 1
#: Longest id, operator or placement name a file may hold.
MAX_NAME_CHARS = 4096
#: Most parent ids a header may list.
MAX_PARENTS = 10_000
_LATEST_TIME = 2**40  # seconds since 1970: year 36812, past any clock


class FieldError(ValueError):
    """A header or trailer field that is not what the writer writes: `field` and why."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(why)
        self.field = field


def check_count(field: str, value: object) -> int:
    """`value` as a count: an integer from 0 to `MAX_COUNT` (not a bool, not a float)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(field, f"{_shown(value)} is not a whole number")
    if not 0 <= value <= MAX_COUNT:
        raise FieldError(field, f"{_shown(value)} is not between 0 and 2**63 - 1")
    return value


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _name(field: str, value: object, *, empty: bool = True) -> None:
    if not isinstance(value, str):
        raise FieldError(field, f"{_shown(value)} is {type(value).__name__}, not a string")
    if len(value) > MAX_NAME_CHARS:
        raise FieldError(field, f"it has {len(value)} characters (at most {MAX_NAME_CHARS})")
    if not empty and not value:
        raise FieldError(field, "it is empty")


def check_header(header: Mapping[str, Any], newest_schema: int) -> None:
    """Every header field the reader uses, checked (`FieldError` for the first bad one);
    `schema` newer than `newest_schema` is left to the caller (it says: upgrade Treadle)."""
    schema = header.get("schema", 0)
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise FieldError("schema", f"{_shown(schema)} is not a number")
    if schema < 0:
        raise FieldError("schema", f"{schema} is negative")
    if header.get("session_id") is not None:
        _name("session_id", header["session_id"])
    if header.get("operator") is not None:
        _name("operator", header["operator"])
    parents = header.get("parent_ids", [])
    if not isinstance(parents, list):
        raise FieldError("parent_ids", f"{_shown(parents)} is not a list of ids")
    if len(parents) > MAX_PARENTS:
        raise FieldError("parent_ids", f"it lists {len(parents)} ids (at most {MAX_PARENTS})")
    for parent in parents:
        _name("parent_ids", parent, empty=False)
    created = header.get("created_at")
    if created is not None:
        if isinstance(created, bool) or not isinstance(created, int | float):
            raise FieldError("created_at", f"{_shown(created)} is not a time")
        # Compared, not converted (a 400-digit integer overflows float()); NaN compares false.
        if not 0 <= created <= _LATEST_TIME:
            raise FieldError("created_at", f"{_shown(created)} is not a time")
    if header.get("placement") is not None:
        _name("placement", header["placement"], empty=False)
    for key in ("producer", "placement_options"):
        if header.get(key) is not None and not isinstance(header[key], dict):
            raise FieldError(key, f"{_shown(header[key])} is not a JSON object")
