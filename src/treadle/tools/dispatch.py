"""The one tool dispatcher: run a round of model tool calls, whoever executes them.

`run_tool_calls` parses, validates and runs a round of `ToolCall`s and returns one `ToolOutcome`
per call, in call order. Calls run concurrently inside one task group that owns every task; calls
sharing a resource key run one at a time in call order. The same path serves the default
implementation (`Tool.invoke`) and a custom executor's `dispatch_tool` / `adispatch_tool`: both
get the same validation, timeouts, lanes, approvals (denied calls) and unknown-outcome handling.
Problems with a call (unknown tool, bad arguments, an exception, a timeout, a path outside the
workspace) become an error body for the model; so do `asyncio.CancelledError` raised by a tool
itself (only a cancellation of the pass propagates) and `SystemExit` and `KeyboardInterrupt` (an
argparse-based tool exits on bad input), which would otherwise end the pass or kill the loop.
Every call is bounded: by the tool's `timeout`, else the pass's `Limits.tool_timeout_seconds`, else
`DEFAULT_TOOL_TIMEOUT`, and never past the pass's deadline.

This module must never raise for a tool's problem (unless the tool's own `on_error` /
`on_timeout` policy is `"raise"`), never leave a task running after it returns (cancellation
cancels async tools and kills sandbox commands), and never block the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import typing
import weakref
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, runtime_checkable

import anyio
import anyio.lowlevel

from treadle._frozen import quick_init
from treadle.errors import ToolError, ToolTimeoutError, TreadleError
from treadle.session import Session, ToolCall
from treadle.telemetry import tool_span
from treadle.tools.arguments import parse_arguments
from treadle.tools.context import ToolContext
from treadle.tools.results import (
    ResultSerialisationError,
    error_content,
    exception_detail,
    success_content,
)
from treadle.tools.threads import run_sync_tool
from treadle.tools.tool import Tool
from treadle.tools.toolset import ToolSet

__all__ = [
    "DEFAULT_TOOL_TIMEOUT",
    "AsyncToolExecutor",
    "ToolExecutor",
    "ToolOutcome",
    "has_tool_dispatch",
    "run_tool_calls",
]


#: Seconds a tool call may run when neither the tool nor the pass sets a timeout.
DEFAULT_TOOL_TIMEOUT = 600.0


@runtime_checkable
class ToolExecutor(Protocol):
    """An executor that runs tools itself, synchronously (called on the sync-tool threads)."""

    def dispatch_tool(self, session: Session | None, tool: Tool, arguments: Any) -> Any:
        """Run `tool` with validated `arguments`; return its result."""
        ...


@runtime_checkable
class AsyncToolExecutor(Protocol):
    """An executor that runs tools itself, on the event loop (must not block it)."""

    async def adispatch_tool(self, session: Session | None, tool: Tool, arguments: Any) -> Any:
        """Run `tool` with validated `arguments`; return its result."""
        ...


@quick_init
@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """The result of one tool call, ready to become a `tool_result` row."""

    tool_call_id: str
    """The `id` of the call this answers."""
    name: str
    """The tool name the model called (as sent, even when unknown)."""
    content: str
    """JSON text the model sees next: `{"ok": true, ...}` or `{"ok": false, "error_kind", ...}`."""
    ok: bool
    """True when the tool ran and returned."""
    error_kind: str | None
    """`unknown_tool`, `invalid_tool_arguments`, `tool_execution_exception`, `timeout`,
    `unserialisable_result`, `path_violation`, `denied`, `unknown_outcome` (or a custom
    `ToolError.error_kind`); None when `ok`."""


def _failure(call: ToolCall, kind: str, message: str, detail: str | None = None) -> ToolOutcome:
    return ToolOutcome(call.id, call.name, error_content(kind, message, detail), False, kind)


Runner = Callable[[Tool, dict[str, Any], ToolContext], Awaitable[Any]]


async def _invoke(tool: Tool, arguments: dict[str, Any], context: ToolContext) -> Any:
    return await tool.invoke(arguments, context=context)


_KINDS: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()


def _dispatch_kind(cls: type) -> str:
    """`async`, `sync` or `none`: a protocol check is slow, so it runs once per class."""
    kind = _KINDS.get(cls)
    if kind is None:
        if issubclass(cls, AsyncToolExecutor):
            kind = "async"
        else:
            kind = "sync" if issubclass(cls, ToolExecutor) else "none"
        _KINDS[cls] = kind
    return kind


def _runner_of(executor: object) -> Runner:
    """How calls run: the tool's own implementation, or the executor's dispatch."""
    kind = _dispatch_kind(type(executor))
    if kind == "none":
        return _invoke
    if isinstance(executor, AsyncToolExecutor):
        custom_async = executor

        async def run_async(tool: Tool, arguments: dict[str, Any], context: ToolContext) -> Any:
            return await custom_async.adispatch_tool(context.session, tool, arguments)

        return run_async
    if isinstance(executor, ToolExecutor):
        custom = executor

        async def run_sync(tool: Tool, arguments: dict[str, Any], context: ToolContext) -> Any:
            call = functools.partial(custom.dispatch_tool, context.session, tool, arguments)
            return await run_sync_tool(call)

        return run_sync
    return _invoke


def has_tool_dispatch(executor: object) -> bool:
    """True when `executor` runs tools itself."""
    return _dispatch_kind(type(executor)) != "none"


@dataclass(slots=True)
class _Ready:
    index: int
    call: ToolCall
    tool: Tool
    arguments: dict[str, Any]


def _time_limit(item: Tool, context: ToolContext) -> tuple[float, bool]:
    """Seconds this call may run, and whether the pass's deadline is what bounds it."""
    timeout = item.timeout
    if timeout is None:
        timeout = context.tool_timeout if context.tool_timeout is not None else DEFAULT_TOOL_TIMEOUT
    left = context.seconds_left()
    if left is not None and left < timeout:
        return left, True
    return timeout, False


async def _execute(ready: _Ready, run: Runner, context: ToolContext) -> ToolOutcome:
    traced = tool_span(ready.tool.name, ready.call.id, ready.call.arguments)
    if traced is None:
        return await _outcome(ready, run, context)
    trace, span = traced
    token = trace.enter_tool(span)
    try:
        outcome = await _outcome(ready, run, context)
    except BaseException:
        trace.end_tool(span, "cancelled", "")
        raise
    finally:
        trace.leave_tool(token)
    trace.end_tool(span, outcome.error_kind, outcome.content)
    return outcome


class _Escalated(Exception):
    """Carries a tool's exception out of the round when its policy says `"raise"`."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _raised(
    item: Tool, call: ToolCall, error: BaseException, message: str, detail: str | None
) -> ToolOutcome:
    """The outcome of a call whose tool raised `error`, as the tool's `on_error` says."""
    policy = item.on_error
    if policy == "raise":
        raise _Escalated(error)
    if callable(policy):
        try:
            # Typed for `Exception` (what users write); a tool's own CancelledError reaches it
            # too, as the error the call ended with.
            decided = policy(typing.cast(Exception, error))
        except BaseException as broken:
            # A broken policy must not lose the call's result: whatever it raises (a re-raised
            # CancelledError, KeyboardInterrupt, SystemExit included) falls back to the default
            # message, so siblings' rows are never lost. The pass's own cancellation is checked
            # by `_outcome` after this returns, so it is not swallowed here.
            message = f"{message} (and its on_error function raised {broken!r})"
        else:
            if isinstance(decided, str):
                message, detail = decided, None  # the policy decided what the model sees
            else:  # None, a dict, an awaitable: not a message; the default is kept
                if inspect.isawaitable(decided) and hasattr(decided, "close"):
                    decided.close()  # never awaited: close it so no warning is left behind
                message = (
                    f"{message} (and its on_error function returned {type(decided).__name__}, "
                    "not the str message the model sees)"
                )
    return _failure(call, "tool_execution_exception", message, detail)


async def _outcome(ready: _Ready, run: Runner, context: ToolContext) -> ToolOutcome:
    """The call's outcome; when the pass itself is being cancelled, a cancellation instead,
    whatever the tool made of it (converted it to its own exception, swallowed it, returned)."""
    try:
        outcome = await _attempt(ready, run, context)
    except anyio.get_cancelled_exc_class():
        raise
    except BaseException as error:
        if _being_cancelled():
            await _cancel_again(error, ready.tool.name)
        raise
    if _being_cancelled():
        await _cancel_again(None, ready.tool.name)
    return outcome


async def _cancel_again(error: BaseException | None, name: str) -> NoReturn:
    """Let the pass's cancellation go on after tool `name` turned it into `error` or swallowed it.

    The original `CancelledError`, found in the tool's exception chain, carries the message a
    cancel scope recognises as its own; when the tool swallowed it, a checkpoint lets an anyio
    scope deliver it again, and a bare `Task.cancel()` (not delivered again) gets a new one.
    """
    cancelled = anyio.get_cancelled_exc_class()
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, cancelled):
            raise error
        error = error.__cause__ or error.__context__
    await anyio.lowlevel.checkpoint()
    raise cancelled(f"the pass was cancelled while tool {name!r} ran")


_SCOPES: dict[type, Callable[..., anyio.CancelScope]] = {}


def _move_on_after(limit: float) -> anyio.CancelScope:
    """`anyio.move_on_after(limit)`: the same scope of the running loop's anyio backend, whose
    class is found once per loop class. `move_on_after` asks sniffio for the backend twice a
    call, and sniffio runs `from asyncio import current_task` each time (an import statement,
    about 2 µs): twice per tool call."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: anyio finds the backend
        return anyio.move_on_after(limit)
    make = _SCOPES.get(type(loop))
    if make is None:
        make = _SCOPES[type(loop)] = type(anyio.move_on_after(None))
    scope: anyio.CancelScope = make(deadline=loop.time() + limit)
    return scope


async def _attempt(ready: _Ready, run: Runner, context: ToolContext) -> ToolOutcome:
    """Run the call once and turn whatever it raised or returned into its outcome."""
    item, call = ready.tool, ready.call
    context = context.for_call(call)
    limit, by_deadline = _time_limit(item, context)
    content = ""
    timed_out = False
    try:
        with _move_on_after(limit) as scope:
            result = await run(item, ready.arguments, context)
        timed_out = scope.cancelled_caught
        if not timed_out:
            # Inside the try: a result that cannot become JSON is the model's to hear about.
            content = success_content(result, max_chars=item.max_result_chars)
    except ToolError as error:
        return _failure(call, error.error_kind, error.message, error.detail)
    except TreadleError as error:  # our own clear message (e.g. a missing file): no traceback
        return _raised(item, call, error, f"tool {item.name!r} failed: {error}", None)
    except ResultSerialisationError as error:
        message = f"tool {item.name!r} returned a value that cannot be shown as JSON ({error})"
        return _failure(call, "unserialisable_result", message)
    except anyio.get_cancelled_exc_class() as error:
        if _being_cancelled():
            raise  # the pass itself is being cancelled: not the tool's outcome
        # The tool raised `CancelledError` on its own (a library's internal cancel, a timeout
        # helper): like any other exception, it is this call's result.
        message = f"tool {item.name!r} raised {type(error).__name__}: {error}"
        return _raised(item, call, error, message, exception_detail(error))
    except BaseException as error:
        message = f"tool {item.name!r} raised {type(error).__name__}: {error}"
        return _raised(item, call, error, message, exception_detail(error))
    if timed_out:
        sync_note = (
            ""
            if getattr(item, "_is_async", True)
            else "; its thread cannot be stopped and may still be running"
        )
        why = "the pass's deadline" if by_deadline else f"its {limit:g} s timeout"
        timeout = ToolTimeoutError(
            f"tool {item.name!r} ran past {why} and was abandoned{sync_note}. "
            "Try a smaller task or different arguments."
        )
        if item.on_timeout == "raise":
            raise _Escalated(timeout)
        return _failure(call, timeout.error_kind, timeout.message, timeout.detail)
    return ToolOutcome(call.id, item.name, content, True, None)


def _being_cancelled() -> bool:
    """True when a cancellation was requested for the task running the call (the pass, or a
    scope around it, is being cancelled), as opposed to a tool raising `CancelledError` itself."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _answered(call: ToolCall, outcome: ToolOutcome) -> ToolOutcome:
    """`outcome` of a call answered without running a tool; traced like one that ran, so a
    model calling a missing tool or sending bad arguments shows in the trace."""
    traced = tool_span(call.name, call.id, call.arguments)
    if traced is not None:
        trace, span = traced
        trace.end_tool(span, outcome.error_kind, outcome.content)
    return outcome


def _as_call(call: ToolCall | Mapping[str, Any], index: int) -> ToolCall:
    return call if isinstance(call, ToolCall) else ToolCall.from_wire(call, index)


def _settled(
    call: ToolCall,
    found: Tool | None,
    denied: Mapping[str, str],
    unknown_outcome: Collection[str],
) -> ToolOutcome | None:
    """The outcome of a call decided without running it (denied, unknown outcome), if any."""
    if call.id in denied:
        why = denied[call.id]
        return _failure(
            call,
            "denied",
            f"the user did not approve this call to {call.name}" + (f": {why}" if why else "."),
        )
    if call.id in unknown_outcome and not (found is not None and found.idempotent):
        return _failure(
            call,
            "unknown_outcome",
            f"the call to {call.name} was interrupted by a crash; it may or may not have run. "
            "Check its effects before calling it again.",
        )
    return None


async def run_tool_calls(
    calls: Sequence[ToolCall | Mapping[str, Any]],
    tools: ToolSet,
    *,
    session: Session | None = None,
    context: ToolContext | None = None,
    executor: object = None,
    denied: Mapping[str, str] | None = None,
    unknown_outcome: Collection[str] = (),
    on_outcome: Callable[[int, ToolOutcome], Awaitable[None]] | None = None,
) -> list[ToolOutcome]:
    """Run one round of tool calls; one `ToolOutcome` per call, in call order.

    Calls are `ToolCall` values (or OpenAI wire dicts). The tools see `context` (or one built
    from `session`). `executor`, when it defines `adispatch_tool` / `dispatch_tool`, runs the
    validated calls instead of the tools' own implementations. Calls in `denied` (id -> reason)
    are not run; calls in `unknown_outcome` (interrupted by a crash) are not run again unless
    their tool is `idempotent`. Calls run concurrently; calls sharing a resource key (or of a
    tool with `parallel_safe=False`) run one at a time in call order. Never raises for a tool's
    problem, except a tool whose `on_error` / `on_timeout` is `"raise"`: its exception (or
    `ToolTimeoutError`) is raised once the round's other calls are cancelled. Cancelling the
    caller cancels every call (sandbox commands are killed).
    `on_outcome(index, outcome)`, when given, is awaited as each call's outcome is known (in
    finishing order), so a caller can persist a result before the round ends.
    """
    ctx = context if context is not None else ToolContext(session)
    run = _runner_of(executor)
    denied = denied or {}
    outcomes: list[ToolOutcome | None] = [None] * len(calls)
    lanes: dict[str, list[_Ready]] = {}
    free: list[_Ready] = []
    for index, raw in enumerate(calls):
        call = _as_call(raw, index)
        found = tools.get(call.name)
        settled = (
            _settled(call, found, denied, unknown_outcome) if denied or unknown_outcome else None
        )
        if settled is not None:
            outcomes[index] = _answered(call, settled)
            continue
        if found is None:
            known = ", ".join(tools.names) or "none"
            outcomes[index] = _answered(
                call,
                _failure(
                    call,
                    "unknown_tool",
                    f"there is no tool named {call.name!r}; available tools: {known}.",
                ),
            )
            continue
        try:
            arguments = found.validate(parse_arguments(call.arguments))
        except ToolError as error:
            failure = _failure(call, error.error_kind, error.message, error.detail)
            outcomes[index] = _answered(call, failure)
            continue
        ready = _Ready(index, call, found, arguments)
        key = found.key_for(arguments)
        if key is None:
            free.append(ready)
        else:
            lanes.setdefault(key, []).append(ready)

    if on_outcome is not None:
        for index, decided in enumerate(outcomes):
            if decided is not None:
                await on_outcome(index, decided)

    async def run_one(ready: _Ready) -> None:
        outcome = outcomes[ready.index] = await _execute(ready, run, ctx)
        if on_outcome is not None:
            await on_outcome(ready.index, outcome)

    async def run_lane(lane: list[_Ready]) -> None:
        for ready in lane:
            await run_one(ready)

    try:
        if len(free) == 1 and not lanes:
            await run_one(free[0])  # the common single-call round needs no task group
        elif free or lanes:
            async with anyio.create_task_group() as group:
                for ready in free:
                    group.start_soon(run_one, ready)
                for lane in lanes.values():
                    group.start_soon(run_lane, lane)
    except _Escalated as escalated:  # a tool whose policy is "raise": its error fails the pass
        raise escalated.error from None
    except BaseExceptionGroup as group:
        first = _first_escalated(group)
        if first is None:
            raise
        raise first.error from None
    return [o for o in outcomes if o is not None]


def _first_escalated(group: BaseExceptionGroup[BaseException]) -> _Escalated | None:
    for error in group.exceptions:
        if isinstance(error, _Escalated):
            return error
        if isinstance(error, BaseExceptionGroup):
            found = _first_escalated(error)
            if found is not None:
                return found
    return None
