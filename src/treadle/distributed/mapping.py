"""Distributed fan-out: `map_outcomes` (stream of `PassOutcome`s), and the `remote_amap` /
`remote_map_iter` forms `treadle.map(..., backend="process" | "ray")` dispatches to.

The agent becomes an `AgentSpec`, sessions become `PassItem`s as workers have room for them, and
outcomes come back as they finish (optionally appended to a JSONL results file). Delivery is
at-least-once: a pass in flight on a worker that dies runs again elsewhere. This module must never
pull more inputs than the workers have room for, and never ship an API key.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Iterable
from typing import Any, Literal

import pydantic

from treadle.agents.progress import Progress, known_length, settle_results
from treadle.distributed.driver import FailedInput, WorkerPool, drive
from treadle.distributed.outcome import PassFailed, PassOutcome, pass_failure, received_session
from treadle.distributed.results import ResultsWriter
from treadle.distributed.spec import (
    DEFAULT_API_KEY_ENV,
    AgentSpec,
    check_key_reaches_workers,
    explicit_key,
    import_path,
    resolve_tool,
)
from treadle.errors import ConfigurationError
from treadle.session import Session
from treadle.telemetry import capture_parent, inject_parent

__all__ = [
    "DEFAULT_CALL_GRACE",
    "DEFAULT_MAX_ATTEMPTS",
    "REMOTE_BACKENDS",
    "map_outcomes",
    "remote_amap",
    "remote_map_iter",
]

#: The backends served by this package.
REMOTE_BACKENDS = ("process", "ray")
#: Attempts per pass (first run plus retries after a worker died) when not given.
DEFAULT_MAX_ATTEMPTS = 3
#: Seconds past `pass_timeout` the driver waits for a worker's answer before declaring it lost.
DEFAULT_CALL_GRACE = 60.0

RateLimitMode = Literal["split", "shared"]


def _check(
    backend: str, concurrency: int, max_attempts: int, rate_limit: str, workers: int | None
) -> None:
    if backend not in REMOTE_BACKENDS:
        raise ConfigurationError(
            f"backend={backend!r} is not a distributed backend; use 'process' or 'ray'."
        )
    for name, value in (("concurrency", concurrency), ("max_attempts", max_attempts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name} must be an int >= 1, got {value!r}.")
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
    ):
        raise ConfigurationError(f"workers must be an int >= 1 or None, got {workers!r}.")
    if rate_limit not in ("split", "shared"):
        raise ConfigurationError(f"rate_limit must be 'split' or 'shared', got {rate_limit!r}.")
    if rate_limit == "shared" and backend != "ray":
        raise ConfigurationError(
            "rate_limit='shared' needs backend='ray' (it is a named Ray actor); the process "
            "backend splits the limit between its workers."
        )


async def map_outcomes(
    agent: Any,
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    backend: str = "process",
    workers: int | None = None,
    concurrency: int = 64,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    pass_timeout: float | None = None,
    call_timeout: float | None = None,
    results_path: str | None = None,
    rate_limit: RateLimitMode = "split",
    sandbox_base: str | None = None,
    ray_address: str | None = None,
    api_key_env: str = DEFAULT_API_KEY_ENV,
    worker_init: str | Callable[[], object] | None = None,
) -> AsyncGenerator[PassOutcome, None]:
    """Run `agent` over `sessions` on worker processes; yield a `PassOutcome` as each ends.

    Args:
        agent: An `Agent` (with a `Provider`), `"package.module:agent"`, or an `AgentSpec`.
            An agent with structured output, guardrails, validators, hooks or handoffs crosses
            by its import path: define it at the top level of an importable module.
        sessions: Sessions or user-message strings, from any iterable or async iterable; pulled
            only as workers have room.
        backend: `"process"` (this machine's cores) or `"ray"` (a Ray cluster).
        workers: Worker processes (default: one per CPU of this machine / of the cluster).
        concurrency: Passes in flight per worker.
        max_attempts: Attempts per pass when workers die with it in flight.
        pass_timeout: Seconds one pass may run; past it the outcome has status `"timeout"`.
        call_timeout: Seconds the driver waits for a worker's answer before treating the worker
            as lost (default: `pass_timeout` + 60, or no limit without `pass_timeout`).
        results_path: Also append each outcome as one JSON line to this file.
        rate_limit: `"split"` divides the configured limits between workers; `"shared"` (Ray
            only) makes requests-per-minute one token bucket for all workers. The limits the
            endpoint reports are shared by the workers either way (no configuration).
        sandbox_base: Directory under which workers make their sandbox roots.
        ray_address: Ray cluster to connect to when Ray is not initialised (`"auto"`, an
            address, or None for a local instance).
        api_key_env: Environment variable each worker reads the API key from.
        worker_init: A top-level function (or its `package.module:function` path) each worker
            process calls once before it builds the agent, e.g. to configure OpenTelemetry
            there (docs/observability.md).

    Outcomes arrive in completion order; `outcome.index` is the input position. When tracing
    is on, the span current here is the parent of every pass's span on the workers.
    """
    stream = _outcomes(
        agent,
        sessions,
        backend=backend,
        workers=workers,
        concurrency=concurrency,
        max_attempts=max_attempts,
        pass_timeout=pass_timeout,
        call_timeout=call_timeout,
        results_path=results_path,
        rate_limit=rate_limit,
        sandbox_base=sandbox_base,
        ray_address=ray_address,
        api_key_env=api_key_env,
        worker_init=worker_init,
    )
    try:
        async for outcome in stream:
            yield outcome._public()  # `messages`, not the worker's rows
    finally:
        await stream.aclose()


async def _outcomes(
    agent: Any,
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    backend: str = "process",
    workers: int | None = None,
    concurrency: int = 64,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    pass_timeout: float | None = None,
    call_timeout: float | None = None,
    results_path: str | None = None,
    rate_limit: RateLimitMode = "split",
    sandbox_base: str | None = None,
    ray_address: str | None = None,
    api_key_env: str = DEFAULT_API_KEY_ENV,
    worker_init: str | Callable[[], object] | None = None,
) -> AsyncGenerator[PassOutcome, None]:
    """`map_outcomes`, each output's rows left in the form its worker sent them
    (`PassOutcome.rows`): what `treadle.map` builds its output sessions from."""
    _check(backend, concurrency, max_attempts, rate_limit, workers)
    if isinstance(agent, str):  # "package.module:agent": the caller's process imports it too
        agent = resolve_tool(import_path(agent, "agent"))
    spec = AgentSpec.from_agent(agent, api_key_env=api_key_env)
    init = import_path(worker_init, "worker_init") if worker_init is not None else None
    trace_context = inject_parent(capture_parent()) or None
    if call_timeout is None and pass_timeout is not None:
        call_timeout = pass_timeout + DEFAULT_CALL_GRACE
    pool: Any
    if backend == "process":
        from treadle.distributed.process import ProcessPool

        pool = ProcessPool(
            spec.to_json(),
            size=workers,
            sandbox_base=sandbox_base,
            pass_timeout=pass_timeout,
            api_key=explicit_key(agent),
            worker_init=init,
        )
    else:
        check_key_reaches_workers(spec.name, explicit_key(agent), api_key_env)
        from treadle.distributed.ray_backend import RayPool

        pool = RayPool(
            spec.to_json(),
            size=workers,
            concurrency=concurrency,
            sandbox_base=sandbox_base,
            pass_timeout=pass_timeout,
            rate_limit=rate_limit,
            requests_per_minute=spec.requests_per_minute,
            address=ray_address,
            worker_init=init,
        )
    writer = ResultsWriter(results_path) if results_path is not None else None
    try:
        await pool.start()
        try:
            stream = drive(
                _as_pool(pool),
                sessions,
                concurrency=concurrency,
                max_attempts=max_attempts,
                call_timeout=call_timeout,
                trace_context=trace_context,
            )
            try:
                async for outcome in stream:
                    if writer is not None:  # an outcome it cannot write becomes an error
                        outcome = writer.write(outcome._public())
                    yield outcome
            finally:
                await stream.aclose()
        finally:
            await asyncio.shield(pool.close())
    finally:
        if writer is not None:
            await asyncio.to_thread(writer.close)


def _as_pool(pool: Any) -> WorkerPool:
    return pool  # type: ignore[no-any-return]


def _result(outcome: PassOutcome, agent: Any) -> Session | BaseException:
    if isinstance(outcome, FailedInput) and outcome.cause is not None:
        return outcome.cause  # the input's own pass failed: its error, as an in-process map
    if not outcome.ok:
        return pass_failure(outcome)
    try:  # from this map's own worker: no second validation
        session = received_session(outcome)
    except PassFailed as failure:  # rows no worker of this version sends: this item fails
        return failure
    except ConfigurationError as error:  # (a message or a row the validating rebuild refused)
        reason = f"MalformedOutput: the worker's output: {error}"
        return PassFailed(dataclasses.replace(outcome._public(), status="error", error=reason))
    value = outcome.metadata.get("output")
    output_type = _answering_type(agent, outcome.metadata)
    if output_type is None or not isinstance(value, dict):
        return session
    # The worker's validated output crossed as JSON; here it is the answering agent's type
    # again. A rebuild that fails (the caller's type differs from the worker's) fails this
    # item alone, with the outcome, rather than the whole map.
    try:
        output = output_type.model_validate(value)
    except pydantic.ValidationError as error:
        name = getattr(output_type, "__name__", repr(output_type))
        reason = f"OutputRebuildError: the output could not be rebuilt here as {name}: {error}"
        failed = dataclasses.replace(outcome._public(), status="error", error=reason)
        return PassFailed(failed)
    return session.with_data(metadata={**session.data.metadata, "output": output})


def _answering_type(agent: Any, metadata: dict[str, Any]) -> Any:
    """The output type of the agent that answered: the top agent's, or the one reached by
    following the recorded transfers (`metadata["handoffs"]`) through the handoffs' targets."""
    if agent is None:
        return None
    for transfer in metadata.get("handoffs") or ():
        to = transfer.get("to") if isinstance(transfer, dict) else None
        nxt = next((h.agent for h in getattr(agent, "handoffs", ()) if h.agent.name == to), None)
        if nxt is None:
            return None  # not this agent's graph (another version): leave the output as data
        agent = nxt
    return getattr(agent, "output_type", None)


def _local_agent(agent: Any) -> Any:
    """The agent whose types outputs are rebuilt as here, also when it is named by its path or
    given as a spec that crosses by path (None for a spec without one)."""
    if isinstance(agent, AgentSpec):
        agent = agent.agent_path
    if isinstance(agent, str):
        agent = resolve_tool(import_path(agent, "agent"))
    return agent


async def remote_map_iter(
    agent: Any, sessions: Iterable[Any] | AsyncIterable[Any], **options: Any
) -> AsyncGenerator[tuple[int, Session | BaseException], None]:
    """`treadle.map_iter` on a distributed backend: `(index, output session or
    PassFailed)` as each pass ends (options as for `map_outcomes`)."""
    local = _local_agent(agent)
    stream = _outcomes(agent, sessions, **options)
    try:
        async for outcome in stream:
            yield outcome.index, _result(outcome, local)
    finally:
        await stream.aclose()


async def remote_amap(
    agent: Any,
    sessions: Iterable[Any] | AsyncIterable[Any],
    *,
    progress: bool = False,
    return_exceptions: bool = False,
    **options: Any,
) -> list[Any]:
    """`treadle.amap` on a distributed backend: output sessions in input order.

    A failed pass is a `PassFailed` (with its `outcome`) in its place with
    `return_exceptions=True`; otherwise the first failure is raised once every pass ended.
    """
    bar = Progress.create(known_length(sessions)) if progress else None
    results: list[Any] = []
    try:
        async for index, result in remote_map_iter(agent, sessions, **options):
            if index >= len(results):
                results.extend([None] * (index + 1 - len(results)))
            results[index] = result
            if bar is not None:
                bar.advance(failed=isinstance(result, BaseException))
    finally:
        if bar is not None:
            bar.close()
    return settle_results(results, return_exceptions)
