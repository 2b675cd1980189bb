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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import anyio

from treadle.errors import BudgetExceededError
from treadle.llm.request import CompletionRequest
from treadle.llm.turn import AssistantTurn, HttpExecutor, TurnDelta, request_turn
from treadle.loop.callbacks import CallbackPump
from treadle.loop.control import (
    GuardrailInput,
    PassControl,
    Tripwire,
    approval_decision,
    call_user,
)
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
from treadle.loop.plan import PassPlan, pending_tool_calls, plain_metadata
from treadle.persist.writer import SessionWriter
from treadle.session import ChunkRow, ChunkTable, Session, SessionData, ToolCall, Usage
from treadle.session.rows import in_call_order
from treadle.stores import ConversationJournal, open_conversation
from treadle.telemetry import capturing_content, finish_pass, start_pass
from treadle.telemetry.hooks import PassTrace
from treadle.tools import ToolContext, ToolOutcome, run_tool_calls

__all__ = ["PassPlan", "pending_tool_calls", "run_pass"]


_NO_TOOLS = {"tool_choice": "none"}


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
        self.budget_fired = False
        self.budget_stop = False
        self.writer: SessionWriter | None = None
        self.journal: ConversationJournal | None = None  # the store's side, with store=
        self.pump = CallbackPump(plan.on_event) if plan.on_event is not None else None
        self.events = Emitter(out_id, plan.emit) if plan.emit is not None else None
        self.control = PassControl(out_id)
        self.user_metadata: Mapping[str, Any] = {}
        self.trace: PassTrace | None = None
        limits = plan.limits
        self.max_steps = limits.max_steps or plan.max_tool_rounds
        self.deadline = (
            time.monotonic() + limits.deadline_seconds if limits.deadline_seconds else None
        )

    # -- building blocks ---------------------------------------------------------------------
    def data(self, stop_reason: str) -> SessionData:
        return SessionData(self.table, self.usage, stop_reason, self.metadata)

    @contextmanager
    def snapshot(self) -> Iterator[Session]:
        """The output so far, as the `Session` tools and callbacks see; its sandbox share is
        released when the step ends rather than whenever it is garbage collected."""
        plan = self.plan
        session = Session._derive(
            SessionData(self.table, self.usage, None, dict(self.metadata)),
            operator="run_session_loop",
            kind="output",
            parents=[plan.user, plan.agent],
            sandbox=plan.user.sandbox_handle,
            id=self.out_id,
        )
        try:
            yield session
        finally:
            session.close_sandbox()

    async def append(self, rows: Sequence[ChunkRow], *, boundary: bool) -> None:
        self.keep(rows)
        if self.writer is not None:
            await self.writer.rows(rows, turn_boundary=boundary)
        if self.journal is not None:
            await self.journal.rows(rows, turn_boundary=boundary)

    def keep(self, rows: Sequence[ChunkRow]) -> None:
        """Add rows to the transcript (already persisted, or nothing persists)."""
        self.table = self.table.extend(rows)
        self.messages_json.extend(r.message_json() for r in rows)

    def request(self, extra: Mapping[str, Any] | None = None) -> CompletionRequest:
        plan = self.plan
        return CompletionRequest(
            session_id=self.out_id,
            provider=plan.provider,
            agent_rows=self.agent_rows,
            rows=self.table,
            tools=plan.tools,
            stream=plan.stream,
            # Only the HTTP executor consumes the growing list at once; custom executors may keep
            # the request, so they get the immutable rows and build bodies from those.
            messages_json=self.messages_json if isinstance(plan.executor, HttpExecutor) else (),
            extra=extra,
        )

    async def complete(self, request: CompletionRequest) -> AssistantTurn:
        sink = self.on_delta if self.pump is not None or self.events is not None else None
        trace = self.trace
        if trace is None:
            return await request_turn(self.plan.executor, request, sink)
        provider = self.plan.provider
        trace.start_chat(
            provider.model if provider is not None else None,
            request.messages() if capturing_content() else None,
        )
        try:
            turn = await request_turn(self.plan.executor, request, sink)
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

    async def notify(self, row: ChunkRow) -> None:
        """Hand a new row to `on_message` (which may interrupt the pass)."""
        callback = self.plan.on_message
        if callback is not None:
            await call_user(callback, row, self.control)

    def interrupt(self, reason: str) -> str:
        self.metadata["interrupt_reason"] = reason
        if self.events is not None:
            self.events.emit(Interrupted, reason=reason)
        return "interrupted"

    # -- the pass ---------------------------------------------------------------------------
    async def rounds(self) -> str:
        rounds = 0
        unanswered = pending_tool_calls(self.table)
        if unanswered:  # resume: calls the model asked for that never got a result run first
            stop = await self.tool_round(unanswered, resuming=True)
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
            request = self.request()
            tripped = await self.guard("before", request, None)
            if tripped is not None:
                return tripped
            turn = await self.complete_in_time(request)
            if turn is None:
                return "deadline"
            self.count(turn.usage)
            tripped = await self.guard("after", request, turn)
            if tripped is not None:
                return tripped
            row = ChunkRow._trusted("assistant", turn.payload)
            if self.pump is not None:
                await self.pump.drain()  # deltas reach the callback before the row they build
            calls = row.calls
            await self.append([row], boundary=not calls)
            if self.events is not None:
                self.events.emit(AssistantRowEvent, row=row)
            await self.notify(row)
            await self.check_budget()
            if self.control.interrupted:
                return self.interrupt(self.control.reason or "interrupted")
            if not calls:
                return "final_answer"
            stop = await self.tool_round(calls)
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

    async def guard(
        self, when: str, request: CompletionRequest, turn: AssistantTurn | None
    ) -> str | None:
        guards = [g for g in self.plan.guardrails if g.when == when]
        if not guards:
            return None
        reply = turn.completion if turn is not None else None
        with self.snapshot() as session:
            data = GuardrailInput(session=session, request=request, reply=reply)
            for guard in guards:
                tripwire = await guard.run(data)
                if tripwire is not None:
                    return self.block(tripwire)
        return None

    def block(self, tripwire: Tripwire) -> str:
        self.metadata["tripwire"] = tripwire
        if self.events is not None:
            self.events.emit(GuardrailTripped, tripwire=tripwire)
        return "blocked"

    async def tool_round(self, calls: Sequence[ToolCall], *, resuming: bool = False) -> str | None:
        plan = self.plan
        waiting = [
            c
            for c in calls
            if c.name in plan.tools
            and plan.tools[c.name].needs_approval
            and approval_decision(plan.approvals, c.id) is None
        ]
        if waiting:
            self.metadata["pending_approvals"] = [
                {"id": c.id, "name": c.name, "arguments": c.arguments} for c in waiting
            ]
            names = ", ".join(c.name for c in waiting)
            return self.interrupt(f"approval required for {names}")
        self.metadata.pop("pending_approvals", None)
        denied: dict[str, str] = {}
        for c in calls:
            decision = approval_decision(plan.approvals, c.id)
            if decision is False or isinstance(decision, str):
                denied[c.id] = decision if isinstance(decision, str) else ""
        if self.events is not None:
            for c in calls:
                if c.id not in denied:
                    self.events.emit(ToolStarted, call_id=c.id, name=c.name, arguments=c.arguments)
        unknown: set[str] = set()
        if resuming:
            unknown = set(self.user_metadata.get("unknown_outcome_tool_calls", ()))
        if self.writer is not None:  # before any tool runs: a crash leaves its intent behind
            await self.writer.intents([(c.id, c.name) for c in calls if c.id not in denied])
        if self.journal is not None:
            await self.journal.intents([(c.id, c.name) for c in calls if c.id not in denied])
        finished: dict[int, ChunkRow] = {}

        async def on_outcome(index: int, outcome: ToolOutcome) -> None:
            c = calls[index]
            row = ChunkRow._trusted(
                "tool_result", {"tool_call_id": c.id, "name": c.name, "content": outcome.content}
            )
            finished[index] = row
            if self.writer is not None:  # as it finishes: a crash later keeps a known result
                await self.writer.rows([row], turn_boundary=True)
            if self.journal is not None:
                await self.journal.rows([row], turn_boundary=True)

        try:
            with self.snapshot() as session:
                await run_tool_calls(
                    calls,
                    plan.tools,
                    context=ToolContext(
                        session,
                        self.out_id,
                        self.deadline,
                        tool_timeout=plan.limits.tool_timeout_seconds,
                    ),
                    executor=plan.executor,
                    denied=denied,
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
        for row in rows:
            if self.events is not None:
                self.events.emit(ToolResultEvent, row=row)
            await self.notify(row)
        if self.control.interrupted:
            return self.interrupt(self.control.reason or "interrupted")
        return None

    async def check_budget(self) -> None:
        total = self.pass_usage.total_tokens
        cap = self.plan.limits.max_total_tokens
        if cap is not None and total >= cap:
            self.budget_stop = True
        provider = self.plan.provider
        budget = provider.budget_total_tokens if provider is not None else None
        if budget is None or self.budget_fired or total < budget:
            return
        self.budget_fired = True  # fires once per pass, when the total first crosses the cap
        callback = provider.on_budget_exceeded if provider is not None else None
        if callback is None:  # no one to ask: the budget is a limit, the pass stops
            self.budget_stop = True
            self.metadata["budget_message"] = (
                f"the pass used {total} tokens, over its budget of {budget}"
            )
            return
        try:
            with self.snapshot() as session:
                await call_user(callback, session, self.pass_usage)
        except BudgetExceededError as err:
            self.budget_stop = True
            self.metadata["budget_message"] = str(err)

    async def final_answer(self) -> None:
        """One last completion with tools switched off, after a limit stopped the pass."""
        turn = await self.complete(self.request(_NO_TOOLS))
        payload = dict(turn.payload)
        payload.pop("tool_calls", None)  # a model that calls tools anyway: keep its text only
        self.count(turn.usage)
        row = ChunkRow._trusted("assistant", payload)
        if self.pump is not None:
            await self.pump.drain()
        await self.append([row], boundary=True)
        if self.events is not None:
            self.events.emit(AssistantRowEvent, row=row)


async def run_pass(plan: PassPlan, out_id: str, *, cancel_as_stop: bool = False) -> SessionData:
    """Run one agent pass and return the output session's data.

    With `cancel_as_stop` (the lazy path, where the runtime owns the task) a cancellation ends
    the pass with `stop_reason == "cancelled"` and the transcript so far; otherwise it propagates.
    """
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
        if plan.store is not None and plan.conversation is not None:
            start = await open_conversation(
                plan.store.backend, plan.conversation, out_id, user.table.rows, run.agent_rows
            )  # the stored conversation first, then the input (see treadle.stores.journal)
            run.journal = start.journal
            run.table, run.usage = ChunkTable(start.rows), start.usage
            run.user_metadata = start.metadata
            user = SessionData(run.table, run.usage, None, start.metadata)
        started = True
        run.messages_json = [r.message_json() for r in (*run.agent_rows, *user.table)]
        if run.events is not None:
            run.events.emit(PassStarted, rows=len(user.table))
        if plan.persist_path is not None:
            run.writer = SessionWriter(plan.persist_path)
            await run.writer.open(
                session_id=out_id,
                parent_ids=(plan.user.id, plan.agent.id),
                operator="run_session_loop",
                placement=plan.user.placement,
                placement_options=plan.user.placement_spec,
                agent_rows=run.agent_rows,
                rows=user.table.rows,
            )
            run.metadata["path"] = str(plan.persist_path)
        stop_reason = await run.rounds()
        if plan.limits.final_answer_on_limit and stop_reason in ("max_steps", "budget"):
            await run.final_answer()
        if run.pump is not None:
            await run.pump.drain()
        if run.writer is not None:
            await run.writer.finish(
                usage=run.usage, stop_reason=stop_reason, metadata=plain_metadata(run.metadata)
            )
        if run.journal is not None:  # one transaction: the whole pass, or ConflictError
            run.metadata["version"] = await run.journal.finish(
                run.table.rows,
                usage=run.usage,
                stop_reason=stop_reason,
                metadata=plain_metadata(run.metadata),
            )
            run.metadata["conversation"] = run.journal.key
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
            if run.writer is not None:
                await run.writer.aclose()  # no trailer: readers see the pass did not end cleanly
            if run.journal is not None:  # nothing committed: the conversation is as it was
                await run.journal.aclose(err)
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
            return run.data("cancelled")
        raise
    if traced is not None:
        usage = run.pass_usage
        finish_pass(traced, stop_reason, usage.prompt_tokens, usage.completion_tokens)
    return run.data(stop_reason)
