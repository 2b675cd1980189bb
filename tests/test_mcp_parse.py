"""The collector pause, the UTF-8 reading, the exponent count, the cost estimate and the slimming
of an MCP message (treadle.mcp.parse, stdio._parse).

The pause must leave a program's own collector choices as it made them, and a process forked
while a parse runs must get its collector back: the thread that would end the pause is not
copied into the child.
"""

from __future__ import annotations

import base64
import gc
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

import json

from mcp.shared.message import SessionMessage

from mcp_helpers import tool_pass
from treadle.mcp import MCPServer
from treadle.mcp.parse import (
    MAX_MESSAGE_CONTAINERS,
    MAX_MESSAGE_COST_NS,
    MAX_MESSAGE_EXPONENTS,
    SLIM_TEXT,
    collector_paused,
    containers,
    cost,
    exponents,
    slim,
)
from treadle.mcp.stdio import PARSE_OFF_LOOP_BYTES, MalformedMessage, _parse

RAW_SERVER = str(Path(__file__).with_name("mcp_raw_server.py"))


def _collects() -> bool:
    # automatic collection runs when it is enabled and its first threshold is not zero
    return gc.isenabled() and gc.get_threshold()[0] > 0


def test_the_pause_stops_automatic_collection_and_ends() -> None:
    before = gc.get_threshold()
    with collector_paused():
        assert not _collects()
        with collector_paused():
            assert not _collects()
        assert not _collects()
    assert gc.get_threshold() == before and _collects()


def test_a_programs_own_gc_disable_during_a_parse_stands() -> None:
    entered, leave = threading.Event(), threading.Event()

    def parse() -> None:
        with collector_paused():
            entered.set()
            leave.wait(10)

    worker = threading.Thread(target=parse)
    worker.start()
    try:
        assert entered.wait(10)
        gc.disable()  # the program's own choice, while the parse runs
        leave.set()
        worker.join(10)
        assert not gc.isenabled()
    finally:
        leave.set()
        gc.enable()
    assert _collects()


def test_a_programs_own_thresholds_set_during_a_parse_stand() -> None:
    before = gc.get_threshold()
    try:
        with collector_paused():
            gc.set_threshold(5000, 20, 20)
        assert gc.get_threshold() == (5000, 20, 20)
    finally:
        gc.set_threshold(*before)


def test_a_child_forked_during_a_parse_gets_its_collector_back() -> None:
    entered, leave = threading.Event(), threading.Event()

    def parse() -> None:
        with collector_paused():
            entered.set()
            leave.wait(10)

    before = gc.get_threshold()
    worker = threading.Thread(target=parse)
    worker.start()
    try:
        assert entered.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: the parsing thread was not copied
            with collector_paused():
                pass
            os._exit(0 if _collects() and gc.get_threshold() == before else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert not _collects()  # the parent's parse still runs
    finally:
        leave.set()
        worker.join(10)
    assert gc.get_threshold() == before


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16", "utf-32"])
def test_a_message_that_is_not_utf8_is_malformed_before_it_is_counted(encoding: str) -> None:
    # U+2200 is the bytes 00 22 in UTF-16-LE: a quote byte to the counter, which would then take
    # every real bracket after it for text; the parser must read the same UTF-8 text instead.
    unit = "[" * 40 + "]" * 40
    head = '{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"\u2200"}],"x":['
    text = head + ",".join([unit] * (MAX_MESSAGE_CONTAINERS // 40 + 100)) + "]}}"
    line = text.encode(encoding)
    assert len(line) > PARSE_OFF_LOOP_BYTES
    if encoding == "utf-16-le":
        assert containers(line) < MAX_MESSAGE_CONTAINERS  # what the counter alone would say
    assert isinstance(_parse(line, "srv"), MalformedMessage)
    small = b'{"jsonrpc":"2.0","id":1,"result":{}}'.decode().encode(encoding)
    assert isinstance(_parse(small, "srv"), MalformedMessage)


def test_exponents_count_numbers_outside_strings_only() -> None:
    # 2E5 is a cheap exponent, and the 1e-400 in a string no number
    assert exponents(b'[1e-400, 2E5, true, false, null, "e\\"1e-400", 1.5]', limit=0) == 1
    # text rich in `e`s (and `true`s) is not a message of slow numbers
    text = "the tree here is free, true " * (MAX_MESSAGE_EXPONENTS // 2)
    line = json.dumps({"content": [{"type": "text", "text": text}], "ok": [True] * 50_000})
    assert line.count("e") > MAX_MESSAGE_EXPONENTS
    assert exponents(line.encode()) == 0


def test_a_large_notification_over_the_exponent_budget_is_refused() -> None:
    numbers = ",".join(["1e-400"] * (MAX_MESSAGE_EXPONENTS + 1))
    line = ('{"jsonrpc":"2.0","id":1,"result":{"x":[' + numbers + "]}}").encode()
    fault = _parse(line, "peer")
    assert "numbers with a large exponent" in str(fault) and "peer" in str(fault)


def test_slim_keeps_what_treadle_reads_of_a_notification() -> None:
    note = {
        "jsonrpc": "2.0",
        "method": "notifications/message",
        "params": {"_meta": {"a": 1}, "level": "info", "data": ["x"] * 5, "logger": "y" * 5000},
    }
    assert slim(note)["params"] == {
        "level": "info",
        "data": "[list of 5 items, dropped by Treadle]",
        "logger": "y" * SLIM_TEXT + "…",
    }
    reply = {"jsonrpc": "2.0", "id": 1, "result": {"_meta": {"a": [1]}}}
    assert slim(dict(reply)) == reply  # a response is not touched
    line = json.dumps(
        {
            "jsonrpc": "2.0",
            "method": "notifications/tools/list_changed",
            "params": {"_meta": {"x": [[1]] * 40_000}},
        }
    ).encode()
    assert len(line) > PARSE_OFF_LOOP_BYTES
    message = _parse(line, "peer")
    assert message.message.params == {}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("method", "declined"),
    [("sampling/createMessage", "Sampling not supported"), ("elicitation/create", "Elicitation")],
)
def test_a_large_server_request_is_declined_as_a_small_one_is(method: str, declined: str) -> None:
    # slimmed, its params no longer typed (-32602 "Invalid request parameters") before
    server = MCPServer.stdio(sys.executable, [RAW_SERVER], stderr=subprocess.DEVNULL)
    try:
        replies = [
            tool_pass(server, "go", {"kind": "ask", "method": method, "pad": pad})
            for pad in (10, 70_000)
        ]
    finally:
        server.close()
    assert all(reply["ok"] for reply in replies), replies
    small, large = (json.loads(reply["content"]) for reply in replies)
    assert small["code"] == -32600 and declined in small["message"], small
    assert large == small


def test_only_costly_exponents_are_counted() -> None:
    # `strtod` is quick for a small exponent (1.5e-05: 150 ns, as 1.5 is 90) and slow from a
    # magnitude of 23 on (1e-99: 380 ns, 1e-400: 1,050 ns)
    line = b'[1.5e-05, 2E5, 1e-22, 1E+022, 1e-400, 1e-23, 1E+300, 5e0099, "1e-400", true]'
    assert exponents(line, limit=0) == 4


def test_many_cheap_exponents_are_parsed_and_the_server_kept() -> None:
    # 30,000 values like 1.5e-05 parse in 4 ms; they were refused and the server restarted
    server = MCPServer.stdio(sys.executable, [RAW_SERVER], stderr=subprocess.DEVNULL)
    try:
        body = tool_pass(server, "go", {"kind": "floats", "n": 30_000, "form": "1.5e-05"})
        assert body["ok"] is True, body
        assert server.restarts == 0
    finally:
        server.close()


def _reply(result: dict[str, Any]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "result": result}).encode()


def test_the_cost_estimate_adds_up_the_shapes() -> None:
    body = ",".join(["[[[]]]"] * 66_600 + ["1e-400"] * 24_990 + ["9" * 4000] * 95)
    line = b'{"x":[' + body.encode() + b"]}"
    assert containers(line) < MAX_MESSAGE_CONTAINERS and exponents(line) < MAX_MESSAGE_EXPONENTS
    assert cost(line) > MAX_MESSAGE_COST_NS
    # a long integer costs by its digits squared; digits in a string or a float do not
    assert cost(b"[" + b"9" * 4000 + b"]") > 90_000
    assert cost(b'["' + b"9" * 4000 + b'"]', budget=0) < 1000
    assert cost(b"[0." + b"9" * 4000 + b"]") < 1000


@pytest.mark.parametrize("kind", ["screenshot", "floats", "english", "json_text"])
def test_cheap_legit_data_is_within_the_cost_budget(kind: str) -> None:
    if kind == "screenshot":
        data = base64.b64encode(os.urandom(780_000)).decode()
        line = _reply({"content": [{"type": "image", "data": data, "mimeType": "image/png"}]})
    elif kind == "floats":
        values = b",".join([b"1.5e-05"] * 30_000)
        head = b'{"jsonrpc":"2.0","id":1,"result":{"content":[],"structuredContent":{"x":['
        line = head + values + b"]}}}"
    else:
        text = (
            "The quick brown fox, aged 1234567, jumps: see e.g. 1e-400 (ages 33-55). " * 14_000
            if kind == "english"
            else json.dumps([{"k": j % 10, "v": 1e-300} for j in range(40_000)])
        )
        line = _reply({"content": [{"type": "text", "text": text}]})
    assert len(line) > 900_000 or kind == "floats"
    assert cost(line) <= MAX_MESSAGE_COST_NS
    assert isinstance(_parse(line, "x"), SessionMessage)


@pytest.mark.parametrize(
    "head",
    [
        '"\\true",',  # \t an escape: taking `true` out left `\"`, and the rest read as a string
        '"\\false",',
        '"\\\\true\\"",',  # an escaped backslash, then `true`, then an escaped quote
        '"a\\\\\\true",',  # \\ then \t
        '{"\\nnull\\true": "\\\\"},',
        'true, "\\"true\\"", false,',
    ],
)
def test_escapes_next_to_true_and_false_never_move_string_boundaries(head: str) -> None:
    # 149,000 `1e-400` behind `"\true",` were all read as inside a string: parsed, 112 ms/MiB
    n = MAX_MESSAGE_EXPONENTS + 10
    line = ("[" + head + ",".join(["1e-400"] * n) + "]").encode()
    json.loads(line)  # valid JSON
    pieces = len(line) // (64 * 1024) + 1  # an exponent cut by a piece's end may be missed
    assert n - pieces <= exponents(line) <= n
    assert cost(line) >= (n - pieces) * 900
    fault = _parse(line, "peer")
    assert "numbers with a large exponent" in str(fault) and "peer" in str(fault)


def test_escapes_across_piece_boundaries_are_read_as_json_reads_them() -> None:
    # strings of escapes placed so one ends, or its escape is cut, at each 64 KiB piece's end
    n = MAX_MESSAGE_EXPONENTS + 10
    for shift in range(6):
        pad = "x" * (64 * 1024 - 3 - shift)
        head = '["' + pad + '\\true\\\\",'
        line = (head + ",".join(["1e-400"] * n) + "]").encode()
        json.loads(line)
        # one cut by a piece's end may be missed (at most one a piece), never a string's worth
        assert n - len(line) // (64 * 1024) - 1 <= exponents(line) <= n, shift
        # and 1e-400s inside a string stay uncounted
        inside = ('["' + pad + "\\true" + " 1e-400" * n + '"]').encode()
        json.loads(inside)
        assert exponents(inside) == 0, shift


@pytest.mark.parametrize("method", [["sampling/createMessage"], {"a": 1}, 7, None])
def test_a_large_message_whose_method_is_no_string_is_not_json_rpc(method: Any) -> None:
    # a list or dict `method` raised TypeError (unhashable) in `slim`, ending the connection
    line = json.dumps(
        {"jsonrpc": "2.0", "id": 5, "method": method, "params": {"p": "x" * 70_000}}
    ).encode()
    small = json.dumps({"jsonrpc": "2.0", "id": 5, "method": method, "params": {}}).encode()
    assert len(line) > PARSE_OFF_LOOP_BYTES
    assert isinstance(_parse(small, "peer"), MalformedMessage)
    assert isinstance(_parse(line, "peer"), MalformedMessage)
