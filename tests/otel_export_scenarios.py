"""Telemetry scenarios that export: over OTLP/HTTP, through `treadle.map`, from worker processes.

Run by `python tests/otel_scenarios.py NAME` like the others (each in a fresh interpreter, see
that module). `worker_tracing` is the `worker_init` the process and Ray scenarios give their
workers, so it lives in this importable module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from otel_scenarios import KEY, _sdk, _tool, _tree


def _otlp_receiver() -> tuple[str, list[bytes], Callable[[], None]]:
    """An OTLP/HTTP trace receiver on 127.0.0.1: its endpoint, the bodies it got, its stop."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    received: list[bytes] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            assert self.path == "/v1/traces", self.path
            received.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    receiver = HTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
    return endpoint, received, receiver.shutdown


def _decode(received: list[bytes]) -> list[tuple[Any, dict[str, Any]]]:
    """Every span in the OTLP requests, with its resource's attributes."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    out: list[tuple[Any, dict[str, Any]]] = []
    for body in received:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            resource = {
                a.key: getattr(a.value, a.value.WhichOneof("value"))
                for a in resource_spans.resource.attributes
            }
            for scope_spans in resource_spans.scope_spans:
                out.extend((span, resource) for span in scope_spans.spans)
    return out


def otlp_http() -> None:
    """Export over OTLP/HTTP to a receiver on 127.0.0.1 and decode what arrived."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from treadle import Provider, Session, run_session_loop
    from treadle.testing import FakeOpenAIServer

    endpoint, received, stop = _otlp_receiver()
    provider = TracerProvider(resource=Resource.create({"service.name": "treadle-test"}))
    processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    with FakeOpenAIServer(script="tool_loop", rounds=1) as server:
        model = Provider(model="fake-model", base_url=server.base_url, api_key=KEY)
        out = run_session_loop(
            Session.from_user_message("q"),
            Session.from_agent_prompt("a"),
            agent_provider=model,
            tools=[_tool()],
        )
        assert out.stop_reason == "final_answer"
    provider.force_flush()
    stop()
    spans = _decode(received)
    for span, _ in spans:
        assert KEY.encode() not in span.SerializeToString()
    names = [span.name for span, _ in spans]
    assert sorted(names) == sorted(
        ["invoke_agent", "chat fake-model", "execute_tool noop", "chat fake-model"]
    ), names


def hundred_passes_through_map() -> None:
    """`treadle.map` runs passes on the runtime thread; the caller's span is still the parent,
    and an `Agent`'s passes carry its name."""
    import asyncio

    from opentelemetry import trace

    import treadle
    from treadle import Agent, Provider
    from treadle.testing import FakeOpenAIServer

    exporter, _ = _sdk()
    tracer = trace.get_tracer("app")
    with FakeOpenAIServer(script="echo") as server:
        provider = Provider(model="fake-model", base_url=server.base_url, api_key=KEY)
        agent = Agent("mapper", "Answer.", provider=provider)
        with tracer.start_as_current_span("batch") as batch:
            outs = treadle.map(agent, [f"q{i}" for i in range(100)], concurrency=16)
        with tracer.start_as_current_span("single") as single:
            lazy = agent("one more")  # Agent.__call__: the run is submitted to the runtime
            lazy.synchronize()
            awaited = asyncio.run(agent.run("and one awaited"))
        assert all(o.stop_reason == "final_answer" for o in [*outs, lazy, awaited])
    spans, _ = _tree(exporter)
    passes = [s for s in spans if s.name.startswith("invoke_agent")]
    assert len(passes) == 102, len(passes)
    assert {s.name for s in passes} == {"invoke_agent mapper"}
    assert {s.attributes["gen_ai.agent.name"] for s in passes} == {"mapper"}
    in_batch = [s for s in passes if s.parent.span_id == batch.get_span_context().span_id]
    assert len(in_batch) == 100
    assert {s.context.trace_id for s in in_batch} == {batch.get_span_context().trace_id}
    in_single = [s for s in passes if s.parent.span_id == single.get_span_context().span_id]
    assert len(in_single) == 2
    chats = [s for s in spans if s.name.startswith("chat")]
    assert {c.parent.span_id for c in chats} == {p.context.span_id for p in passes}


def worker_tracing() -> None:
    """The `worker_init` of `process_backend`: each worker exports its spans over OTLP/HTTP to
    the endpoint in `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (inherited from the driver)."""
    import os

    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": "treadle-worker", "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def process_backend() -> None:
    """Passes on worker processes are children of the map caller's span (W3C carrier in each
    item); the workers export over OTLP/HTTP to a receiver on 127.0.0.1."""
    import os

    from opentelemetry import trace

    import treadle
    from treadle.testing import FakeOpenAIServer
    from treadle.testing.sample_tools import shout_script, shouter

    _sdk()
    endpoint, received, stop = _otlp_receiver()
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = endpoint
    os.environ["OPENAI_API_KEY"] = KEY  # the workers read the key from their environment
    tracer = trace.get_tracer("app")
    with FakeOpenAIServer(script=shout_script) as server:
        agent = shouter(server.base_url)
        with tracer.start_as_current_span("batch") as batch:
            outs = treadle.map(
                agent,
                [f"q{i}" for i in range(8)],
                backend="process",
                workers=2,
                worker_init="otel_export_scenarios:worker_tracing",
            )
        assert all(f'"Q{i}"' in (o.final_text or "") for i, o in enumerate(outs))
    stop()  # the map returned after its workers exited, flushing their spans
    spans = _decode(received)
    for span, _ in spans:
        assert KEY.encode() not in span.SerializeToString()
    caller = batch.get_span_context()
    passes = [s for s, _ in spans if s.name == "invoke_agent shouter"]
    assert len(passes) == 8, [s.name for s, _ in spans]
    assert {s.trace_id for s in passes} == {caller.trace_id.to_bytes(16, "big")}
    assert {s.parent_span_id for s in passes} == {caller.span_id.to_bytes(8, "big")}
    pass_ids = {s.span_id for s in passes}
    children = [s for s, _ in spans if s.name in ("chat fake", "execute_tool shout")]
    assert len(children) == 8 * 3 and {s.parent_span_id for s in children} == pass_ids
    pids = {resource["process.pid"] for _, resource in spans}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2, pids


def ray_backend() -> None:
    """Like `process_backend`, on the Ray instance `make test-ray` started (RAY_TMPDIR is
    inherited); the actors get the exporter's endpoint from the job's `runtime_env`. Run by
    tests/test_distributed_ray.py, not by test_telemetry.py (it needs Ray)."""
    import os

    import ray
    from opentelemetry import trace

    import treadle
    from treadle.testing import FakeOpenAIServer
    from treadle.testing.sample_tools import shout_script, shouter

    _sdk()
    endpoint, received, stop = _otlp_receiver()
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint, "OPENAI_API_KEY": KEY}
    ray.init(address="auto", runtime_env={"env_vars": env}, log_to_driver=False)
    tracer = trace.get_tracer("app")
    try:
        with FakeOpenAIServer(script=shout_script) as server:
            with tracer.start_as_current_span("batch") as batch:
                outs = treadle.map(
                    shouter(server.base_url),
                    [f"q{i}" for i in range(6)],
                    backend="ray",
                    workers=2,
                    worker_init="otel_export_scenarios:worker_tracing",
                )
            assert all(o.stop_reason == "final_answer" for o in outs)
    finally:
        ray.shutdown()
    stop()
    spans = _decode(received)
    caller = batch.get_span_context()
    passes = [s for s, _ in spans if s.name == "invoke_agent shouter"]
    assert len(passes) == 6, [s.name for s, _ in spans]
    assert {s.trace_id for s in passes} == {caller.trace_id.to_bytes(16, "big")}
    assert {s.parent_span_id for s in passes} == {caller.span_id.to_bytes(8, "big")}
    assert os.getpid() not in {resource["process.pid"] for _, resource in spans}


EXPORT_SCENARIOS: dict[str, Callable[[], None]] = {
    "otlp_http": otlp_http,
    "hundred_passes_through_map": hundred_passes_through_map,
    "process_backend": process_backend,
}
"""The scenarios `tests/test_telemetry.py` runs (`ray_backend` runs under `make test-ray`)."""
