"""The pass coroutine: request a completion, run the tool calls it asks for, append rows, repeat.

Row order is the contract: the assistant row (with its tool calls) is appended before any tool
runs, then one `tool_result` row per call, in call order. The pass keeps the JSON of every message
it sends in a list it only appends to, so a round's request body is a join of cached bytes and
per-round work does not grow with the transcript beyond that join. Before any tool of a round
runs, the persisted file records an intent per call, so a resume after a crash can tell a call
whose outcome is unknown from one that never started; every call then goes through the one
dispatcher, `treadle.tools.run_tool_calls`.

Every stop (limits, budget, deadline, interrupt, guardrail, cancellation of a lazy pass) ends the
pass with a `stop_reason` and keeps the transcript. Only tool problems are caught (and reported to
the model); provider, guardrail and callback errors propagate and fail the pass. Nothing here
blocks the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from treadle.llm.request import CompletionRequest
from treadle.llm.turn import AssistantTurn, HttpExecutor, TurnDelta, request_turn
from treadle.loop.budget import check_budget, final_answer
from treadle.loop.callbacks import CallbackPump
from treadle.loop.control import GuardrailResult, PassControl, Tripwire, approvals_of, call_user
from treadle.loop.events import (
    AssistantRowEvent,
    Emitter,
    GuardrailTripped,
    Interrupted,
    PassStarted,
    ToolResultEvent,
    ToolStarted,
    UsageEvent,
)
from treadle.loop.guarding import (
    complete_guarded,
    guard_round,
    screen_tool_calls,
    screen_tool_result,
)
from treadle.loop.hooks import HookContext, fire
from treadle.loop.outputs import (
    abandon_outputs,
    finish_outputs,
    open_conversation_of,
    open_transcript,
)
from treadle.loop.plan import PassPlan, pending_tool_calls, unique_call_ids
from treadle.loop.request_usage import request_entries
from treadle.loop.snapshot import NO_SNAPSHOT, Snapshot, blind_round
from treadle.loop.soft_stop import registered
from treadle.loop.tooling import choice_extra, gated_tools, offered, stop_after_tools
from treadle.runtime.busy_gc import RUNNING_PASS
from treadle.runtime.threads import load_async_backend
from treadle.session import ChunkRow, ChunkTable, Session, SessionData, ToolCall, Usage
from treadle.session.rows import in_call_order, valid_text
from treadle.session.stops import StopReason
from treadle.telemetry import capturing_content, finish_pass, start_pass
from treadle.telemetry.hooks import PassTrace
from treadle.tools import Tool, ToolContext, ToolOutcome, run_tool_calls

if TYPE_CHECKING:  # the persist and store modules load with the first pass using them
    from treadle.persist.writer import SessionWriter
    from treadle.stores import ConversationJournal

__all__ = ["PassPlan", "pending_tool_calls", "run_pass"]


class _Pass:
    """The mutable state of one running pass."""

    def __init__(self, plan: PassPlan, out_id: str) -> None:
        self.plan = plan
        self.out_id = out_id
        self.table = ChunkTable()
        self.messages_json: list[bytes] = []
        self.agent_rows: Sequence[ChunkRow] = ()
        self.usage = Usage()
        self.pass_usage = Usage()
        self.metadata: dict[str, Any] = {}
        self.tool_calls_run = 0
        self.tools = plan.tools  # offered in the next request (less tools disabled now)
        self.gated: tuple[Tool, ...] = ()
        self.budget_fired = False
        self.budget_stop = False
        self.writer: SessionWriter | None = None
        self.journal: ConversationJournal | None = None  # the store's side, with store=
        self.pump = CallbackPump(plan.on_event) if plan.on_event is not None else None
        self.events = Emitter(out_id, plan.emit) if plan.emit is not None else None
        self.control = PassControl(out_id)
        self.user_metadata: Mapping[str, Any] = {}
        self.trace: PassTrace | None = None
        self.hooks = plan.hooks
        self.guarded = bool(plan.guardrails)
        self.input_guards = [g for g in plan.guardrails if g.when == "input"]
        self.guard_results: list[GuardrailResult] = []
        self.entries: list[tuple[Any, str, Usage, float, str]] = []
        limits = plan.limits
        self.max_steps = limits.max_steps or plan.max_tool_rounds
        self.deadline = (
            time.monotonic() + limits.deadline_seconds if limits.deadline_seconds else None
        )

    # -- building blocks ---------------------------------------------------------------------
    def data(self, stop_reason: StopReason) -> SessionData:
        return SessionData(self.table, self.usage, stop_reason, self.metadata)

    def settle(self) -> None:
        """Put the per-request entries and guardrail verdicts into the metadata."""
        if self.entries:
            self.metadata["request_usage"] = request_entries(self.entries, self.plan.agent_name)
        if self.guard_results:
            self.metadata["guardrail_results"] = tuple(self.guard_results)

    def hook_context(self) -> HookContext:
        return HookContext(self.plan.agent_name, self.out_id, self.pass_usage)

    def snapshot(self) -> Snapshot:
        """The output so far, as the `Session` tools and callbacks see (`with run.snapshot() as
        session`); its sandbox share is released when the step ends rather than whenever it is
        garbage collected."""
        plan = self.plan
        return Snapshot(
            Session._derive(
                SessionData(self.table, self.usage, None, dict(self.metadata)),
                operator="run_session_loop",
                kind="output",
                parents=[plan.user, plan.agent],
                sandbox=plan.user.sandbox_handle,
                id=self.out_id,
            )
        )

    async def append(self, rows: Sequence[ChunkRow], *, boundary: bool) -> None:
        self.keep(rows)
        if self.writer is not None:
            await self.writer.rows(rows, turn_boundary=boundary)
        if self.journal is not None and (flush := self.journal.rows_soon(rows)) is not None:
            await flush  # a tool result (most rows are only buffered: no coroutine for them)

    def keep(self, rows: Sequence[ChunkRow]) -> None:
        """Add rows to the transcript (already persisted, or nothing persists)."""
        self.table = self.table.extend(rows)
        self.messages_json.extend(r.message_json() for r in rows)

    def request(self, extra: Mapping[str, Any] | None = None) -> CompletionRequest:
        plan = self.plan
        extra = choice_extra(plan, self.tool_calls_run > 0, self.tools, extra)
        return CompletionRequest(
            session_id=self.out_id,
            provider=plan.provider,
            agent_rows=self.agent_rows,
            rows=self.table,
            tools=self.tools,
            stream=plan.stream,
            # Only the HTTP executor consumes the growing list at once; custom executors may keep
            # the request, so they get the immutable rows and build bodies from those.
            messages_json=self.messages_json if isinstance(plan.executor, HttpExecutor) else (),
            extra=extra,
        )

    async def complete(self, request: CompletionRequest) -> AssistantTurn:
        if self.hooks is not None and "on_model_start" in self.hooks.overridden:
            await fire(self.hooks, "on_model_start", self.hook_context(), request.messages())
        started = time.monotonic()
        turn = await self.complete_traced(request)
        # Entries built at the end, from `turn.wire` (a streamed `completion` is built if read).
        wire, reply_id = turn.wire
        latency = time.monotonic() - started
        self.entries.append((wire, reply_id, turn.usage, latency, turn.request_id or reply_id))
        return turn

    async def complete_traced(self, request: CompletionRequest) -> AssistantTurn:
        sink = self.on_delta if self.pump is not None else None
        # Events alone need a delta's text and tool-call pieces, not its chunk (`raw`, which
        # `on_event` receives): the stream then builds no typed chunk per event.
        pieces = self.events.pieces if sink is None and self.events is not None else None
        trace = self.trace
        if trace is None:
            return await request_turn(self.plan.executor, request, sink, on_pieces=pieces)
        provider = self.plan.provider
        trace.start_chat(
            provider.model if provider is not None else None,
            request.messages() if capturing_content() else None,
        )
        try:
            turn = await request_turn(self.plan.executor, request, sink, on_pieces=pieces)
        except BaseException as err:
            trace.end_chat(error=err)
            raise
        trace.end_chat(
            response_id=turn.completion.id,
            response_model=turn.completion.model,
            finish_reason=turn.finish_reason,
            input_tokens=turn.usage.prompt_tokens,
            output_tokens=turn.usage.completion_tokens,
            output=turn.payload,
        )
        return turn

    def on_delta(self, delta: TurnDelta) -> None:
        if self.pump is not None:
            self.pump.put(delta.raw)  # `on_event` receives the provider's chunk as sent
        if self.events is not None:
            self.events.deltas(delta)

    def context(self, session: Session | None) -> ToolContext:
        """The context tools, guardrails and callbacks of this pass see, as of now."""
        plan, limit = self.plan, self.plan.limits.tool_timeout_seconds
        return ToolContext(
            session, self.out_id, self.deadline, None, limit, plan.deps, self.pass_usage
        )

    async def notify(self, row: ChunkRow) -> None:
        """Hand a new row to `on_message` (which may interrupt the pass)."""
        plan = self.plan
        callback = plan.on_message
        if callback is None:
            return
        param = plan.on_message_context
        if param is None:
            await call_user(callback, row, self.control)
            return
        with self.snapshot() as session:
            await call_user(callback, row, self.control, **{param: self.context(session)})

    def interrupt(self, reason: str) -> StopReason:
        self.metadata["interrupt_reason"] = reason = valid_text(reason)  # JSONL = store
        if self.events is not None:
            self.events.emit(Interrupted, reason=reason)
        return "interrupted"

    # -- the pass ---------------------------------------------------------------------------
    async def rounds(self) -> StopReason:
        rounds = 0
        soft = self.plan.stop
        self.tools = self.plan.tools
        self.gated = gated_tools(self.tools)
        unanswered = pending_tool_calls(self.table)
        if unanswered:  # resume: calls the model asked for that never got a result run first
            stop = await self.tool_round(unanswered, resuming=True)
            if stop is None and self.plan.tool_use_behavior != "run_llm_again":
                stop = self.stop_after_tools(unanswered)
            if stop is not None:
                return stop
            rounds += 1
        while True:
            if rounds >= self.max_steps:
                return "max_steps"
            limit = self.plan.limits.max_tool_calls
            if limit is not None and self.tool_calls_run >= limit:
                return "max_steps"
            if self.budget_stop:
                return "budget"
            if self.deadline is not None and time.monotonic() >= self.deadline:
                return "deadline"
            if soft.requested:  # a soft cancel: the last turn finished, start no other
                self.metadata["cancelled"] = True
                self.metadata["cancel_mode"] = "after_turn"
                return "cancelled"
            if self.gated:
                with self.snapshot() as session:
                    self.tools = await offered(self.plan.tools, self.gated, self.context(session))
            request = self.request()
            tripped = await guard_round(self, "before", request, None) if self.guarded else None
            if tripped is not None:
                return tripped
            if self.input_guards:
                turn, trip = await complete_guarded(self, request)
                if trip is not None:
                    return self.block(trip)
            else:
                turn = await self.complete_in_time(request)
            if turn is None:
                return "deadline"
            self.count(turn.usage)
            tripped = await guard_round(self, "after", request, turn) if self.guarded else None
            if tripped is not None:
                return tripped
            row = ChunkRow._trusted("assistant", unique_call_ids(valid_text(turn.payload)))
            if self.pump is not None:
                await self.pump.drain()  # deltas reach the callback before the row they build
            calls = row.calls
            await self.append([row], boundary=not calls)
            if self.events is not None:
                self.events.emit(AssistantRowEvent, row=row)
            if self.hooks is not None:
                await fire(self.hooks, "on_model_end", self.hook_context(), row)
            await self.notify(row)
            await self.check_budget()
            if self.control.interrupted:
                return self.interrupt(self.control.reason or "interrupted")
            if not calls:
                return "final_answer"
            stop = await self.tool_round(calls)
            if stop is None and self.plan.tool_use_behavior != "run_llm_again":
                stop = self.stop_after_tools(calls)
            if stop is not None:
                return stop
            rounds += 1

    async def complete_in_time(self, request: CompletionRequest) -> AssistantTurn | None:
        if self.deadline is None:
            return await self.complete(request)
        with anyio.move_on_after(max(0.0, self.deadline - time.monotonic())):
            return await self.complete(request)
        return None

    def count(self, usage: Usage) -> None:
        self.usage = self.usage + usage
        self.pass_usage = self.pass_usage + usage
        if self.events is not None:
            self.events.emit(UsageEvent, usage=usage, total=self.pass_usage)

    def block(self, tripwire: Tripwire) -> StopReason:
        self.metadata["tripwire"] = tripwire
        if self.events is not None:
            self.events.emit(GuardrailTripped, tripwire=tripwire)
        return "blocked"

    async def tool_round(
        self, calls: Sequence[ToolCall], *, resuming: bool = False
    ) -> StopReason | None:
        plan = self.plan
        started = self.user_metadata.get("unknown_outcome_tool_calls", ()) if resuming else ()
        unknown = set(started)
        prior = self.user_metadata.get("approval_decisions") if resuming else None
        denied = approvals_of(plan.tools, plan.approvals, calls, self.metadata, unknown, prior)
        if denied is None:
            return self.interrupt(self.metadata.pop("approval_reason"))
        rejected: dict[str, str] = {}
        if plan.tool_guardrails:
            screened = await screen_tool_calls(self, calls, denied)
            if isinstance(screened, Tripwire):
                return self.block(screened)
            rejected = screened
        for c in calls:
            if c.id in denied or c.id in rejected:
                continue
            if self.events is not None:
                self.events.emit(ToolStarted, call_id=c.id, name=c.name, arguments=c.arguments)
            if self.hooks is not None:
                await fire(self.hooks, "on_tool_start", self.hook_context(), c)
        if self.writer is not None:  # before any tool runs: a crash leaves its intent behind
            await self.writer.intents([(c.id, c.name) for c in calls if c.id not in denied])
        if self.journal is not None:
            await self.journal.intents([(c.id, c.name) for c in calls if c.id not in denied])
        finished: dict[int, ChunkRow] = {}
        output_guards = [g for g in plan.tool_guardrails if g.when == "tool_output"]
        output_trips: list[Tripwire] = []

        async def on_outcome(index: int, outcome: ToolOutcome) -> None:
            c = calls[index]
            content = valid_text(outcome.content)  # text a file or database can hold
            if c.id in rejected or output_guards:
                content = await screen_tool_result(self, c, content, rejected, output_trips)
            row = ChunkRow._trusted(
                "tool_result", {"tool_call_id": c.id, "name": c.name, "content": content}
            )
            finished[index] = row
            if self.writer is not None:  # as it finishes: a crash later keeps a known result
                await self.writer.rows([row], turn_boundary=True)
            if self.journal is not None:
                await self.journal.rows([row], turn_boundary=True)

        try:
            blind = blind_round(self.tools, calls, plan.executor)  # no snapshot to build
            with NO_SNAPSHOT if blind else self.snapshot() as session:
                await run_tool_calls(
                    calls,
                    self.tools,
                    context=self.context(session),
                    executor=plan.executor,
                    denied={**denied, **rejected} if rejected else denied,
                    unknown_outcome=unknown,
                    on_outcome=on_outcome,
                )
        except BaseException:
            # Cancelled mid-round: keep the results that are known and record the rest as of
            # unknown outcome, as a crash would, so a resume does not run them blindly again.
            self.keep([finished[i] for i in sorted(finished)])
            interrupted = [c.id for i, c in enumerate(calls) if i not in finished]
            if interrupted:
                self.metadata["unknown_outcome_tool_calls"] = interrupted
            raise
        rows = [finished[i] for i in range(len(calls))]
        self.keep(rows)
        if resuming:  # results from before the crash come first; list the round in call order
            self.table = ChunkTable(in_call_order(self.table))
            self.messages_json = [r.message_json() for r in (*self.agent_rows, *self.table)]
        self.tool_calls_run += len(calls)
        for c, row in zip(calls, rows, strict=True):
            if self.events is not None:
                self.events.emit(ToolResultEvent, row=row)
            if self.hooks is not None and c.id not in denied and c.id not in rejected:
                await fire(self.hooks, "on_tool_end", self.hook_context(), c, row)
            await self.notify(row)
        if output_trips:
            return self.block(output_trips[0])
        if self.control.interrupted:
            return self.interrupt(self.control.reason or "interrupted")
        return None

    def stop_after_tools(self, calls: Sequence[ToolCall]) -> StopReason | None:
        """`final_answer` when `tool_use_behavior` makes this round's result the output."""
        rows = self.table.rows[-len(calls) :]
        return stop_after_tools(self.plan.tool_use_behavior, calls, rows, self.metadata)

    async def check_budget(self) -> None:
        await check_budget(self)


async def run_pass(plan: PassPlan, out_id: str, *, cancel_as_stop: bool = False) -> SessionData:
    """Run one agent pass and return the output session's data.

    With `cancel_as_stop` (the lazy path, where the runtime owns the task) a cancellation ends
    the pass with `stop_reason == "cancelled"` and the transcript so far; otherwise it propagates.
    """
    load_async_backend()
    with registered(out_id, plan.stop), RUNNING_PASS:  # counted for the collector (busy_gc)
        return await _run_pass(plan, out_id, cancel_as_stop)


async def _run_pass(plan: PassPlan, out_id: str, cancel_as_stop: bool) -> SessionData:
    run = _Pass(plan, out_id)
    started = False
    traced = None
    if plan.trace_parent is not None:
        provider = plan.provider
        traced = start_pass(
            plan.trace_parent,
            session_id=out_id,
            agent_name=plan.agent_name,
            model=provider.model if provider is not None else None,
            base_url=provider.base_url if provider is not None else None,
        )
        run.trace = traced[0] if traced is not None else None
    try:
        # Inside the try: a cancellation while waiting for a pending input is a clean stop too.
        user = await plan.user.wait_ready()
        agent = await plan.agent.wait_ready()
        if plan.tools.sources:  # MCP servers given as tools: list theirs now, on this loop
            plan.tools = await plan.tools.expanded()
        run.user_metadata = user.metadata
        run.agent_rows = agent.table.rows
        run.table = user.table
        run.usage = user.usage
        user = await open_conversation_of(run, plan, out_id, user)
        started = True
        run.messages_json = [r.message_json() for r in (*run.agent_rows, *user.table)]
        if run.events is not None:
            run.events.emit(PassStarted, rows=len(user.table))
        await open_transcript(run, plan, out_id, user.table.rows)
        stop_reason = await run.rounds()
        if plan.limits.final_answer_on_limit and stop_reason in ("max_steps", "budget"):
            await final_answer(run)
        if run.pump is not None:
            await run.pump.drain()
        run.settle()
        await finish_outputs(run, stop_reason)
    except BaseException as err:
        if traced is not None:
            cancelled = isinstance(err, asyncio.CancelledError)
            usage = run.pass_usage
            finish_pass(
                traced,
                "cancelled" if cancelled else None,
                usage.prompt_tokens,
                usage.completion_tokens,
                None if cancelled and cancel_as_stop else err,
            )
        with anyio.CancelScope(shield=True):
            if run.pump is not None:
                await run.pump.aclose()
            await abandon_outputs(run, err)
        if cancel_as_stop and isinstance(err, asyncio.CancelledError):
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # the runtime owns this task; the stop is the pass's answer
            if not started:
                # Cancelled while an input was still pending: no request was made, but the
                # output still holds the input rows, so wait for them (the input pass is not
                # ours to cancel) without starting anything.
                with anyio.CancelScope(shield=True):
                    user = await plan.user.wait_ready()
                run.table, run.usage = user.table, user.usage
            run.metadata["cancelled"] = True
            run.settle()
            return run.data("cancelled")
        raise
    if traced is not None:
        usage = run.pass_usage
        finish_pass(traced, stop_reason, usage.prompt_tokens, usage.completion_tokens)
    return run.data(stop_reason)
