"""`run_tool_calls`: every error kind, result shapes and caps, concurrency, ordering, timeouts."""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.from_thread
import pydantic
import pytest

from treadle.errors import PathViolation, ToolError
from treadle.sandbox import Sandbox
from treadle.session import Session
from treadle.tools import MAX_TEXT_CHARS, BaseTool, ToolSet, run_tool_calls, tool


def call(name: str, arguments: Any = "{}", id: str | None = None) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "id": id or f"c-{name}",
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def body(outcome: Any) -> dict[str, Any]:
    return json.loads(outcome.content)  # type: ignore[no-any-return]


@tool
def echo(text: str = "") -> str:
    """Echo text."""
    return text


@tool
def boom() -> None:
    """Always fails."""
    raise ValueError("kaput")


@dataclasses.dataclass
class Stats:
    count: int
    label: str


class Reply(pydantic.BaseModel):
    answer: int


@tool
def as_mapping() -> dict[str, Any]:
    """A mapping result."""
    return {"answer": 42}


@tool
def as_dataclass() -> Stats:
    """A dataclass result."""
    return Stats(3, "x")


@tool
async def as_model() -> Reply:
    """A model result."""
    return Reply(answer=7)


async def test_success_shapes() -> None:
    tools = ToolSet.build([echo, as_mapping, as_dataclass, as_model])
    outs = await run_tool_calls(
        [call("echo", {"text": "hi"}), call("as_mapping"), call("as_dataclass"), call("as_model")],
        tools,
        session=None,
    )
    assert [o.ok for o in outs] == [True] * 4
    assert [body(o) for o in outs] == [
        {"ok": True, "result": "hi"},
        {"ok": True, "answer": 42},
        {"ok": True, "result": {"count": 3, "label": "x"}},
        {"ok": True, "result": {"answer": 7}},
    ]
    assert outs[0].tool_call_id == "c-echo" and outs[0].name == "echo"


@pytest.mark.parametrize("arguments", ["", "   ", "\n"])
async def test_empty_arguments_mean_empty_object(arguments: str) -> None:
    [out] = await run_tool_calls([call("echo", arguments)], ToolSet([echo]), session=None)
    assert body(out) == {"ok": True, "result": ""}


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ("[1, 2]", "must be a JSON object"),
        ('"text"', "must be a JSON object"),
        ('{"text": ', "not valid JSON"),
        ('{"text": "\\ud800"}', "not valid JSON"),  # a lone surrogate: no file could hold it
        ('{"text": "\ud800"}', "not valid JSON"),  # the same as a character, not an escape
        ('{"text": ' + "[" * 300 + "]" * 300 + "}", "not valid JSON"),  # too deep to parse
        ('{"text": "a"} trailing', "not valid JSON"),
        ('{"text": 5}', "text: Input should be a valid string"),
        ('{"nope": 1}', "nope: Extra inputs are not permitted"),
    ],
)
async def test_invalid_arguments(arguments: str, fragment: str) -> None:
    [out] = await run_tool_calls([call("echo", arguments)], ToolSet([echo]), session=None)
    assert (out.ok, out.error_kind) == (False, "invalid_tool_arguments")
    b = body(out)
    assert b["ok"] is False and b["error_kind"] == "invalid_tool_arguments"
    assert fragment in b["message"]


async def test_unknown_tool_and_call_order_preserved() -> None:
    outs = await run_tool_calls(
        [call("missing", id="1"), call("echo", {"text": "a"}, id="2"), call("boom", id="3")],
        ToolSet([echo, boom]),
        session=None,
    )
    assert [o.tool_call_id for o in outs] == ["1", "2", "3"]
    assert [o.error_kind for o in outs] == ["unknown_tool", None, "tool_execution_exception"]
    assert "there is no tool named 'missing'" in body(outs[0])["message"]
    assert "echo, boom" in body(outs[0])["message"]


async def test_exception_reports_message_and_capped_traceback() -> None:
    @tool
    def deep(n: int) -> None:
        """Recurses, then fails with a long message."""
        if n:
            deep.fn(n - 1)
        raise RuntimeError("x" * 50_000)

    [out] = await run_tool_calls([call("deep", {"n": 200})], ToolSet([deep]), session=None)
    b = body(out)
    assert b["error_kind"] == "tool_execution_exception"
    assert b["message"].startswith("tool 'deep' raised RuntimeError: xxx")
    assert "…[truncated" in b["message"]
    assert len(b["detail"]) <= 4_000
    assert b["detail"].startswith("Traceback") and "in deep" in b["detail"]
    assert "RuntimeError" in b["detail"]


async def test_tool_errors_keep_their_kind() -> None:
    @tool
    def refuse() -> None:
        """Refuses a path."""
        raise PathViolation("the path leaves the workspace")

    @tool
    def custom() -> None:
        """Custom tool error."""
        raise ToolError("nope", detail="more")

    outs = await run_tool_calls(
        [call("refuse"), call("custom")], ToolSet([refuse, custom]), session=None
    )
    assert [o.error_kind for o in outs] == ["path_violation", "tool_execution_exception"]
    assert body(outs[1]) == {
        "ok": False, "error_kind": "tool_execution_exception", "message": "nope", "detail": "more"
    }  # fmt: skip


async def test_text_fields_capped_with_marker() -> None:
    @tool(max_result_chars=100)
    def small() -> dict[str, Any]:
        """Small cap."""
        return {"text": "y" * 1_000, "nested": [{"t": "z" * 150}]}

    outs = await run_tool_calls(
        [call("echo", {"text": "x" * (MAX_TEXT_CHARS + 12_345)}), call("small")],
        ToolSet([echo, small]),
        session=None,
    )
    big = body(outs[0])["result"]
    assert big == "x" * MAX_TEXT_CHARS + "…[truncated 12345 chars]"
    b = body(outs[1])
    assert b["text"] == "y" * 100 + "…[truncated 900 chars]"
    assert b["nested"][0]["t"].endswith("…[truncated 50 chars]")


async def test_whole_body_capped() -> None:
    @tool
    def many() -> list[str]:
        """Many short strings."""
        return ["abcdefghij"] * 50_000

    [out] = await run_tool_calls([call("many")], ToolSet([many]), session=None)
    assert len(out.content) <= 100_000
    assert body(out)["result"].endswith("chars]")


async def test_sync_tools_run_concurrently() -> None:
    # A barrier all eight calls must reach together: it opens only if they all run at once, so
    # a loaded machine that starts a thread late cannot fail it (as timed intervals could).
    barrier = threading.Barrier(8, timeout=60)
    loop_thread = threading.get_ident()

    @tool
    def nap(i: int) -> int:
        """Waits for the other calls."""
        assert threading.get_ident() != loop_thread  # never on the event loop
        barrier.wait()  # BrokenBarrierError (an error result) unless all eight run at once
        return i

    outs = await run_tool_calls(
        [call("nap", {"i": i}, id=str(i)) for i in range(8)], ToolSet([nap]), session=None
    )
    assert [body(o)["result"] for o in outs] == list(range(8))


async def test_resource_keys_order_calls_and_others_overlap() -> None:
    events: list[tuple[str, str, float]] = []

    def key(arguments: Mapping[str, Any]) -> str:
        return str(arguments["key"])

    @tool(resource_key=key)
    async def step(key: str, label: str) -> str:
        """Keyed step."""
        events.append(("start", label, time.monotonic()))
        await anyio.sleep(0.05)
        events.append(("end", label, time.monotonic()))
        return label

    @tool(parallel_safe=False)
    async def solo(label: str) -> str:
        """One at a time."""
        events.append(("start", label, time.monotonic()))
        await anyio.sleep(0.05)
        events.append(("end", label, time.monotonic()))
        return label

    calls = [
        call("step", {"key": "a", "label": "a1"}),
        call("step", {"key": "b", "label": "b1"}),
        call("step", {"key": "a", "label": "a2"}),
        call("solo", {"label": "s1"}),
        call("step", {"key": "a", "label": "a3"}),
        call("solo", {"label": "s2"}),
    ]
    outs = await run_tool_calls(calls, ToolSet([step, solo]), session=None)
    assert [body(o)["result"] for o in outs] == ["a1", "b1", "a2", "s1", "a3", "s2"]
    times = {(kind, label): t for kind, label, t in events}
    assert times[("end", "a1")] <= times[("start", "a2")] <= times[("end", "a2")]
    assert times[("end", "a2")] <= times[("start", "a3")]
    assert times[("end", "s1")] <= times[("start", "s2")]
    # different keys overlap
    assert times[("start", "b1")] < times[("end", "a1")]
    assert times[("start", "s1")] < times[("end", "a1")]


async def test_timeouts_async_and_sync() -> None:
    cancelled = anyio.Event()

    @tool(timeout=0.05)
    async def slow_async() -> None:
        """Sleeps too long."""
        try:
            await anyio.sleep(10)
        finally:
            cancelled.set()

    release = threading.Event()

    @tool(timeout=0.05)
    def slow_sync() -> None:
        """Blocks too long."""
        release.wait(10)

    try:
        outs = await run_tool_calls(
            [call("slow_async"), call("slow_sync")], ToolSet([slow_async, slow_sync]), session=None
        )
    finally:
        release.set()
    assert [o.error_kind for o in outs] == ["timeout", "timeout"]
    assert cancelled.is_set()
    assert "may still be running" in body(outs[1])["message"]
    assert "may still be running" not in body(outs[0])["message"]


async def test_cancellation_cancels_running_tools() -> None:
    cancelled = anyio.Event()
    started = anyio.Event()

    @tool
    async def forever() -> None:
        """Never ends."""
        started.set()
        try:
            await anyio.sleep(100)
        finally:
            cancelled.set()

    async with anyio.create_task_group() as group:
        calls = [call("forever"), call("forever", id="2")]
        group.start_soon(functools.partial(run_tool_calls, calls, ToolSet([forever]), session=None))
        await started.wait()
        group.cancel_scope.cancel()
    assert cancelled.is_set()


async def test_injection_of_session_and_sandbox_and_sync_tool_reaching_the_loop() -> None:
    seen: dict[str, Any] = {}

    @tool
    async def who(session: Session) -> str:
        """Returns the session id."""
        return session.id

    @tool
    def sync_sandbox_writer(sandbox: Sandbox, name: str) -> int:
        """A sync tool that awaits a sandbox operation from its worker thread."""
        seen["workspace"] = sandbox.workspace
        return anyio.from_thread.run(sandbox.write_file, name, "data")

    with Session.from_user_message("hi").to("local") as session:
        outs = await run_tool_calls(
            [call("who"), call("sync_sandbox_writer", {"name": "f.txt"})],
            ToolSet([who, sync_sandbox_writer]),
            session=session,
        )
        assert body(outs[0]) == {"ok": True, "result": session.id}
        assert body(outs[1]) == {"ok": True, "result": 4}
        assert (seen["workspace"] / "f.txt").read_text() == "data"
    # a tool that needs a sandbox, called for a session without one, fails cleanly
    [out] = await run_tool_calls(
        [call("sync_sandbox_writer", {"name": "x"})],
        ToolSet([sync_sandbox_writer]),
        session=Session.from_user_message("no sandbox"),
    )
    assert out.error_kind == "tool_execution_exception"
    assert "no sandbox placement" in body(out)["message"]


class Counter(BaseTool):
    name = "counter"
    description = "Counts."
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    def __call__(self, n: int, session: Session) -> dict[str, Any]:
        return {"n": n + 1, "has_session": isinstance(session, Session)}


async def test_base_tool_dispatch() -> None:
    outs = await run_tool_calls(
        [call("counter", {"n": 1}), call("counter", {"n": "x"})],
        ToolSet.build([Counter]),
        session=Session.from_user_message("x"),
    )
    assert body(outs[0]) == {"ok": True, "n": 2, "has_session": True}
    assert outs[1].error_kind == "invalid_tool_arguments"


class _Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


@dataclasses.dataclass
class _Node:
    name: str
    child: Any = None


@tool
def raw_output() -> bytes:
    """Bytes from a real subprocess that are not UTF-8 (a Latin-1 file name in the listing)."""
    import subprocess
    import sys

    return subprocess.check_output(
        [sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'caf\\xe9 ok\\n')"]
    )


@tool
def binary_blob() -> dict[str, Any]:
    """Mostly undecodable bytes (an image), nested."""
    return {"png": bytes(range(128, 256)), "name": b"\xff\xfe"}


@tool
def cyclic() -> dict[str, Any]:
    """A structure that contains itself, a NaN, and infinities."""
    data: dict[str, Any] = {"nan": float("nan"), "values": [float("inf"), -float("inf"), 1.5]}
    loop: list[Any] = [1]
    loop.append(loop)
    data["loop"] = loop
    data["self"] = data
    node = _Node("a")
    node.child = node
    data["node"] = node
    return data


@tool
def unprintable() -> Any:
    """A value that has neither a JSON form nor a repr."""
    return _Unprintable()


async def test_results_always_serialise_to_valid_json() -> None:
    tools = ToolSet.build([raw_output, binary_blob, cyclic, unprintable])
    outs = await run_tool_calls(
        [call("raw_output"), call("binary_blob"), call("cyclic"), call("unprintable")],
        tools,
        session=None,
    )
    decoded = [json.loads(o.content) for o in outs]  # strict JSON: no NaN, no Infinity
    for o in outs:
        json.loads(o.content, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert decoded[0] == {"ok": True, "result": "caf\ufffd ok\n"}  # replaced, still text
    assert decoded[1]["ok"] is True
    assert decoded[1]["png"]["bytes"] == 128
    assert bytes(range(128, 256)) == __import__("base64").b64decode(decoded[1]["png"]["base64"])
    cyc = decoded[2]
    assert cyc["ok"] is True and cyc["nan"] == "NaN"
    assert cyc["values"] == ["Infinity", "-Infinity", 1.5]
    assert cyc["loop"] == [1, "<circular reference>"]
    assert "<circular reference>" in json.dumps(cyc["self"])
    assert "_Node(name='a'" in json.dumps(cyc["node"])  # a dataclass cycle falls back to repr
    assert decoded[3]["ok"] is False and outs[3].error_kind == "unserialisable_result"
    assert "no repr for you" in decoded[3]["message"]
