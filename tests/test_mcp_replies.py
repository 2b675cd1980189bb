"""Replies whose cost is in free-form JSON (`_meta`, `structuredContent`) are typed off the
runtime loop without walking that JSON in one pydantic call, and a reply line that cannot be
read at all fails the waiting call at once instead of leaving it to its timeout.

What is asserted is which thread did the work and how much each call was handed, never how long
anything took (the machine is shared).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from mcp_helpers import GUARD_SECONDS
from treadle.errors import MCPServerError
from treadle.mcp import MCPServer
from treadle.mcp import listing as listing_module
from treadle.mcp import stdio as stdio_module
from treadle.runtime import get_runtime

RAW_SERVER = str(Path(__file__).with_name("mcp_raw_server.py"))


def _size(value: Any) -> int:
    """How many list items and dict entries `value` holds, at any depth."""
    if isinstance(value, dict):
        return len(value) + sum(_size(v) for v in value.values())
    if isinstance(value, list):
        return len(value) + sum(_size(v) for v in value)
    return 0


@pytest.mark.parametrize("field", ["meta", "structured"])
def test_free_form_json_is_typed_off_the_loop_and_never_walked_whole(
    monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    typed_on_loop: list[bool] = []
    real_typed = listing_module._typed

    def watched_typing(*args: Any) -> Any:
        typed_on_loop.append(get_runtime().in_loop_thread())
        return real_typed(*args)

    checked: list[int] = []
    real_check = listing_module.result_rows.validate_server_result

    def watched_check(method: str, version: str, result: Any) -> Any:
        checked.append(_size(result))  # how much one (GIL-holding) check was given
        return real_check(method, version, result)

    monkeypatch.setattr(listing_module, "_typed", watched_typing)
    monkeypatch.setattr(listing_module.result_rows, "validate_server_result", watched_check)
    server = MCPServer.stdio(sys.executable, [RAW_SERVER], stderr=subprocess.DEVNULL)
    try:
        result = get_runtime().run(
            server.call("go", {"kind": field, "n": 20_000}), timeout=GUARD_SECONDS
        )
    finally:
        server.close()
    extra = result.meta if field == "meta" else result.structured_content
    assert extra is not None and len(extra["blob"]) == 20_000  # handed over whole, untouched
    assert extra["blob"][-1] == {"k": 19_999}
    assert typed_on_loop == [False]
    assert checked and max(checked) < 100  # the 40,000 entries were never checked in one go


def test_a_large_line_is_parsed_by_json_then_only_its_envelope_typed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    validated: list[int] = []
    adapter = stdio_module.types.jsonrpc_message_adapter
    real = adapter.validate_python

    class Watched:
        def validate_python(self, data: Any, **kwargs: Any) -> Any:
            result = data.get("result") if isinstance(data, dict) else None
            validated.append(len(result.get("_meta", {}).get("blob", [])) if result else 0)
            return real(data, **kwargs)

    monkeypatch.setattr(stdio_module.types, "jsonrpc_message_adapter", Watched())
    line = (
        b'{"jsonrpc":"2.0","id":1,"result":{"content":[],"_meta":{"blob":['
        + b",".join(b'{"k":%d}' % j for j in range(10_000))
        + b"]}}}"
    )
    message = stdio_module._parse(line, "demo")
    assert not isinstance(message, Exception)
    result = message.message.result  # type: ignore[union-attr]
    assert type(result["_meta"]["blob"][0]) is dict  # plain JSON, not a model
    assert validated == [10_000]


def test_a_reply_nested_too_deeply_fails_the_call_at_once() -> None:
    # The call's timeout is long: the error must come from the line, not from waiting.
    server = MCPServer.stdio(sys.executable, [RAW_SERVER], stderr=subprocess.DEVNULL, timeout=3600)
    try:
        with pytest.raises(MCPServerError, match=r"not a JSON-RPC message.*nested too deeply"):
            # A hang would end in the guard's TimeoutError, not this error.
            get_runtime().run(
                server.call("go", {"kind": "deep", "n": 5_000}), timeout=GUARD_SECONDS
            )
        # The connection starts again for the next call.
        again = get_runtime().run(server.call("go", {}), timeout=GUARD_SECONDS)
        assert again.content[0].text == "ok"  # type: ignore[union-attr]
    finally:
        server.close()


def test_a_line_that_is_not_json_rpc_is_a_fault_naming_the_server() -> None:
    for line in (b"not json", b'{"jsonrpc":"2.0","id":{}}', b"[" * 5_000):
        fault = stdio_module._parse(line, "demo")
        assert isinstance(fault, stdio_module.MalformedMessage)
        assert "MCP server demo sent a line that is not a JSON-RPC message" in str(fault)
