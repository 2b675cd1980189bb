"""Treadle through its public API: `run_session_loop` with a `Provider` and `@tool` tools.

Variants: `lazy` (the default facade: submit passes, then read them from this thread) and
`await` (`arun_session_loop` awaited on the caller's own event loop). `otel` turns tracing on:
`"api"` imports OpenTelemetry's API without configuring it (tracing stays off), `"sdk"` installs
an SDK tracer provider (batch processor, exporter that drops spans) and meter provider.
"""

from __future__ import annotations

import asyncio
from typing import Any

from benchmarks.worker import Meter
from benchmarks.workload import (
    API_KEY,
    MODEL,
    SYSTEM_PROMPT,
    USER_PROMPT,
    WARMUP_PASSES,
    Stamps,
    async_nap,
    noop_result,
    sync_nap,
)
from treadle import Provider, Session, arun_session_loop, run_session_loop, tool

_stamps = Stamps()


@tool
async def noop(round: int) -> dict[str, Any]:
    """Do nothing and report the round."""
    return noop_result(round)


@tool(name="noop")
async def stamped_noop(round: int) -> dict[str, Any]:
    """Do nothing and report the round (recording when it ran)."""
    _stamps.mark()
    return noop_result(round)


nap_async = tool(name="nap")(async_nap)
nap_sync = tool(name="nap")(sync_nap)


def _provider(job: dict[str, Any]) -> Provider:
    options: dict[str, Any] = {}
    keys = ("requests_per_minute", "tokens_per_minute", "learn_rate_limits", "max_retries",
            "first_wave")  # fmt: skip
    for key in keys:
        if key in job:  # the rate-limited goodput and first fan-out scenarios' variants
            options[key] = job[key]
    return Provider(
        model=MODEL,
        base_url=job["url"],
        api_key=API_KEY,
        stream=bool(job.get("stream")),
        **options,
    )


def _ok(out: Session) -> bool:
    try:
        return out.stop_reason == "final_answer"
    except Exception:
        return False


class _DropSpans:
    """A span exporter that drops what it is given: the cost measured is Treadle's and the
    SDK's, not a backend's."""

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _telemetry(mode: str | None) -> None:
    if mode is None:
        return
    from opentelemetry import metrics, trace

    if mode == "api":
        return
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_DropSpans()))  # type: ignore[arg-type]
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))


def serial(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` passes one at a time."""
    _telemetry(job.get("otel"))
    provider, agent = _provider(job), Session.from_agent_prompt(SYSTEM_PROMPT)
    tools = [noop]
    if job.get("variant") == "await":

        async def main() -> int:
            async def one() -> bool:
                user = Session.from_user_message(USER_PROMPT)
                out = await arun_session_loop(user, agent, agent_provider=provider, tools=tools)
                return out.stop_reason == "final_answer"

            for _ in range(WARMUP_PASSES):
                await one()
            meter.start()
            errors = 0
            for _ in range(job["n"]):
                errors += not await one()
            meter.stop()
            return errors

        return {"errors": asyncio.run(main())}

    def one() -> bool:
        user = Session.from_user_message(USER_PROMPT)
        return _ok(run_session_loop(user, agent, agent_provider=provider, tools=tools))

    for _ in range(WARMUP_PASSES):
        one()
    meter.start()
    errors = sum(not one() for _ in range(job["n"]))
    meter.stop()
    return {"errors": errors}


def fanout(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` concurrent passes: submit them all, then read them."""
    provider, agent = _provider(job), Session.from_agent_prompt(SYSTEM_PROMPT)
    tools = [noop]
    user = Session.from_user_message(USER_PROMPT)
    if job.get("variant") == "await":

        async def main() -> int:
            await arun_session_loop(user, agent, agent_provider=provider, tools=tools)
            meter.start()
            outs = await asyncio.gather(
                *(
                    arun_session_loop(user, agent, agent_provider=provider, tools=tools)
                    for _ in range(job["n"])
                ),
                return_exceptions=True,
            )
            meter.stop()
            return sum(not (isinstance(o, Session) and _ok(o)) for o in outs)

        return {"errors": asyncio.run(main())}

    if not job.get("cold"):  # a first fan-out (s10) meets the endpoint new
        _ok(run_session_loop(user, agent, agent_provider=provider, tools=tools))  # warm the pool
    else:  # new endpoint, warm process: the HTTP stack's first import is scenario 5's subject
        import treadle._http.pool
        import treadle.llm.client
        import treadle.llm.transport

        # The engine loads with the first pass (docs/performance.md, imports), not with
        # `from treadle import ...`: loaded here, S10 times the first fan-out, not an import.
        import treadle.llm.turn
        import treadle.loop.api
        import treadle.loop.engine
        import treadle.loop.planning
        import treadle.runtime.background
        import treadle.tools  # noqa: F401
    meter.start()
    outs = [
        run_session_loop(user, agent, agent_provider=provider, tools=tools) for _ in range(job["n"])
    ]
    errors = sum(not _ok(out) for out in outs)
    meter.stop()
    return {"errors": errors}


def growth(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """One pass of many tool rounds; per-round costs from the tool's stamps."""
    provider, agent = _provider(job), Session.from_agent_prompt(SYSTEM_PROMPT)
    limit = job["rounds"] + 5
    warm = run_session_loop(
        Session.from_user_message(USER_PROMPT),
        agent,
        agent_provider=provider,
        tools=[noop],
        max_tool_rounds=limit,
    )
    warm.synchronize()
    _stamps.wall.clear()
    _stamps.cpu.clear()
    meter.start()
    _stamps.mark()
    out = run_session_loop(
        Session.from_user_message(USER_PROMPT),
        agent,
        agent_provider=provider,
        tools=[stamped_noop],
        max_tool_rounds=limit,
    )
    errors = int(not _ok(out))
    meter.stop()
    return {"errors": errors, **_stamps.result()}


def parallel(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """Passes whose every round asks for several sleeping tools at once."""
    provider, agent = _provider(job), Session.from_agent_prompt(SYSTEM_PROMPT)
    tools = [nap_sync if job["tool_kind"] == "sync" else nap_async]
    user = Session.from_user_message(USER_PROMPT)
    _ok(run_session_loop(user, agent, agent_provider=provider, tools=tools))
    meter.start()
    errors = sum(
        not _ok(run_session_loop(user, agent, agent_provider=provider, tools=tools))
        for _ in range(job["n"])
    )
    meter.stop()
    return {"errors": errors}


def fanout_process(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """An uneven map on the process backend: `long` passes (many rounds) fill the first
    worker's slots, `short` ones (one completion) the others'. `shared`: the workers lease the
    learned limits from the driver; otherwise each paces at 1/N of them (the old split)."""
    import treadle.distributed.process as process
    from treadle.agents import Agent
    from treadle.distributed import AgentSpec
    from treadle.distributed.driver import drive

    process.SHARE_LEARNED_LIMITS = bool(job["shared"])
    workers, concurrency = job["workers"], job["concurrency"]
    agent = Agent("uneven", SYSTEM_PROMPT, tools=[noop], provider=_provider(job))
    spec = AgentSpec.from_agent(agent, api_key_env="TREADLE_BENCH_KEY")
    inputs = [f"long {i}" for i in range(job["long"])] + [f"short {i}" for i in range(job["n"])]

    async def main() -> tuple[int, int]:
        pool = process.ProcessPool(spec.to_json(), size=workers, api_key=API_KEY)
        await pool.start()  # worker start-up is not timed
        try:
            meter.start()
            outcomes = [
                o
                async for o in drive(
                    pool, inputs, concurrency=concurrency, max_attempts=1, call_timeout=None
                )
            ]
            meter.stop()
        finally:
            await pool.close()
        return sum(o.status != "ok" for o in outcomes), pool.broker.leases

    errors, leases = asyncio.run(main())
    return {"errors": errors, "leases": leases}
