"""The pass coroutine: request a completion, run the tool calls it asks for, append rows, repeat.

Row order is the contract: the assistant row (with its tool calls) is appended before any tool
runs, then one `tool_result` row per call, in call order. The pass keeps the JSON of every message
it sends in a list it only appends to, so a round's request body is a join of cached bytes and
per-round work does not grow with the transcript beyond that join.

Only tool problems are caught (and reported to the model); provider errors, callback errors and
configuration errors propagate and fail the pass. Nothing here blocks the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from treadle.errors import BudgetExceededError
from treadle.llm.provider import Provider
from treadle.llm.wire import ChatCompletion
from treadle.loop.callbacks import CallbackPump
from treadle.loop.executor import (
    CompletionRequest,
    HttpExecutor,
    call_complete,
    completion_to_delta,
    parse_completion,
)
from treadle.loop.tool_round import pending_tool_calls, run_round
from treadle.persist.writer import SessionWriter
from treadle.session import ChunkRow, ChunkTable, Session, SessionData, Usage
from treadle.tools import ToolSet

__all__ = ["PassPlan", "run_pass"]

log = logging.getLogger("treadle.loop")


@dataclass(slots=True)
class PassPlan:
    """Everything a pass needs, validated at the call (before anything runs)."""

    user: Session
    agent: Session
    provider: Provider | None
    tools: ToolSet
    executor: object
    max_tool_rounds: int
    on_event: Callable[[Any], Any] | None
    persist_path: Path | None
    stream: bool
    extras: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _State:
    """The growing transcript of one pass."""

    table: ChunkTable
    messages_json: list[bytes]
    usage: Usage
    pass_usage: Usage = field(default_factory=Usage)
    budget_fired: bool = False
    budget_stop: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


async def run_pass(plan: PassPlan, out_id: str) -> SessionData:
    """Run one agent pass and return the output session's data."""
    user = await plan.user.wait_ready()
    agent = await plan.agent.wait_ready()
    agent_rows = agent.table.rows
    state = _State(
        table=user.table,
        messages_json=[r.message_json() for r in (*agent_rows, *user.table)],
        usage=user.usage,
    )
    writer: SessionWriter | None = None
    if plan.persist_path is not None:
        writer = SessionWriter(plan.persist_path)
        await writer.open(
            session_id=out_id,
            parent_ids=(plan.user.id, plan.agent.id),
            operator="run_session_loop",
            placement=plan.user.placement,
            agent_rows=agent_rows,
            rows=user.table.rows,
        )
        state.metadata["path"] = str(plan.persist_path)
    pump = CallbackPump(plan.on_event) if plan.on_event is not None else None
    snapshot = _Snapshots(plan, out_id)
    try:
        stop_reason = await _rounds(plan, out_id, agent_rows, state, writer, pump, snapshot, user)
        if pump is not None:
            await pump.drain()
        if writer is not None:
            await writer.finish(usage=state.usage, stop_reason=stop_reason, metadata={})
    except BaseException:
        with anyio.CancelScope(shield=True):
            if pump is not None:
                await pump.aclose()
            if writer is not None:
                await writer.aclose()
        raise
    return SessionData(state.table, state.usage, stop_reason, state.metadata)


class _Snapshots:
    """Builds the `Session` that tools and budget callbacks see: the output so far."""

    def __init__(self, plan: PassPlan, out_id: str) -> None:
        self._plan = plan
        self._out_id = out_id

    def __call__(self, state: _State) -> Session:
        return Session._derive(
            SessionData(state.table, state.usage, None, dict(state.metadata)),
            operator="run_session_loop",
            kind="output",
            parents=[self._plan.user, self._plan.agent],
            sandbox=self._plan.user.sandbox_handle,
            id=self._out_id,
        )


async def _append(
    state: _State, rows: Sequence[ChunkRow], writer: SessionWriter | None, *, boundary: bool
) -> None:
    state.table = state.table.extend(rows)
    state.messages_json.extend(r.message_json() for r in rows)
    if writer is not None:
        await writer.rows(rows, turn_boundary=boundary)


async def _rounds(
    plan: PassPlan,
    out_id: str,
    agent_rows: Sequence[ChunkRow],
    state: _State,
    writer: SessionWriter | None,
    pump: CallbackPump | None,
    snapshot: _Snapshots,
    user: SessionData,
) -> str:
    rounds = 0
    # Resume: tool calls the model asked for that never got a result run first.
    unanswered = pending_tool_calls(state.table)
    if unanswered:
        unknown = set(user.metadata.get("unknown_outcome_tool_calls", ()))
        results = await run_round(
            unanswered, plan.tools, plan.executor, snapshot(state), writer, unknown
        )
        await _append(state, results, writer, boundary=True)
        rounds += 1
    while True:
        if rounds >= plan.max_tool_rounds:
            return "max_steps"
        if state.budget_stop:
            return "budget"
        request = CompletionRequest(
            session_id=out_id,
            provider=plan.provider,
            agent_rows=agent_rows,
            rows=state.table,
            tools=plan.tools,
            stream=plan.stream,
            # Only the HTTP executor consumes the growing list at once; custom executors may keep
            # the request, so they get the immutable rows and build bodies from those.
            messages_json=state.messages_json if isinstance(plan.executor, HttpExecutor) else (),
        )
        completion = await _complete(plan, request, pump)
        payload, usage = parse_completion(completion)
        state.usage = state.usage + usage
        state.pass_usage = state.pass_usage + usage
        row = ChunkRow._trusted("assistant", payload)
        if pump is not None:
            await pump.drain()  # deltas reach the callback before the row they build
        calls = row.tool_calls
        await _append(state, [row], writer, boundary=not calls)
        await _check_budget(plan, state, snapshot)
        if not calls:
            return "final_answer"
        results = await run_round(calls, plan.tools, plan.executor, snapshot(state), writer, set())
        await _append(state, results, writer, boundary=True)
        rounds += 1


async def _complete(
    plan: PassPlan, request: CompletionRequest, pump: CallbackPump | None
) -> ChatCompletion:
    executor = plan.executor
    if plan.stream and isinstance(executor, HttpExecutor):
        from treadle.llm.accumulate import StreamAccumulator

        acc = StreamAccumulator()
        async for chunk in executor.astream(request):
            acc.add(chunk)
            if pump is not None:
                pump.put(chunk)
        return acc.result()
    completion = await call_complete(executor, request)
    if pump is not None:
        pump.put(completion_to_delta(completion))
    return completion


async def _check_budget(plan: PassPlan, state: _State, snapshot: _Snapshots) -> None:
    provider = plan.provider
    cap = provider.budget_total_tokens if provider is not None else None
    if cap is None or state.budget_fired or state.pass_usage.total_tokens < cap:
        return
    state.budget_fired = True  # fires once per pass, when the total first crosses the cap
    callback = provider.on_budget_exceeded if provider is not None else None
    if callback is None:
        log.warning(
            "pass used %d tokens, over its budget of %d; set on_budget_exceeded to stop it",
            state.pass_usage.total_tokens,
            cap,
        )
        return
    try:
        result = callback(snapshot(state), state.pass_usage)
        if hasattr(result, "__await__"):
            await result
    except BudgetExceededError as err:
        state.budget_stop = True
        state.metadata["budget_message"] = str(err)
