"""How docs/img/trace-fanout.png was made: a traced fan-out exported to Arize Phoenix.

Phoenix (an OTLP trace viewer) ran in a throwaway venv, never a Treadle dependency:

    python -m venv /tmp/phoenix && /tmp/phoenix/bin/pip install arize-phoenix
    PHOENIX_HOST=127.0.0.1 PHOENIX_PORT=6006 /tmp/phoenix/bin/phoenix serve

then `python docs/img/trace_fanout.py 6006` sent this trace (20 passes of two tool rounds through
`treadle.map`, against the fake server at 120 ms per reply), and headless Chromium took the
picture of the trace's page:

    chromium --headless --no-sandbox --virtual-time-budget=15000 --window-size=1600,1100 \
        --screenshot=docs/img/trace-fanout.png \
        "http://127.0.0.1:6006/projects/<project id>/traces/<trace id>?selectedSpanNodeId=<span>"
"""

import asyncio
import sys

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import treadle
from treadle import Agent, Provider, tool
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import tool_loop


@tool
async def lookup(round: int) -> dict[str, int]:
    """Look something up for `round`."""
    await asyncio.sleep(0.04)
    return {"round": round}


def main(port: str) -> None:
    """Run the fan-out under one span and export it to Phoenix on `port`."""
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": "treadle-fanout"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    tracer = trace.get_tracer("fanout-demo")
    script = tool_loop(rounds=2, tool_name="lookup")
    with FakeOpenAIServer(script=script, latency_ms=120) as server:
        model = Provider(model="gpt-4o-mini", base_url=server.base_url, api_key="sk-demo")
        agent = Agent("researcher", "Use the tool, then answer.", tools=[lookup], provider=model)
        with tracer.start_as_current_span("nightly batch: 20 documents"):
            treadle.map(agent, [f"document {i}" for i in range(20)], concurrency=8)
    provider.force_flush()


if __name__ == "__main__":
    main(sys.argv[1])
