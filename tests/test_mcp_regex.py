"""A server's regexes cost bounded GIL holds: RE2 keeps the GIL while it compiles a pattern
(393-504 ms for one 5,000-range character class repeated 100 times), so a pattern is compiled
once, when its tool is listed (on a worker thread), under a length cap and a small RE2 memory
budget, and a check only matches. A check over many patterns stops at its budget inside the
loop over them, and a closed server's queued checks never start.

What is bounded is CPU time, as in tests/test_mcp_costly.py: the thread CPU time of every RE2
compile and match (each one C call, timed on the thread that runs it), under `STALL_LIMIT`.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import re2  # type: ignore[import-untyped]

pytest.importorskip("mcp")

from loop_watch import STALL_LIMIT, beside_bystanders, quiet_transcripts
from mcp_helpers import GUARD_SECONDS, server_children, tool_pass
from treadle.errors import MCPSchemaError
from treadle.mcp import MCPServer
from treadle.mcp.checks import CheckThreads
from treadle.mcp.regex import MAX_LISTED_COMPILE_SECONDS, MAX_PATTERN_CLASSES, Patterns
from treadle.mcp.schema import (
    MAX_LISTED_PATTERN_CHARACTERS,
    MAX_SCHEMA_PATTERN,
    BudgetExceeded,
    SchemaRefused,
    compile_schema,
)

RAW_SERVER = str(Path(__file__).with_name("mcp_raw_server.py"))


def _ranges(n: int, start: int = 0) -> str:
    """A character class of `n` one-character ranges (RE2 compiles each as its own range)."""
    return "[" + "".join(chr(0x100 + start + 2 * i) for i in range(n)) + "]"


# The attack's pattern: 5,016 characters, 400-650 ms of GIL-held compile before.
BIG = "^(?:" + _ranges(5000) + "{10}){10}$"


class _TimedRegex:
    def __init__(self, real: Any, held: list[float]) -> None:
        self._real, self._held = real, held

    def search(self, text: str) -> Any:
        start = time.thread_time()
        try:
            return self._real.search(text)
        finally:
            self._held.append(time.thread_time() - start)


@pytest.fixture
def re2_hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The thread CPU time of every RE2 compile and match the schema checks make (each one C
    call, timed on the thread that runs it)."""
    held: list[float] = []
    real: Callable[..., Any] = re2.compile

    def compile(pattern: str, options: Any = None) -> Any:
        start = time.thread_time()
        try:
            return _TimedRegex(real(pattern, options), held)
        finally:
            held.append(time.thread_time() - start)

    monkeypatch.setattr(
        "treadle.mcp.regex.re2",
        type(
            "re2",
            (),
            {
                "compile": staticmethod(compile),
                "error": re2.error,
                "Options": re2.Options,
            },
        ),
    )
    yield held
    if held:
        print(f"longest RE2 call {max(held) * 1000:.1f} ms of thread CPU")


@pytest.fixture(scope="module")
def quiet() -> list[list[dict[str, Any]]]:
    warm = MCPServer.stdio(sys.executable, [RAW_SERVER], stderr=subprocess.DEVNULL)
    try:
        tool_pass(warm, "go", {"kind": "x"})
    finally:
        warm.close()
    return quiet_transcripts()


def test_a_pattern_over_the_cap_is_refused_when_listed_naming_tool_and_server(
    quiet: list[list[dict[str, Any]]], re2_hold: list[float]
) -> None:
    server = MCPServer.stdio(
        sys.executable, [RAW_SERVER, "--pattern", BIG], stderr=subprocess.DEVNULL
    )

    def listed() -> str:
        with pytest.raises(MCPSchemaError) as refused:
            server.tools()
        return str(refused.value)

    try:
        error, stall = beside_bystanders(listed, quiet)
        assert "'go'" in error and server.label in error, error
        assert f"{MAX_SCHEMA_PATTERN:,}-character limit" in error, error
        assert max(re2_hold, default=0.0) < STALL_LIMIT
        assert stall.cpu < STALL_LIMIT, stall
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


@pytest.mark.parametrize(
    "pattern",
    [
        # at the cap, each worst for RE2 in its own way: a big program, a long parse
        "^(?:" + _ranges(MAX_SCHEMA_PATTERN - 16) + "{10}){10}$",
        "^(?:" + "|".join(f"[\\w.]{{{i % 50 + 1}}}" for i in range(90)) + ")$",
        "(?:[\\w\\d.,;]{10}){100}" * (MAX_SCHEMA_PATTERN // 24),
    ],
)
def test_a_pattern_at_the_cap_compiles_or_is_refused_in_a_short_hold(
    pattern: str, re2_hold: list[float]
) -> None:
    assert len(pattern) <= MAX_SCHEMA_PATTERN
    try:
        compile_schema({"type": "string", "pattern": pattern})
    except SchemaRefused as error:
        assert "too large" in str(error), error
    assert re2_hold and max(re2_hold) < STALL_LIMIT / 2, re2_hold


def test_a_pattern_compiles_once_when_listed_never_in_a_check(
    re2_hold: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled = compile_schema(
        {
            "type": "object",
            "properties": {"s": {"type": "string", "pattern": "^a+$"}},
            "patternProperties": {"^x_": {"type": "integer"}, "^y_": {}},
            "additionalProperties": False,
        }
    )
    assert len(re2_hold) == 3

    def compile(pattern: str, options: Any = None) -> Any:
        raise AssertionError(f"{pattern!r} compiled in a check")

    monkeypatch.setattr("treadle.mcp.regex.re2.compile", compile)
    for _ in range(3):
        (error,) = compiled.errors({"s": "aa", "x_1": 1, "y_2": 0, "z": 1}, 2.0)
        assert "'z' was unexpected" in error.message, error.message


def test_a_listing_with_too_many_pattern_characters_is_refused() -> None:
    patterns: dict[str, Any] = {
        f"^p{i}_" + "a" * (MAX_SCHEMA_PATTERN - 10): {}
        for i in range(MAX_LISTED_PATTERN_CHARACTERS // (MAX_SCHEMA_PATTERN - 10) + 1)
    }
    with pytest.raises(SchemaRefused, match=f"{MAX_LISTED_PATTERN_CHARACTERS:,}"):
        compile_schema({"type": "object", "patternProperties": patterns})


def test_a_check_over_many_patterns_stops_at_its_budget_inside_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # each keyword checked the deadline once; one over 200 patterns x 2,000 keys ran on
    compiled = compile_schema(
        {"type": "object", "patternProperties": {f"^p{i}_$": {} for i in range(200)}}
    )
    clock = [0.0]

    def tick() -> float:  # a clock one millisecond on at every look
        clock[0] += 0.001
        return clock[0]

    monkeypatch.setattr("treadle.mcp.schema.time", SimpleNamespace(monotonic=tick))
    with pytest.raises(BudgetExceeded):
        compiled.errors({f"k{i}": 0 for i in range(2000)}, 0.5)
    assert clock[0] < 1.0  # stopped soon after the deadline, not after 400,000 matches


def test_a_closed_servers_queued_checks_never_start() -> None:
    threads = CheckThreads("test", size=1)
    gate, started = threading.Event(), threading.Event()
    ran: list[int] = []

    def first_check() -> bool:
        started.set()
        return gate.wait()

    first = threads.submit(first_check)
    assert started.wait(5)
    queued = [threads.submit(functools.partial(ran.append, i)) for i in range(5)]
    threads.drop_queued()
    gate.set()
    assert first.result(5) is True
    for future in queued:
        with pytest.raises(CancelledError):
            future.result(5)
    assert ran == []
    assert threads.submit(lambda: 7).result(5) == 7  # a reopened server's checks run


# 16 Unicode classes among the slowest for RE2 to build that it still compiles (about 7 ms,
# quiet): 100 distinct patterns of them, each under every cap, add up to 0.7 s of compiles.
SLOW_CLASSES = "(?i)" + "\\PL*" * MAX_PATTERN_CLASSES


def test_a_pattern_of_many_unicode_classes_is_refused_before_it_compiles(
    re2_hold: list[float],
) -> None:
    # 140 of `(?i)\PL` in 1,000 characters held the GIL 40 ms for a pattern refused after
    with pytest.raises(SchemaRefused, match="Unicode classes"):
        compile_schema({"type": "string", "pattern": "(?i)" + "\\PL" * 140})
    with pytest.raises(SchemaRefused, match="Unicode classes"):
        compile_schema({"type": "string", "pattern": "[\\pL\\pN]" * (MAX_PATTERN_CLASSES // 2 + 1)})
    assert re2_hold == []  # refused before RE2 saw it
    # an escaped backslash before `p` is no class, and up to the cap RE2 compiles them
    compile_schema({"type": "string", "pattern": "\\\\p" * 100})
    Patterns().add(SLOW_CLASSES)
    assert len(re2_hold) == 2 and max(re2_hold) < STALL_LIMIT / 2, re2_hold


def test_a_listings_compiles_are_bounded_in_cpu(
    quiet: list[list[dict[str, Any]]], re2_hold: list[float]
) -> None:
    # 100 distinct patterns of 994 characters each took 2,170 ms of compile CPU, the loop
    # stalled 165 ms: now the tool is refused once its listing's compiles pass the budget
    server = MCPServer.stdio(
        sys.executable,
        [RAW_SERVER, "--pattern", SLOW_CLASSES, "--patterns", "100"],
        stderr=subprocess.DEVNULL,
    )

    def listed() -> str:
        with pytest.raises(MCPSchemaError) as refused:
            server.tools()
        return str(refused.value)

    try:
        error, stall = beside_bystanders(listed, quiet)
        assert "'go'" in error and server.label in error, error
        assert "ms of CPU to compile" in error, error
        assert 0 < sum(re2_hold) <= MAX_LISTED_COMPILE_SECONDS + max(re2_hold), re2_hold
        assert len(re2_hold) < 100
        assert stall.cpu < STALL_LIMIT, stall
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}
