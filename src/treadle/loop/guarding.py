"""Running guardrails: concurrently with each other, the first request's input guardrails
concurrently with the model call, and tool guardrails around each tool call.

Every verdict becomes a `GuardrailResult` (passing ones too) for the output's
`metadata["guardrail_results"]`, except the runtime's own guards (names starting `treadle.`).
Nothing here runs when a pass has no guardrails. A model call raced by an input guardrail that
trips is cancelled and its usage is never counted. Never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from treadle.loop.control import (
    Guardrail,
    GuardrailInput,
    GuardrailResult,
    ToolGuardrail,
    ToolGuardrailInput,
    Tripwire,
)
from treadle.loop.events import ToolResultEvent
from treadle.session import ChunkRow, Session, StopReason, ToolCall
from treadle.tools.context import ToolContext
from treadle.tools.results import error_content

if TYPE_CHECKING:
    from treadle.llm.request import CompletionRequest
    from treadle.llm.turn import AssistantTurn
    from treadle.loop.engine import _Pass

__all__ = [
    "GuardedCall",
    "complete_guarded",
    "guard_round",
    "run_guardrails",
    "run_tool_guardrails",
    "screen_tool_calls",
    "screen_tool_result",
]

T = TypeVar("T")

_INTERNAL = "treadle."


def _keep(results: list[GuardrailResult], label: str, when: str, trip: Tripwire | None) -> None:
    if not label.startswith(_INTERNAL):
        results.append(GuardrailResult(label, when, trip))


async def _all(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Await every call concurrently (one call: directly); results in order.

    A call's error (`SystemExit` too) is caught in its own task, which must never let it reach
    the event loop, and re-raised here once the others are cancelled.
    """
    if len(calls) == 1:
        return [await calls[0]()]
    out: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []
    async with anyio.create_task_group() as group:

        async def one(i: int) -> None:
            try:
                out[i] = await calls[i]()
            except asyncio.CancelledError:
                raise
            except BaseException as err:  # user code: ends this pass, never the loop
                errors.append(err)
                group.cancel_scope.cancel()

        for i in range(len(calls)):
            group.start_soon(one, i)
    if errors:
        raise errors[0]
    return out


async def run_guardrails(
    guards: Sequence[Guardrail],
    data: GuardrailInput,
    results: list[GuardrailResult],
    context: ToolContext | None = None,
) -> Tripwire | None:
    """Run `guards` concurrently; record each verdict; the first tripwire (in list order)."""
    trips = await _all([lambda g=g: g.run(data, context) for g in guards])  # type: ignore[misc]
    for guard, trip in zip(guards, trips, strict=True):
        _keep(results, guard.label, guard.when, trip)
    return next((t for t in trips if t is not None), None)


class GuardedCall:
    """A model call raced by input guardrails: a trip cancels a call still in flight (its usage
    never counts); a call that had already finished is returned beside the trip, to be counted."""

    def __init__(
        self,
        guards: Sequence[Guardrail],
        data: GuardrailInput,
        results: list[GuardrailResult],
        context: ToolContext | None = None,
    ) -> None:
        self.guards = guards
        self.data = data
        self.results = results
        self.context = context

    async def run(self, call: Callable[[], Awaitable[T]]) -> tuple[T | None, Tripwire | None]:
        """`(reply, None)`, or `(reply or None, tripwire)` when a guardrail tripped (the reply
        only when the call had finished first)."""
        serial = [g for g in self.guards if not g.parallel]
        if serial:  # these must pass before the model is called at all
            trip = await run_guardrails(serial, self.data, self.results, self.context)
            if trip is not None:
                return None, trip
        parallel = [g for g in self.guards if g.parallel]
        if not parallel:
            return await call(), None
        reply: list[T] = []
        tripped: list[Tripwire] = []
        errors: list[BaseException] = []
        failed: list[BaseException] = []
        async with anyio.create_task_group() as group:

            async def model() -> None:
                try:
                    reply.append(await call())
                except asyncio.CancelledError:
                    raise
                except BaseException as err:  # re-raised below, never into the event loop
                    # The guardrails still decide: a trip makes the call's failure moot.
                    failed.append(err)

            async def check() -> None:
                try:
                    trip = await run_guardrails(parallel, self.data, self.results, self.context)
                except asyncio.CancelledError:
                    raise
                except BaseException as err:
                    errors.append(err)
                    group.cancel_scope.cancel()
                    return
                if trip is not None:
                    tripped.append(trip)
                    group.cancel_scope.cancel()  # the call is abandoned: not charged

            group.start_soon(model)
            group.start_soon(check)
        if errors:
            raise errors[0]
        if tripped:  # a call that finished first was billed: its reply comes back with the trip
            return (reply[0] if reply else None), tripped[0]
        if failed:
            raise failed[0]
        if not reply:  # cancelled from outside while both ran
            raise asyncio.CancelledError
        return reply[0], None


async def run_tool_guardrails(
    guards: Sequence[ToolGuardrail],
    call: ToolCall,
    content: str | None,
    results: list[GuardrailResult],
) -> str | Tripwire | None:
    """Run the tool guardrails that apply to `call` concurrently: a tripwire, else the first
    rejection message, else None."""
    mine = [g for g in guards if g.applies(call.name)]
    if not mine:
        return None
    data = ToolGuardrailInput(call, content)
    verdicts = await _all([lambda g=g: g.run(data) for g in mine])  # type: ignore[misc]
    for guard, verdict in zip(mine, verdicts, strict=True):
        trip = verdict if isinstance(verdict, Tripwire) else None
        if isinstance(verdict, str):
            trip = Tripwire(verdict, guard.label, guard.when)  # recorded as a rejection
        _keep(results, guard.label, guard.when, trip)
    for verdict in verdicts:
        if isinstance(verdict, Tripwire):
            return verdict
    return next((v for v in verdicts if isinstance(v, str)), None)


async def guard_round(
    run: _Pass, when: str, request: CompletionRequest, turn: AssistantTurn | None
) -> StopReason | None:
    """Run the pass's `when` guardrails (`after` adds `output` ones on a final reply)."""
    final = turn is not None and not turn.payload.get("tool_calls")
    guards = [
        g
        for g in run.plan.guardrails
        if g.when == when or (final and when == "after" and g.when == "output")
    ]
    if not guards:
        return None
    reply = turn.completion if turn is not None else None
    tripwire = None
    with run.snapshot() as session, _until(run.deadline) as scope:
        data = GuardrailInput(session=session, request=request, reply=reply)
        tripwire = await run_guardrails(
            guards, data, run.guard_results, _context(run, guards, session)
        )
    if scope.cancel_called and tripwire is None:  # also a check that swallowed the cancel
        return "deadline"
    return run.block(tripwire) if tripwire is not None else None


def _until(deadline: float | None) -> anyio.CancelScope:
    """A scope that ends the guardrails it holds at the pass deadline (none: never)."""
    return anyio.move_on_after(math.inf if deadline is None else deadline - time.monotonic())


async def complete_guarded(
    run: _Pass, request: CompletionRequest
) -> tuple[AssistantTurn | None, Tripwire | None]:
    """The first request, raced by the input guardrails."""
    guards, run.input_guards = run.input_guards, []  # the first request only
    turn, trip = None, None  # past the deadline: neither (the pass stops with "deadline")
    with run.snapshot() as session, _until(run.deadline):
        data = GuardrailInput(session=session, request=request)
        context = _context(run, guards, session)
        turn, trip = await GuardedCall(guards, data, run.guard_results, context).run(
            lambda: run.complete_in_time(request)
        )
    if trip is not None and turn is not None:
        run.count(turn.usage)  # the call finished before the trip: it was billed, so it counts
        return None, trip
    return turn, trip


def _context(run: _Pass, guards: Sequence[Guardrail], session: Session) -> ToolContext | None:
    """The pass's context, built only when a guardrail asks for it."""
    return run.context(session) if any(g.context_param is not None for g in guards) else None


#: What the model hears for a call whose tool guardrails were still running at the pass deadline.
_UNSCREENED_CALL = (
    "the pass's deadline came while this call's input guardrails ran, so it was not run"
)
_UNSCREENED_RESULT = (
    "the pass's deadline came while this call's output guardrails ran, so its result is withheld"
)


async def screen_tool_calls(
    run: _Pass, calls: Sequence[ToolCall], denied: dict[str, str]
) -> dict[str, str] | Tripwire:
    """Tool input guardrails over a round's calls, all calls screened concurrently: the content
    the model sees instead of each rejected call's result, by call id, or a tripwire. On a
    tripwire no call runs, and every call of the round still gets its result row (blocked, or
    not run) so the transcript stays valid for the model when the conversation continues. The
    pass deadline bounds the screening: a call not cleared by then is not run (`timeout`)."""
    guards = [g for g in run.plan.tool_guardrails if g.when == "tool_input"]
    todo = [c for c in calls if c.id not in denied] if guards else []
    if not todo:
        return {}
    screened = await _all([lambda c=c: _screen(run, guards, c, None) for c in todo])  # type: ignore[misc]
    rejected: dict[str, str] = {}
    tripped: tuple[ToolCall, Tripwire] | None = None
    for c, (results, verdict, late) in zip(todo, screened, strict=True):
        run.guard_results.extend(results)  # in call order, however the checks interleaved
        if late:
            rejected[c.id] = error_content("timeout", _UNSCREENED_CALL)
        elif isinstance(verdict, Tripwire):
            tripped = tripped or (c, verdict)
        elif verdict is not None:
            rejected[c.id] = error_content("guardrail_rejected", verdict)
    if tripped is None:
        return rejected
    await _answer_blocked(run, calls, {**denied, **rejected}, *tripped)
    return tripped[1]


async def _screen(
    run: _Pass, guards: Sequence[ToolGuardrail], call: ToolCall, content: str | None
) -> tuple[list[GuardrailResult], str | Tripwire | None, bool]:
    """One call's (or result's) tool guardrails within the pass deadline: their results, the
    verdict, and whether it came too late. A check that outlives the deadline, also one that
    swallows its cancellation and then lets the call pass, never counts as passed."""
    results: list[GuardrailResult] = []
    verdict: str | Tripwire | None = None
    with _until(run.deadline) as scope:
        verdict = await run_tool_guardrails(guards, call, content, results)
    if scope.cancel_called and verdict is None:
        return [], None, True
    return results, verdict, False


async def _answer_blocked(
    run: _Pass, calls: Sequence[ToolCall], decided: dict[str, str], call: ToolCall, trip: Tripwire
) -> None:
    """A result row for every call of a round that a tool input guardrail stopped (none ran):
    an assistant message whose tool calls go unanswered is refused by OpenAI-style endpoints
    when the conversation continues."""
    rows = []
    for c in calls:
        if c.id == call.id:
            content = error_content(
                "guardrail_tripped",
                f"blocked by guardrail {trip.guardrail!r}: this call was not run and the pass "
                "stopped",
            )
        elif c.id in decided:
            content = decided[c.id]
        else:
            content = error_content(
                "not_run",
                f"not run: guardrail {trip.guardrail!r} blocked the call to {call.name!r} of "
                "this reply and the pass stopped",
            )
        rows.append(
            ChunkRow._trusted(
                "tool_result", {"tool_call_id": c.id, "name": c.name, "content": content}
            )
        )
    await run.append(rows, boundary=True)
    if run.events is not None:
        for row in rows:
            run.events.emit(ToolResultEvent, row=row)


async def screen_tool_result(
    run: _Pass, call: ToolCall, content: str, rejected: dict[str, str], trips: list[Tripwire]
) -> str:
    """The content the model sees for `call`: a rejection, or the result past the tool output
    guardrails. A tripwire is added to `trips` (the round then stops the pass) and the result
    it tripped on is withheld, so continuing the conversation never shows it to the model.
    Output guardrails not done by the pass deadline withhold the result too (`timeout`)."""
    if call.id in rejected:
        return rejected[call.id]
    guards = [g for g in run.plan.tool_guardrails if g.when == "tool_output"]
    results, verdict, late = await _screen(run, guards, call, content)
    run.guard_results.extend(results)
    if late:
        return error_content("timeout", _UNSCREENED_RESULT)
    if isinstance(verdict, Tripwire):
        trips.append(verdict)
        return error_content(
            "guardrail_tripped",
            f"guardrail {verdict.guardrail!r} stopped the pass on this result, so it is withheld",
        )
    if verdict is not None:
        return error_content("guardrail_rejected", verdict)
    return content
