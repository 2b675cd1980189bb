"""Telemetry scenarios, each run in a fresh interpreter by `tests/test_telemetry.py`.

OpenTelemetry's global tracer and meter providers can be set once per process, and tracing must
stay off for the rest of the suite, so every scenario configures the SDK's in-memory exporters in
its own process, runs real passes over the fake server, and asserts on what was exported.
Run one with `python tests/otel_scenarios.py NAME` (which also runs those of
`otel_export_scenarios.py`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

KEY = "sk-test-NEVER-IN-A-SPAN-0123456789abcdef"


def _sdk() -> tuple[Any, Any]:
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    return exporter, reader


def _tool() -> Any:
    from treadle import tool

    @tool
    def noop(round: int) -> dict[str, int]:
        """Do nothing, for `round`."""
        return {"round": round}

    return noop


def _tree(exporter: Any) -> tuple[list[Any], dict[int, Any]]:
    spans = list(exporter.get_finished_spans())
    return spans, {s.context.span_id: s for s in spans}


def _children(spans: list[Any], parent: Any) -> list[Any]:
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def two_tool_rounds(stream: bool) -> None:
    from opentelemetry import trace

    from treadle import Provider, Session, run_session_loop
    from treadle.testing import FakeOpenAIServer

    exporter, reader = _sdk()
    tracer = trace.get_tracer("app")
    with FakeOpenAIServer(script="tool_loop", rounds=2) as server:
        provider = Provider(
            model="fake-model", base_url=server.base_url, api_key=KEY, stream=stream
        )
        with tracer.start_as_current_span("caller") as caller:
            out = run_session_loop(
                Session.from_user_message("go"),
                Session.from_agent_prompt("agent"),
                agent_provider=provider,
                tools=[_tool()],
            )
        assert out.stop_reason == "final_answer", out.stop_reason
    spans, _ = _tree(exporter)
    [agent] = [s for s in spans if s.name == "invoke_agent"]
    assert agent.parent is not None and agent.parent.span_id == caller.get_span_context().span_id
    assert agent.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert agent.attributes["gen_ai.conversation.id"] == out.id
    assert agent.attributes["treadle.stop_reason"] == "final_answer"
    assert agent.attributes["gen_ai.usage.input_tokens"] == out.usage.prompt_tokens
    children = _children(spans, agent)
    names = [s.name for s in sorted(children, key=lambda s: s.start_time)]
    assert names == [
        "chat fake-model",
        "execute_tool noop",
        "chat fake-model",
        "execute_tool noop",
        "chat fake-model",
    ], names
    chat = next(s for s in children if s.name.startswith("chat"))
    attrs = chat.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "fake-model"
    assert attrs["gen_ai.response.model"] == "fake-model"
    assert attrs["gen_ai.response.id"]
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["tool_calls"]
    assert attrs["gen_ai.usage.input_tokens"] > 0 and attrs["gen_ai.usage.output_tokens"] > 0
    assert attrs["server.address"] == "127.0.0.1" and attrs["server.port"] == server.port
    assert chat.kind == trace.SpanKind.CLIENT
    tool_span = next(s for s in children if s.name.startswith("execute_tool"))
    assert tool_span.attributes["gen_ai.tool.name"] == "noop"
    assert tool_span.attributes["gen_ai.tool.call.id"]
    assert "gen_ai.input.messages" not in attrs  # content is off by default
    _no_key(spans)
    points = _metric_points(reader)
    assert {p["gen_ai.token.type"] for p in points["gen_ai.client.token.usage"]} == {
        "input",
        "output",
    }
    assert points["gen_ai.client.operation.duration"]
    assert "treadle.passes.in_flight" in points


def _no_key(spans: list[Any]) -> None:
    for span in spans:
        text = repr(dict(span.attributes)) + repr([dict(e.attributes) for e in span.events])
        assert KEY not in text and KEY[-12:] not in text, span.name


def _metric_points(reader: Any) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                out[metric.name] = [dict(p.attributes) for p in metric.data.data_points]
    return out


def not_streamed() -> None:
    two_tool_rounds(stream=False)


def streamed() -> None:
    two_tool_rounds(stream=True)


def failed_pass() -> None:
    from treadle import Provider, Session, run_session_loop
    from treadle.testing import FakeOpenAIServer, Reply

    exporter, _ = _sdk()
    with FakeOpenAIServer(replies=[Reply.bad_request("no such thing")]) as server:
        provider = Provider(model="fake-model", base_url=server.base_url, api_key=KEY)
        out = run_session_loop(
            Session.from_user_message("go"), Session.from_agent_prompt("a"), agent_provider=provider
        )
        try:
            out.synchronize()
        except Exception as err:
            error = err
        else:
            raise AssertionError("the pass should have failed")
    spans, _ = _tree(exporter)
    [agent] = [s for s in spans if s.name == "invoke_agent"]
    [chat] = _children(spans, agent)
    from opentelemetry.trace import StatusCode

    assert agent.status.status_code == StatusCode.ERROR
    assert agent.attributes["error.type"] == type(error).__name__
    assert chat.status.status_code == StatusCode.ERROR
    assert chat.attributes["error.type"] == type(error).__name__
    _no_key(spans)


def retried_request() -> None:
    from treadle import Provider, Session, run_session_loop
    from treadle.testing import FakeOpenAIServer, Reply

    exporter, _ = _sdk()
    with FakeOpenAIServer(script="echo") as server:
        server.add_fault(Reply.rate_limited(retry_after=0), times=1)
        provider = Provider(
            model="fake-model", base_url=server.base_url, api_key=KEY, retry_base_delay=0.01
        )
        out = run_session_loop(
            Session.from_user_message("q"), Session.from_agent_prompt("a"), agent_provider=provider
        )
        assert out.stop_reason == "final_answer"
    spans, _ = _tree(exporter)
    [chat] = [s for s in spans if s.name.startswith("chat")]
    [event] = [e for e in chat.events if e.name == "treadle.retry"]
    assert event.attributes["treadle.retry.attempt"] == 1
    assert chat.attributes["treadle.retries"] == 1
    assert chat.attributes["treadle.limiter.wait_s"] >= 0


def cancelled_pass() -> None:
    import time

    from treadle import Provider, Session, run_session_loop
    from treadle.testing import FakeOpenAIServer

    exporter, _ = _sdk()
    with FakeOpenAIServer(latency_ms=5000) as server:
        provider = Provider(model="fake-model", base_url=server.base_url, api_key=KEY)
        out = run_session_loop(
            Session.from_user_message("go"), Session.from_agent_prompt("a"), agent_provider=provider
        )
        deadline = time.monotonic() + 10
        while server.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        out.cancel()
        assert out.stop_reason == "cancelled"
    spans, _ = _tree(exporter)
    [agent] = [s for s in spans if s.name == "invoke_agent"]
    assert agent.attributes["treadle.stop_reason"] == "cancelled"
    [chat] = _children(spans, agent)  # the request in flight was closed, not leaked
    assert chat.end_time is not None


def calls_not_run() -> None:
    """A call the dispatcher answers without running a tool (here: no tool of that name) still
    gets its `execute_tool` span, with the error type."""
    from opentelemetry.trace import StatusCode

    from treadle import Provider, Session, run_session_loop
    from treadle.testing import FakeOpenAIServer

    exporter, _ = _sdk()
    with FakeOpenAIServer(script="tool_loop", rounds=1) as server:  # it calls `noop`
        provider = Provider(model="fake-model", base_url=server.base_url, api_key=KEY)
        out = run_session_loop(
            Session.from_user_message("go"), Session.from_agent_prompt("a"), agent_provider=provider
        )
        assert out.stop_reason == "final_answer"
    spans, _ = _tree(exporter)
    [agent] = [s for s in spans if s.name == "invoke_agent"]
    [tool_span] = [s for s in spans if s.name == "execute_tool noop"]
    assert tool_span.parent.span_id == agent.context.span_id
    assert tool_span.attributes["error.type"] == "unknown_tool"
    assert tool_span.status.status_code == StatusCode.ERROR


def nested_pass_unnamed() -> None:
    """An `Agent`'s name is on its own pass only: a pass its tool starts is not named by it,
    and hangs under the tool's span."""
    import asyncio

    from treadle import Agent, Provider, Session, arun_session_loop, tool
    from treadle.testing import FakeOpenAIServer

    exporter, _ = _sdk()
    with FakeOpenAIServer(script="tool_loop", rounds=1) as server:
        provider = Provider(model="fake-model", base_url=server.base_url, api_key=KEY)

        @tool
        async def noop(round: int) -> str:
            """Ask another pass."""
            inner = await arun_session_loop(
                Session.from_user_message("inner"),
                Session.from_agent_prompt("i"),
                agent_provider=provider,
            )
            return inner.stop_reason or ""

        agent = Agent("outer", "Use the tool.", tools=[noop], provider=provider)
        lazy = agent("lazy")
        awaited = asyncio.run(agent.run("awaited"))
        assert lazy.stop_reason == awaited.stop_reason == "final_answer"
    spans, by_id = _tree(exporter)
    outer = [s for s in spans if s.name == "invoke_agent outer"]
    inner = [s for s in spans if s.name == "invoke_agent"]
    assert len(outer) == 2 and len(inner) == 2, [s.name for s in spans]
    for span in inner:
        assert "gen_ai.agent.name" not in span.attributes
        assert by_id[span.parent.span_id].name == "execute_tool noop"


def hundred_passes_one_caller() -> None:
    from opentelemetry import trace

    from treadle import Provider, Session, run_session_loop
    from treadle.testing import FakeOpenAIServer

    exporter, _ = _sdk()
    tracer = trace.get_tracer("app")
    with FakeOpenAIServer(script="echo") as server:
        provider = Provider(model="fake-model", base_url=server.base_url, api_key=KEY)
        agent = Session.from_agent_prompt("a")
        with tracer.start_as_current_span("batch") as batch:
            outs = [
                run_session_loop(Session.from_user_message(f"q{i}"), agent, agent_provider=provider)
                for i in range(100)
            ]
        assert all(o.stop_reason == "final_answer" for o in outs)
    spans, _ = _tree(exporter)
    passes = [s for s in spans if s.name == "invoke_agent"]
    assert len(passes) == 100
    assert {s.parent.span_id for s in passes} == {batch.get_span_context().span_id}
    assert {s.context.trace_id for s in passes} == {batch.get_span_context().trace_id}


def content_on() -> None:
    from treadle import Provider, Session, run_session_loop
    from treadle.telemetry import configure
    from treadle.testing import FakeOpenAIServer

    exporter, _ = _sdk()
    configure(capture_content=True)
    with FakeOpenAIServer(script="tool_loop", rounds=1) as server:
        provider = Provider(model="fake-model", base_url=server.base_url, api_key=KEY)
        out = run_session_loop(
            Session.from_user_message("secret question"),
            Session.from_agent_prompt("a"),
            agent_provider=provider,
            tools=[_tool()],
        )
        assert out.stop_reason == "final_answer"
    spans, _ = _tree(exporter)
    chats = [s for s in spans if s.name.startswith("chat")]
    assert "secret question" in chats[0].attributes["gen_ai.input.messages"]
    assert "tool_calls" in chats[0].attributes["gen_ai.output.messages"]
    [tool_span] = [s for s in spans if s.name.startswith("execute_tool")]
    assert '"round"' in tool_span.attributes["gen_ai.tool.call.arguments"]
    assert '"ok":true' in tool_span.attributes["gen_ai.tool.call.result"]
    _no_key(spans)


def off_imports_nothing() -> None:
    from treadle import Provider, Session, run_session_loop
    from treadle.testing import FakeOpenAIServer

    with FakeOpenAIServer(script="echo") as server:
        provider = Provider(model="fake-model", base_url=server.base_url)
        out = run_session_loop(
            Session.from_user_message("q"), Session.from_agent_prompt("a"), agent_provider=provider
        )
        assert out.stop_reason == "final_answer"
    leaked = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
    assert not leaked, leaked


SCENARIOS: dict[str, Callable[[], None]] = {
    "not_streamed": not_streamed,
    "streamed": streamed,
    "failed_pass": failed_pass,
    "cancelled_pass": cancelled_pass,
    "retried_request": retried_request,
    "hundred_passes_one_caller": hundred_passes_one_caller,
    "calls_not_run": calls_not_run,
    "nested_pass_unnamed": nested_pass_unnamed,
    "content_on": content_on,
    "off_imports_nothing": off_imports_nothing,
}

if __name__ == "__main__":
    from otel_export_scenarios import EXPORT_SCENARIOS, ray_backend

    {**SCENARIOS, **EXPORT_SCENARIOS, "ray_backend": ray_backend}[sys.argv[1]]()
    print("ok")
