"""The fault matrix: every provider fault, streamed and not, through a whole persisted pass.

Each case runs a real pass over loopback HTTP against the fake server with one fault injected
(most of them on the second request, after a tool round was persisted). The pass either recovers
(the fault was retried, or reported to the model) or fails with the documented typed error. Either
way the persisted file has no torn line, every assistant row with tool calls is followed by its
tool results, and nothing is left behind: no runtime task, no extra task on the runtime loop, no
file descriptor (sockets included) once the pooled clients are closed.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from treadle import Provider, Session, run_session_loop, tool
from treadle.errors import (
    AuthenticationError,
    ContextLengthError,
    MalformedResponse,
    ProviderConnectionError,
    ProviderError,
    ProviderTimeout,
    RateLimitError,
)
from treadle.llm.client import close_all_clients_for_loop
from treadle.persist import load_session
from treadle.runtime import get_runtime
from treadle.testing import FakeOpenAIServer, Reply

AGENT = Session.from_agent_prompt("Call probe once, then answer.")


@tool
def probe(x: int) -> int:
    """Return x plus one."""
    return x + 1


def script(request: dict[str, Any]) -> Reply:
    """One tool round, then a final answer."""
    if any(m.get("role") == "tool" for m in request["messages"]):
        return Reply.text("all done")
    return Reply.tool_call("probe", {"x": 1})


def second_request(request: dict[str, Any]) -> bool:
    return any(m.get("role") == "tool" for m in request["messages"])


def first_request(request: dict[str, Any]) -> bool:
    return not second_request(request)


@dataclass(frozen=True)
class Fault:
    """One row of the matrix: the injected reply, and the outcome in each mode."""

    name: str
    reply: Reply | None  # None: no server at all (connection refused)
    times: int | None = 1  # None: every matching request
    when: Callable[[dict[str, Any]], bool] = second_request
    outcome: type[BaseException] | str = "recovered"
    streamed_outcome: type[BaseException] | str | None = None  # when it differs when streamed
    result_kind: str | None = None  # the tool_result error_kind the model saw, if any


FAULTS = [
    Fault("429 with Retry-After", Reply.rate_limited(retry_after=0.05)),
    Fault("429 every time", Reply.rate_limited(retry_after=0.01), None, outcome=RateLimitError),
    Fault("500", Reply.server_error(500)),
    Fault("502", Reply.server_error(502)),
    Fault("503", Reply.server_error(503)),
    Fault("503 every time", Reply.server_error(503), None, outcome=ProviderError),
    Fault("connection refused", None, outcome=ProviderConnectionError),
    Fault("connection dropped before a reply", Reply.dropped_connection()),
    Fault("connection dropped every time", Reply.dropped_connection(), None,
          outcome=ProviderConnectionError),
    # Non-streamed: half the body, then the socket closes (retried as a request). Streamed: two
    # events, then the close: chunks were already delivered, so the turn restarts (same budget).
    Fault("reset mid-response", Reply.text("all done").torn(2)),
    Fault("stream torn after tool-call deltas", Reply.tool_call("probe", {"x": 12345678}).torn(3),
          when=first_request),
    Fault("invalid JSON", Reply.invalid_json(), None, outcome=MalformedResponse),
    Fault("empty choices", Reply.no_choices(), None, outcome=MalformedResponse,
          streamed_outcome=MalformedResponse),
    Fault("unknown tool", Reply.tool_call("no_such_tool", {}), when=first_request,
          result_kind="unknown_tool"),
    Fault("broken argument JSON", Reply.tool_call("probe", '{"x": 1,,'), when=first_request,
          result_kind="invalid_tool_arguments"),
    Fault("401", Reply.unauthorized(), None, outcome=AuthenticationError),
    Fault("context length", Reply.context_length_exceeded(), None, outcome=ContextLengthError),
    Fault("context length (llama.cpp)", Reply.context_length_exceeded("llamacpp"), None,
          outcome=ContextLengthError),
    Fault("never answers", Reply.text("late").with_latency(30_000), None, outcome=ProviderTimeout),
    Fault("stalls mid-body", Reply.text("all done").stalled(30_000), None,
          outcome=ProviderTimeout, streamed_outcome=MalformedResponse),
]  # fmt: skip


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _runtime_tasks() -> int:
    runtime = get_runtime()

    async def count() -> int:
        me = asyncio.current_task()
        return len([t for t in asyncio.all_tasks() if t is not me])

    return asyncio.run_coroutine_threadsafe(count(), runtime.loop).result(10)


def _settle(baseline: int) -> int:
    """Close pooled clients and wait (bounded) for sockets to go; the fd count afterwards."""
    close_all_clients_for_loop(get_runtime().loop)
    deadline = time.monotonic() + 5  # a bound on waiting, not a timing assertion
    while _fds() > baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    return _fds()


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    """One pass first, so lazily created runtime parts are not counted as leaks."""
    with FakeOpenAIServer(script=script) as server:
        for stream in (False, True):
            p = Provider(model="fake", base_url=server.base_url, api_key="sk-t", stream=stream)
            out = run_session_loop(Session.from_user_message("hi"), AGENT, agent_provider=p,
                                   tools=[probe])  # fmt: skip
            assert out.stop_reason == "final_answer"
    close_all_clients_for_loop(get_runtime().loop)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_file(path: Path, failed: bool) -> list[str]:
    """The persisted file is consistent; returns its row kinds."""
    raw = path.read_bytes()
    assert raw.endswith(b"\n"), "torn last line"
    for line in raw.splitlines():
        json.loads(line)  # every line is whole JSON
    loaded = load_session(path)
    assert loaded.closed is not failed
    rows = loaded.session.rows
    for i, row in enumerate(rows):
        calls = row.tool_calls if row.kind == "assistant" else None
        if calls:
            ids = [c["id"] for c in calls]
            following = [r.payload["tool_call_id"] for r in rows[i + 1 : i + 1 + len(ids)]]
            assert following == ids, "an assistant row without its tool results"
    assert loaded.pending_intents == ()
    return loaded.session.chunk_table.kinds()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault(fault: Fault, stream: bool, tmp_path: Path) -> None:
    expected = fault.outcome
    if stream and fault.streamed_outcome is not None:
        expected = fault.streamed_outcome
    fds_before = _fds()
    tasks_before = _runtime_tasks()
    file = tmp_path / "pass.jsonl"
    server = FakeOpenAIServer(script=script)
    options: dict[str, Any] = {"timeout": 0.5, "max_retries": 1, "retry_base_delay": 0.01}
    if fault.reply is None:
        base_url = f"http://127.0.0.1:{_free_port()}/v1"
    else:
        server.start()
        server.add_fault(fault.reply, when=fault.when, times=fault.times)
        base_url = server.base_url
    try:
        provider = Provider(model="fake", base_url=base_url, api_key="sk-t", stream=stream,
                            **options)  # fmt: skip
        out = run_session_loop(Session.from_user_message("go"), AGENT, agent_provider=provider,
                               tools=[probe], persist_path=file)  # fmt: skip
        if expected == "recovered":
            assert out.stop_reason == "final_answer"
            assert out.final_text == "all done"
            results = [
                json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"
            ]
            if fault.result_kind is None:
                assert results == [{"ok": True, "result": 2}]
            else:
                assert results[0]["ok"] is False
                assert results[0]["error_kind"] == fault.result_kind
            kinds = check_file(file, failed=False)
            assert kinds == ["user", "assistant", "tool_result", "assistant"]
        else:
            assert isinstance(expected, type)
            with pytest.raises(expected) as info:
                out.synchronize()
            assert info.value.__class__.__module__ == "treadle.errors"
            with pytest.raises(expected):  # a failed pass re-raises on every read
                _ = out.chunk_table
            kinds = check_file(file, failed=True)
            assert kinds in (["user"], ["user", "assistant", "tool_result"])
    finally:
        server.stop()
    assert get_runtime().pending == 0
    assert _runtime_tasks() <= tasks_before
    assert _settle(fds_before) <= fds_before
