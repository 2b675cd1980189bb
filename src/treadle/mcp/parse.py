"""How much parsing one MCP message may cost: its JSON containers counted before it is parsed.

`json.loads` is one C call that holds the GIL for the whole message, so its cost is a stall of
every other thread, the runtime loop's included. That cost is not the message's size but the
objects it makes: a string of a megabyte is one object and parses in a millisecond, while just
under 1 MiB of `[[[]]],[[[]]],...` is 450,000 lists, held the GIL 147 to 240 ms in one call (the
garbage collector, set off again and again by the new lists, took most of it) and kept every
later full collection of the process 40 to 70 ms long while they lived. So before a large
message is parsed, its arrays and objects are counted (`containers`: a few linear byte scans in
C, each bounded), and a message with more than `MAX_MESSAGE_CONTAINERS` is refused unparsed; the
others are parsed with the collector paused (`collector_paused`), which it would only have run
over the message's own new objects. Every message is read as UTF-8 text first (MCP's encoding):
`json.loads` would take UTF-16 or UTF-32 bytes too, which the count cannot read. Text and
images are a handful of containers whatever their size; 1 MiB of text blocks is 39,000, and
1 MiB of small structured entries 131,000.

This module must never hold the GIL for long itself: every C call in it is over a bounded piece.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["MAX_MESSAGE_CONTAINERS", "collector_paused", "containers"]

#: Arrays and objects one message may hold (counted outside its strings): more is refused as
#: the connection's fault, like a message over the size cap (docs/mcp.md, "A server is a peer").
MAX_MESSAGE_CONTAINERS = 200_000
# Bytes scanned per C call when brackets inside strings have to be told apart.
_PIECE = 64 * 1024


def containers(line: bytes, limit: int = MAX_MESSAGE_CONTAINERS) -> int:
    """The arrays and objects in JSON text `line`: exact when it matters (over `limit` by a
    rough count that includes brackets inside strings), else that upper bound."""
    rough = line.count(b"[") + line.count(b"{")
    if rough <= limit or b'"' not in line:
        return rough
    # Escapes out of the way (pairs of backslashes first, as JSON reads them left to right), so
    # every quote left opens or closes a string; then count outside the strings only.
    clean = line.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    inside = False
    count = 0
    for start in range(0, len(clean), _PIECE):
        parts = clean[start : start + _PIECE].split(b'"')
        outside = parts[1::2] if inside else parts[0::2]
        count += sum(part.count(b"[") + part.count(b"{") for part in outside)
        inside ^= (len(parts) - 1) % 2 == 1
    return count


_lock = threading.Lock()
_pausing = 0
# The collection thresholds before the first of the open pauses, when they were changed for it.
_saved: tuple[int, int, int] | None = None


def _pause() -> None:
    global _saved, _pausing
    with _lock:
        if _pausing == 0:
            first, second, third = gc.get_threshold()
            if first:
                _saved = (first, second, third)
                gc.set_threshold(0, second, third)
        _pausing += 1


def _restore() -> None:
    # Back to the program's thresholds unless the program set its own meanwhile: then its
    # choice stands.
    global _saved
    if _saved is not None and gc.get_threshold() == (0, *_saved[1:]):
        gc.set_threshold(*_saved)
    _saved = None


def _resume() -> None:
    global _pausing
    with _lock:
        _pausing -= 1
        if _pausing == 0:
            _restore()


def _forked() -> None:
    # A child forked during a parse inherits the pause, but not the thread that would end it:
    # without this its collector would stay off for good. Its lock may have been held by that
    # thread, so it gets a new one.
    global _lock, _pausing
    _lock = threading.Lock()
    _pausing = 0
    _restore()


os.register_at_fork(after_in_child=_forked)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Automatic garbage collection off while the block runs (on any thread; nested and
    concurrent blocks share one pause), then back to the thresholds of before the first of them.

    The pause sets the first collection threshold to zero and never calls `gc.disable`, so a
    program's own `gc.disable()` or `gc.enable()` meanwhile is left as it made it, and so is a
    `gc.set_threshold` of its own; a process forked during a pause gets the collector back."""
    _pause()
    try:
        yield
    finally:
        _resume()
