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
over the message's own new objects. Numbers are objects too, mostly cheap, but one with an
exponent (`1e-400`) takes `strtod` up to a microsecond: a message may hold at most
`MAX_MESSAGE_EXPONENTS` of them (`exponents`, counted as the containers are). A large
notification or server request, once parsed, is `slim`med to what Treadle reads of it, since
the SDK types its params on the loop. Every message is read as UTF-8 text first (MCP's encoding):
`json.loads` would take UTF-16 or UTF-32 bytes too, which the count cannot read. Text and
images are a handful of containers whatever their size; 1 MiB of text blocks is 39,000, and
1 MiB of small structured entries 131,000.

This module must never hold the GIL for long itself: every C call in it is over a bounded piece.
"""

from __future__ import annotations

import gc
import itertools
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "MAX_MESSAGE_CONTAINERS",
    "MAX_MESSAGE_COST_NS",
    "MAX_MESSAGE_EXPONENTS",
    "SLIM_TEXT",
    "collector_paused",
    "containers",
    "cost",
    "exponents",
    "slim",
]

#: Arrays and objects one message may hold (counted outside its strings): more is refused as
#: the connection's fault, like a message over the size cap (docs/mcp.md, "A server is a peer").
MAX_MESSAGE_CONTAINERS = 200_000
#: Numbers with a costly exponent (magnitude 23 or more) one message may hold (outside strings):
#: `json.loads` turns each into a float through `strtod`, up to a microsecond apiece for one like
#: `1e-400` (1 MiB of those, 150,000, held the GIL 107 to 164 ms); a small exponent (`1.5e-05`)
#: costs what a plain decimal does, and is not counted.
MAX_MESSAGE_EXPONENTS = 25_000
#: What `json.loads` may be estimated to spend on one message (`cost`, in nanoseconds of CPU on a
#: quiet machine; about twice that under load): the budgets above are separate, and one message
#: just under each of them (and 95 integers of 4,000 digits) held it 91 to 121 ms.
MAX_MESSAGE_COST_NS = 45_000_000
# The weights of `cost`, measured (`json.loads` with the collector paused, best of 7, quiet):
# a value after a `,` or `:` (a plain `1`: 81 ns; a key or short string less), an array or
# object on top of that (98 ns), a costly exponent on top of that (`1e-400`: 860 ns), and an
# integer of d digits, at least `_LONG_DIGITS`, about d² x 0.005 ns (CPython converts decimal
# digits in quadratic time: 4,000 digits took 79 µs, 1,000 took 6.7 µs, 300 took 1.1 µs).
_NS_PER_VALUE = 80
_NS_PER_CONTAINER = 150
_NS_PER_EXPONENT = 900
_PS_PER_DIGIT_SQUARED = 6
# Digit runs shorter than this are not counted: they cost about a plain value per byte or less.
_LONG_DIGITS = 300
# Past this many digits `int()` refuses a number before converting it (Python's digit limit).
_MAX_DIGITS = 4300
# Digits as `0`, what ends or continues a float as itself, everything else as a space: a long
# integer is then a run of `0`s not after a `.` and not before a `.`, `e` or `E`.
_DIGITS_ONLY = bytes(
    ord("0") if chr(b).isdigit() and b < 128 else b if b in b".eE" else ord(" ") for b in range(256)
)
_LONG_RUN = b"0" * _LONG_DIGITS
_ZEROS = re.compile(rb"0*")
#: Characters kept of a string in the params of a large notification or server request.
SLIM_TEXT = 1000
# Params fields kept of such a message.
_SLIM_FIELDS = 32
# An exponent of a magnitude of 23 or more (leading zeros aside), where `strtod` gets slow. Ours,
# linear: it never backtracks past one exponent.
_COSTLY_EXPONENT = re.compile(rb"[eE][+-]?0*(?:[1-9][0-9]{2,}|[3-9][0-9]|2[3-9])")
# Bytes scanned per C call when brackets inside strings have to be told apart.
_PIECE = 64 * 1024


def containers(line: bytes, limit: int = MAX_MESSAGE_CONTAINERS) -> int:
    """The arrays and objects in JSON text `line`: exact when it matters (over `limit` by a
    rough count that includes brackets inside strings), else that upper bound."""
    rough = line.count(b"[") + line.count(b"{")
    if rough <= limit or b'"' not in line:
        return rough
    return _outside_strings(line, lambda part: part.count(b"[") + part.count(b"{"))


def exponents(line: bytes, limit: int = MAX_MESSAGE_EXPONENTS) -> int:
    """The numbers with a costly exponent (a magnitude of 23 or more: `1e-400`, `1e-99`, not
    `1.5e-05`) in JSON text `line`: exact when it matters (over `limit` by a rough count of
    every `e` and `E`, in strings and `true` too), else that bound.

    Outside strings a JSON text has letters only in `true`, `false`, `null` and exponents, so
    the `e`s and `E`s there, once `true` and `false` are taken out, are the exponents; `strtod`
    is quick for a small one (150 ns for `1.5e-05`, 90 for `1.5`) and slow from 23 on, where
    its fast path ends (380 ns for `1e-99`, 1,050 for `1e-400`)."""
    rough = line.count(b"e") + line.count(b"E")
    if rough <= limit:
        return rough
    return _outside_strings(line, lambda part: len(_COSTLY_EXPONENT.findall(part)), words=True)


def cost(line: bytes, budget: int = MAX_MESSAGE_COST_NS) -> int:
    """What `json.loads` is estimated to spend on JSON text `line`, in nanoseconds of CPU on a
    quiet machine: its values, arrays and objects, costly exponents and long integers, each by
    its weight. Exact when it matters (over `budget` by a rough estimate that counts what is
    inside strings too, which a text of punctuation or digits would be), else that bound.

    Each count is a C call over at most the message (a millisecond per MiB) or a 64 KiB piece:
    the estimate is of the shapes that cost more than their bytes, while a message's plain
    strings cost 1 to 4 ms per MiB (at most 1 MiB, the default cap)."""
    rough = _rough_cost(line)
    if rough <= budget or b'"' not in line:
        return rough
    # `true` and `false` out, as `exponents` does, so the `e`s left outside strings are exponents
    return _outside_strings(line, _piece_cost, words=True)


def _rough_cost(line: bytes) -> int:
    # every `e` and `E` as a costly exponent: text rich in them takes the exact count
    values = line.count(b",") + line.count(b":")
    brackets = line.count(b"[") + line.count(b"{")
    letters = line.count(b"e") + line.count(b"E")
    return (
        values * _NS_PER_VALUE
        + brackets * _NS_PER_CONTAINER
        + letters * _NS_PER_EXPONENT
        + _digits_cost(line)
    )


def _piece_cost(part: bytes) -> int:
    values = part.count(b",") + part.count(b":")
    brackets = part.count(b"[") + part.count(b"{")
    exps = len(_COSTLY_EXPONENT.findall(part))
    return (
        values * _NS_PER_VALUE
        + brackets * _NS_PER_CONTAINER
        + exps * _NS_PER_EXPONENT
        + _digits_cost(part)
    )


def _digits_cost(text: bytes) -> int:
    """The quadratic cost of the integers of at least `_LONG_DIGITS` digits in `text`: one
    search when there are none, one step per long run (at most one per `_LONG_DIGITS` bytes)."""
    marked = text.translate(_DIGITS_ONLY)
    total = 0
    at = marked.find(_LONG_RUN)
    while at >= 0:
        run = _ZEROS.match(marked, at)
        end = run.end() if run else at
        after_point = at > 0 and marked[at - 1] == ord(".")
        if not after_point and marked[end : end + 1] not in (b".", b"e", b"E"):
            digits = min(end - at, _MAX_DIGITS)
            total += digits * digits * _PS_PER_DIGIT_SQUARED // 1000
        at = marked.find(_LONG_RUN, end)
    return total


def _outside_strings(line: bytes, count: Callable[[bytes], int], words: bool = False) -> int:
    """The sum of `count` over the parts of `line` outside its JSON strings, in bounded C calls
    (an exponent cut by a piece's end may be missed: at most one in 64 KiB); with `words`,
    `true` and `false` are taken out first, so the letters left outside strings are exponents."""
    # Escapes out of the way (pairs of backslashes first, as JSON reads them left to right), so
    # every quote left opens or closes a string; then count outside the strings only.
    clean = line.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    if words:
        # Only now, with no escape left that a removal could complete or break: in `"\true"`
        # the `\t` is an escape, and taking `true` out of the raw line left `\"`, an escaped
        # quote, so every later number read as inside a string. Removing bytes that hold no
        # quote from this line leaves every quote where it opens or closes a string.
        clean = clean.replace(b"true", b"").replace(b"false", b"")
    inside = False
    total = 0
    for start in range(0, len(clean), _PIECE):
        parts = clean[start : start + _PIECE].split(b'"')
        outside = parts[1::2] if inside else parts[0::2]
        total += sum(count(part) for part in outside)
        inside ^= (len(parts) - 1) % 2 == 1
    return total


# The server requests Treadle declines, each with the least params the SDK types it from (a
# slimmed one's markers fail its typing: -32602, where a small one gets the decline, -32600).
_DECLINED: dict[str, dict[str, Any]] = {
    "sampling/createMessage": {"messages": [], "maxTokens": 1},
    "elicitation/create": {"message": "", "requestedSchema": {"type": "object", "properties": {}}},
}


def slim(data: Any) -> Any:
    """A parsed JSON-RPC message with the params of a notification or server request cut down
    to what Treadle reads (a response is returned as it is).

    The SDK types a notification's params with pydantic on the runtime loop (198,000 lists in
    the `_meta` of one held it 465 to 731 ms), and Treadle needs none of a large one: it acts
    on `notifications/tools/list_changed` (no params), and declines a server's requests or
    answers them without their params (`ping`); a request it declines (sampling, elicitation)
    gets the least params its type needs, so it is declined as a small one is.
    So `_meta` and every array or object in the params are dropped (an object's or array's
    place keeps a short marker, which a field of any type accepts), strings are cut to
    `SLIM_TEXT` characters, and numbers, booleans and null stay."""
    if not isinstance(data, dict) or not isinstance(data.get("method"), str):
        return data  # a response, or no JSON-RPC message at all: the envelope's typing says so
    declined = _DECLINED.get(data["method"]) if "id" in data else None
    if declined is not None:  # typed as a small one is, so it gets the same decline
        data["params"] = dict(declined)
        return data
    params = data.get("params")
    if not isinstance(params, dict):
        if params is not None:
            data["params"] = {}
        return data
    kept: dict[str, Any] = {}
    for key, value in itertools.islice(params.items(), _SLIM_FIELDS):
        if key == "_meta" or not isinstance(key, str):
            continue
        if isinstance(value, str):
            kept[key] = value if len(value) <= SLIM_TEXT else value[:SLIM_TEXT] + "…"
        elif isinstance(value, dict | list):
            kept[key] = f"[{type(value).__name__} of {len(value):,} items, dropped by Treadle]"
        else:
            kept[key] = value
    data["params"] = kept
    return data


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
