"""The regexes of an MCP server's schemas on RE2, compiled once, when the tools are listed.

RE2 never backtracks (linear in the text), but it holds the GIL while it compiles a pattern,
for up to the size of the program it builds (one 5,000-range character class repeated 100 times:
400-650 ms). So a pattern is compiled when its tool is listed, on a worker thread, never in a
check; it may have at most `MAX_SCHEMA_PATTERN` characters, and RE2 gets a 512 KiB memory budget,
so a big program fails fast and is refused (at the cap, at most 3 ms of CPU per compile on a quiet
machine, 15 ms under the test suite's load; an email or `^\\w{1,255}$` pattern needs far less); one
listing may have at most `MAX_LISTED_PATTERN_CHARACTERS` pattern characters in all. This module
must never run Python's `re` on a server's pattern.
"""

from __future__ import annotations

from typing import Any

import re2  # type: ignore[import-untyped]

__all__ = [
    "MAX_LISTED_PATTERN_CHARACTERS",
    "MAX_PATTERN_CHARACTERS",
    "MAX_SCHEMA_PATTERN",
    "Patterns",
    "SchemaRefused",
]

#: The longest string matched against a schema's `pattern` (a longer one is a validation error;
#: a longer property name counts as matching, for the server to decide).
MAX_PATTERN_CHARACTERS = 100_000
#: The longest `pattern` (or `patternProperties` key) a schema may have: RE2 holds the GIL while it
#: compiles one (at most 3 ms of CPU at this length with its memory budget, quiet, measured).
MAX_SCHEMA_PATTERN = 1000
#: The most pattern characters (distinct patterns) the schemas of one listing may have in all.
MAX_LISTED_PATTERN_CHARACTERS = 100_000
_RE2_MAX_MEM = 512 << 10


class SchemaRefused(ValueError):
    """A tool's input schema cannot be used; the message says why."""


def _options() -> Any:
    options = re2.Options()
    options.log_errors = False  # an unsupported pattern is an answer here, not an error to print
    options.never_capture = True  # only "does it match": no groups to keep
    # RE2 holds the GIL while it compiles, up to the program's size: a small memory budget makes
    # a big program fail fast (a 5,000-range class repeated 100 times held it 400-650 ms)
    options.max_mem = _RE2_MAX_MEM
    return options


_RE2_OPTIONS = _options()


class Patterns:
    """The RE2 form of each distinct pattern of the schemas of one listing, compiled once, when
    listed: at most `MAX_SCHEMA_PATTERN` characters each and `MAX_LISTED_PATTERN_CHARACTERS` in
    all (each compile holds the GIL, so both are capped); a check only matches."""

    __slots__ = ("_chars", "_regexes")

    def __init__(self) -> None:
        self._regexes: dict[str, Any] = {}
        self._chars = 0

    def add(self, pattern: str) -> None:
        """Compile `pattern` (once); `SchemaRefused` when it is too long or too big for RE2."""
        if pattern in self._regexes:
            return
        if len(pattern) > MAX_SCHEMA_PATTERN:
            raise SchemaRefused(
                f"a pattern of {len(pattern):,} characters is over the "
                f"{MAX_SCHEMA_PATTERN:,}-character limit ({pattern[:40]!r}...)"
            )
        self._chars += len(pattern)
        if self._chars > MAX_LISTED_PATTERN_CHARACTERS:
            raise SchemaRefused(
                f"its patterns add up to over {MAX_LISTED_PATTERN_CHARACTERS:,} characters "
                "(with those of the tools listed before it)"
            )
        try:
            self._regexes[pattern] = re2.compile(pattern, _RE2_OPTIONS)
        except re2.error as error:
            if "too large" in str(error):
                raise SchemaRefused(
                    f"its pattern {pattern[:40]!r}... is too large for RE2 to compile in "
                    f"{_RE2_MAX_MEM >> 10} KiB"
                ) from None
            self._regexes[pattern] = None  # RE2 cannot express it: left to the server

    def matches(self, pattern: str, text: str) -> bool | None:
        """Whether `text` matches `pattern`; None when that is the server's to decide."""
        if len(text) > MAX_PATTERN_CHARACTERS:
            return None
        if pattern not in self._regexes:  # not found when listed: compiled now, capped as then
            try:
                self.add(pattern)
            except SchemaRefused:
                return None
        compiled = self._regexes[pattern]
        return None if compiled is None else compiled.search(text) is not None
