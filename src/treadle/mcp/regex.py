"""The regexes of an MCP server's schemas on RE2, compiled once, when the tools are listed.

RE2 never backtracks (linear in the text), but it holds the GIL while it compiles a pattern,
for up to the size of the program it builds (one 5,000-range character class repeated 100 times:
400-650 ms) and for every Unicode class in it (`(?i)\\PL` 140 times in 1,000 characters: 40 ms,
refused only after). So a pattern is compiled when its tool is listed, on a worker thread, never
in a check; it may have at most `MAX_SCHEMA_PATTERN` characters and `MAX_PATTERN_CLASSES`
Unicode classes, and RE2 gets a 256 KiB memory budget, so a big program fails fast and is
refused (at the caps, up to 9 ms of thread CPU per compile on this shared machine; an
email or `^\\w{1,255}$` pattern needs under a millisecond); one listing may have at most
`MAX_LISTED_PATTERN_CHARACTERS` pattern characters in all, and its compiles at most
`MAX_LISTED_COMPILE_SECONDS` of thread CPU (100 distinct patterns of 994 characters took 2.2 s).
This module must never run Python's `re` on a server's pattern.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import re2  # type: ignore[import-untyped]

__all__ = [
    "MAX_LISTED_COMPILE_SECONDS",
    "MAX_LISTED_PATTERN_CHARACTERS",
    "MAX_PATTERN_CHARACTERS",
    "MAX_PATTERN_CLASSES",
    "MAX_SCHEMA_PATTERN",
    "ListingStopped",
    "Patterns",
    "SchemaRefused",
]

#: The longest string matched against a schema's `pattern` (a longer one is a validation error;
#: a longer property name counts as matching, for the server to decide).
MAX_PATTERN_CHARACTERS = 100_000
#: The longest `pattern` (or `patternProperties` key) a schema may have: RE2 holds the GIL while it
#: compiles one (up to 9 ms of thread CPU at this length with the caps below, measured).
MAX_SCHEMA_PATTERN = 1000
#: The most Unicode classes (`\pL`, `\P{Greek}`) one pattern may have: RE2 builds each one's
#: ranges whatever its memory budget, up to 0.3 ms apiece (`(?i)\PL`), and 140 of them in 1,000
#: characters held the GIL 40 ms for a pattern refused after.
MAX_PATTERN_CLASSES = 16
#: The most pattern characters (distinct patterns) the schemas of one listing may have in all.
MAX_LISTED_PATTERN_CHARACTERS = 100_000
#: The most thread CPU the compiles of one listing may take, in seconds (its tool is refused
#: past it): 100 distinct patterns of 994 characters, each under every cap, took 2.2 s and
#: stalled the runtime loop 165 ms; 1,000 distinct email or date patterns take 20 to 40 ms.
MAX_LISTED_COMPILE_SECONDS = 0.25
# 256 KiB: a big program is refused in about a millisecond (at 512 KiB, `[^a]{0,30}` 90 times
# compiled in 22 ms); an email, a date-time or `^\w{1,255}$` pattern needs far less.
_RE2_MAX_MEM = 256 << 10


class SchemaRefused(ValueError):
    """A tool's input schema cannot be used; the message says why."""


class ListingStopped(Exception):
    """The listing's compiles were stopped (its server was closed meanwhile)."""


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

    __slots__ = ("_chars", "_regexes", "_spent", "_stopped")

    def __init__(self, stopped: Callable[[], bool] | None = None) -> None:
        """`stopped`, when given, is asked before each compile: once it says True, no more
        compiles start (`ListingStopped` instead)."""
        self._regexes: dict[str, Any] = {}
        self._chars = 0
        self._spent = 0.0  # thread CPU of the compiles so far
        self._stopped = stopped

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
        # Escaped backslashes out first, so `\\p` (a backslash, then `p`) is no class; a `\p`
        # inside a bracket is one.
        unescaped = pattern.replace("\\\\", "")
        classes = unescaped.count("\\p") + unescaped.count("\\P")
        if classes > MAX_PATTERN_CLASSES:
            raise SchemaRefused(
                f"its pattern {pattern[:40]!r}... has {classes:,} Unicode classes, over the "
                f"limit of {MAX_PATTERN_CLASSES}"
            )
        if self._spent > MAX_LISTED_COMPILE_SECONDS:
            raise SchemaRefused(
                f"its patterns took over {MAX_LISTED_COMPILE_SECONDS * 1000:,.0f} ms of CPU to "
                "compile (with those of the tools listed before it)"
            )
        if self._stopped is not None and self._stopped():
            raise ListingStopped("the listing was stopped")
        start = time.thread_time()
        try:
            self._regexes[pattern] = re2.compile(pattern, _RE2_OPTIONS)
        except re2.error as error:
            if "too large" in str(error):
                raise SchemaRefused(
                    f"its pattern {pattern[:40]!r}... is too large for RE2 to compile in "
                    f"{_RE2_MAX_MEM >> 10} KiB"
                ) from None
            self._regexes[pattern] = None  # RE2 cannot express it: left to the server
        finally:
            # Counted on the thread that compiles: the GIL it held, whatever the machine's load.
            self._spent += time.thread_time() - start

    def matches(self, pattern: str, text: str) -> bool | None:
        """Whether `text` matches `pattern`; None when that is the server's to decide."""
        if len(text) > MAX_PATTERN_CHARACTERS:
            return None
        if pattern not in self._regexes:  # not found when listed: compiled now, capped as then
            try:
                self.add(pattern)
            except (SchemaRefused, ListingStopped):
                return None
        compiled = self._regexes[pattern]
        return None if compiled is None else compiled.search(text) is not None
