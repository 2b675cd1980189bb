"""The session loop over real loopback HTTP against the fake server, with a real sandbox."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

from treadle import Session
from treadle.llm import Provider
from treadle.loop import run_session_loop
from treadle.testing import FakeOpenAIServer

AGENT = Session.from_agent_prompt("Use tools when the user asks for file work.")


@pytest.fixture(scope="module")
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(script="file_worker") as srv:
        yield srv


def _provider(server: FakeOpenAIServer, **kw: Any) -> Provider:
    return Provider(model="fake-model", base_url=server.base_url, api_key="sk-test", **kw)


def test_file_work_walkthrough(server: FakeOpenAIServer) -> None:
    user = Session.from_user_message("Create a file, then read it back.").to("local")
    out = run_session_loop(user, AGENT, agent_provider=_provider(server))
    rows = out.rows
    assert [r.kind for r in rows] == [
        "user",
        "assistant",
        "tool_result",
        "assistant",
        "tool_result",
        "assistant",
    ]
    assert rows[1].tool_calls[0]["function"]["name"] == "write_workspace_file"
    written = json.loads(rows[2].payload["content"])
    assert written["ok"] and written["bytes_written"] == len("hello from treadle\n")
    assert rows[3].tool_calls[0]["function"]["name"] == "run_shell_command"
    shell = json.loads(rows[4].payload["content"])
    assert shell["exit_code"] == 0 and shell["stdout"] == "hello from treadle\n"
    assert "hello from treadle" in (out.final_text or "")
    assert out.stop_reason == "final_answer"
    assert out.usage.requests == 3 and out.usage.total_tokens > 0
    # the file is really in the shared sandbox, which the output session holds too
    workspace = out.require_sandbox().workspace
    assert (workspace / "notes.txt").read_text() == "hello from treadle\n"
    assert out.sandbox_handle is user.sandbox_handle
    # built-in tools were offered because the session has a sandbox placement
    sent = server.requests[-1].body
    assert {t["function"]["name"] for t in sent["tools"]} >= {
        "run_shell_command",
        "write_workspace_file",
        "read_workspace_file",
        "list_workspace_files",
    }
    out.close_sandbox()
    user.close_sandbox()


def test_no_builtin_tools_without_a_placement(server: FakeOpenAIServer) -> None:
    with FakeOpenAIServer(script="echo") as echo:
        out = run_session_loop(
            Session.from_user_message("just talk"),
            AGENT,
            agent_provider=Provider(model="m", base_url=echo.base_url, api_key="k"),
        )
        assert out.final_text and "just talk" in out.final_text
        assert "tools" not in echo.requests[-1].body


def test_streaming_equals_non_streaming(server: FakeOpenAIServer) -> None:
    user = Session.from_user_message("Create a file, then read it back.").to("local")
    # one after the other: both passes share the sandbox and write the same file
    plain = run_session_loop(user, AGENT, agent_provider=_provider(server)).synchronize()
    deltas: list[Any] = []
    streamed = run_session_loop(
        user, AGENT, agent_provider=_provider(server, stream=True), on_event=deltas.append
    )

    def shape(s: Session) -> list[tuple[str, Any]]:
        out = []
        for r in s.rows:
            p = copy.deepcopy(r.payload)
            for call in p.get("tool_calls") or []:
                call.pop("id", None)
            p.pop("tool_call_id", None)
            if r.kind == "tool_result":
                body = json.loads(p["content"])
                body.pop("elapsed_ms", None)
                p["content"] = body
            out.append((r.kind, p))
        return out

    assert shape(streamed) == shape(plain)
    # prompt sizes differ (stream_options is sent), what the model produced does not
    assert streamed.usage.completion_tokens == plain.usage.completion_tokens
    assert streamed.usage.requests == plain.usage.requests == 3
    assert len(deltas) > 3  # several stream chunks reached the callback
    assert server.requests[-1].body["stream"] is True


def test_on_event_gets_one_delta_per_non_streamed_reply(server: FakeOpenAIServer) -> None:
    deltas: list[Any] = []
    user = Session.from_user_message("Create a file, then read it back.").to("local")
    out = run_session_loop(user, AGENT, agent_provider=_provider(server), on_event=deltas.append)
    assert out.stop_reason == "final_answer"
    assert len(deltas) == 3
    assert deltas[0].choices[0].delta.tool_calls[0].function.name == "write_workspace_file"


def test_a_raising_callback_ends_only_its_own_pass(server: FakeOpenAIServer) -> None:
    def bad(_delta: Any) -> None:
        raise ValueError("callback broke")

    user = Session.from_user_message("Create a file, then read it back.").to("local")
    other = Session.from_user_message("Create a file, then read it back.").to("local")
    broken = run_session_loop(user, AGENT, agent_provider=_provider(server), on_event=bad)
    fine = run_session_loop(other, AGENT, agent_provider=_provider(server))
    with pytest.raises(ValueError, match="callback broke"):
        broken.synchronize()
    assert fine.stop_reason == "final_answer"


def test_thousand_overlapping_passes_over_http() -> None:
    with FakeOpenAIServer(script="file_worker", latency_ms=20) as srv:
        provider = Provider(model="m", base_url=srv.base_url, api_key="k")
        outs = [
            run_session_loop(Session.from_user_message(f"task {i}"), AGENT, agent_provider=provider)
            for i in range(1000)
        ]
        for i, out in enumerate(outs):
            assert out.stop_reason == "final_answer", i
            assert out.rows[0].content == f"task {i}"
            assert out.chunk_table.kinds()[-1] == "assistant"
        assert srv.max_in_flight > 100  # the passes really overlapped


def test_a_slow_callback_does_not_stall_other_passes(server: FakeOpenAIServer) -> None:
    import threading

    release = threading.Event()

    def slow(_delta: Any) -> None:
        release.wait(30)  # blocks its worker thread until the other pass has finished

    slow_user = Session.from_user_message("Create a file, then read it back.").to("local")
    fast_user = Session.from_user_message("Create a file, then read it back.").to("local")
    stalled = run_session_loop(slow_user, AGENT, agent_provider=_provider(server), on_event=slow)
    fast = run_session_loop(fast_user, AGENT, agent_provider=_provider(server))
    assert fast.synchronize(timeout=60).stop_reason == "final_answer"
    assert not stalled.done()  # still waiting on its own callback, without blocking the loop
    release.set()
    assert stalled.synchronize(timeout=60).stop_reason == "final_answer"


async def test_provider_is_an_alias_of_agent_provider(server: FakeOpenAIServer) -> None:
    # `Agent` takes provider=; the entry points take it too, so one spelling works everywhere.
    from treadle.loop import arun_session_loop, stream_session_loop
    from treadle.loop.events import PassStopped

    user = Session.from_user_message("hi")
    out = await run_session_loop(user, AGENT, provider=_provider(server))
    assert out.stop_reason == "final_answer"
    out2 = await arun_session_loop(user, AGENT, provider=_provider(server))
    assert out2.stop_reason == "final_answer"
    events = [e async for e in stream_session_loop(user, AGENT, provider=_provider(server))]
    assert isinstance(events[-1], PassStopped)


async def test_provider_and_agent_provider_together_is_a_configuration_error(
    server: FakeOpenAIServer,
) -> None:
    from treadle.errors import ConfigurationError
    from treadle.loop import arun_session_loop

    user = Session.from_user_message("hi")
    p = _provider(server)
    with pytest.raises(ConfigurationError, match="provider= or agent_provider="):
        run_session_loop(user, AGENT, provider=p, agent_provider=p)
    with pytest.raises(ConfigurationError, match="provider= or agent_provider="):
        await arun_session_loop(user, AGENT, provider=p, agent_provider=p)
