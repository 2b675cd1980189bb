"""`run_session_loop`, `arun_session_loop` and `stream_session_loop`: the entry points of a pass.

Arguments are validated at the call, so configuration errors (no model, a tool shadowing a
built-in, `on_event` with a custom executor) raise there and not at the first read. The lazy form
submits the pass to the runtime and returns a `Session` facade at once.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from treadle.loop.first_call import on_first_call
from treadle.session import Session, SessionData, new_session_id
from treadle.session.pending import pending_output

if TYPE_CHECKING:
    from treadle.llm.provider import Provider
    from treadle.loop.control import Limits
    from treadle.loop.engine import run_pass
    from treadle.loop.events import Event, PassStopped
    from treadle.loop.hooks import Hooks
    from treadle.loop.planning import pass_output, plan_in_order, plan_pass
    from treadle.loop.tooling import ToolUseBehavior
    from treadle.runtime.background import submit
    from treadle.runtime.streams import produce
    from treadle.stores import PendingPass, Store  # loaded with the first pass using a store
else:
    # The engine, the runtime, the tool and model layers load with the first pass, not with
    # `from treadle import run_session_loop` (about half of that import's CPU; see
    # docs/performance.md, imports): each name below is replaced by the real function on its
    # first call. Each names the function's home module, not a re-export, so a patch of
    # `treadle.runtime.submit` (a test's) does not reach the loop, as before the stand-ins.
    run_pass = on_first_call(globals(), "treadle.loop.engine", "run_pass")
    plan_pass = on_first_call(globals(), "treadle.loop.planning", "plan_pass")
    plan_in_order = on_first_call(globals(), "treadle.loop.planning", "plan_in_order")
    pass_output = on_first_call(globals(), "treadle.loop.planning", "pass_output")
    submit = on_first_call(globals(), "treadle.runtime.background", "submit")
    # The memory streams load with the first streamed pass. (An import statement in
    # `stream_session_loop` cost about 2 µs a pass: see docs/performance.md, fifth round.)
    produce = on_first_call(globals(), "treadle.runtime.streams", "produce")
    PassStopped = on_first_call(globals(), "treadle.loop.events", "PassStopped")

__all__ = [
    "DEFAULT_MAX_TOOL_ROUNDS",
    "PassOptions",
    "arun_session_loop",
    "naming_next_pass",
    "run_session_loop",
    "stream_session_loop",
]

#: Tool rounds a pass may run before it stops with `stop_reason == "max_steps"`.
DEFAULT_MAX_TOOL_ROUNDS = 64


# The name the next pass planned in this context carries in traces (set by `Agent`).
next_pass_name: ContextVar[str | None] = ContextVar("treadle_next_pass_name", default=None)


@contextmanager
def naming_next_pass(name: str) -> Iterator[None]:
    """Inside the block, the next pass planned in this context is traced as agent `name`
    (`invoke_agent {name}`, `gen_ai.agent.name`). This is how `Agent` names its passes without
    a public argument; passes its tools start are not named by it."""
    token = next_pass_name.set(name)
    try:
        yield
    finally:
        next_pass_name.reset(token)


class PassOptions(TypedDict, total=False):
    """The keyword arguments every pass entry point takes (see `run_session_loop`)."""

    agent_provider: Provider | None
    """The model endpoint and its options."""
    provider: Provider | None
    """Alias of `agent_provider` (the name `Agent` uses); give one of the two."""
    tools: Iterable[Any] | None
    """Extra tools (`@tool` functions, `Tool`s or plain callables)."""
    executor: object | None
    """A custom executor (tests, other transports) instead of HTTP."""
    max_tool_rounds: int
    """Tool rounds before the pass stops with `stop_reason == "max_steps"`."""
    on_event: Callable[[Any], Any] | None
    """Called with each raw stream delta (sync callbacks run off the event loop)."""
    persist: bool
    """Write the transcript to `.treadle/sessions/<id>.jsonl` as it grows."""
    persist_path: str | os.PathLike[str] | None
    """A directory for that file, or the `.jsonl` file itself."""
    limits: Limits | None
    """Step, token, deadline and tool-call limits (see `Limits`)."""
    guardrails: Iterable[Any] | None
    """Checks run before each request or after each reply (see `Guardrail`)."""
    on_message: Callable[..., Any] | None
    """Called as `on_message(row, control)` after each assistant and tool_result row."""
    approvals: Mapping[str, bool | str] | None
    """Decisions for calls to tools marked `needs_approval`, by tool call id."""
    hooks: Hooks | None
    """Lifecycle hooks for this pass (see `Hooks`)."""
    deps: Any
    """Dependencies for this pass, handed to tools, guardrails and callbacks that ask for a
    `ToolContext` (never serialised)."""
    tool_use_behavior: ToolUseBehavior
    """Whether a tool round ends the pass (default `"run_llm_again"`)."""
    reset_tool_choice: bool
    """Reset a forced `tool_choice` to `"auto"` once a tool ran (default True)."""
    store: Store | None
    """A conversation store: the pass continues `conversation` there and commits to it."""
    conversation: str | PendingPass | None
    """The conversation's key in `store` (or an item of `store.pending()` to resume)."""


def run_session_loop(
    user_session: Session,
    agent_session: Session,
    *,
    agent_provider: Provider | None = None,
    provider: Provider | None = None,
    tools: Iterable[Any] | None = None,
    executor: object | None = None,
    max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
    on_event: Callable[[Any], Any] | None = None,
    persist: bool = False,
    persist_path: str | os.PathLike[str] | None = None,
    limits: Limits | None = None,
    guardrails: Iterable[Any] | None = None,
    on_message: Callable[..., Any] | None = None,
    approvals: Mapping[str, bool | str] | None = None,
    hooks: Hooks | None = None,
    deps: Any = None,
    tool_use_behavior: ToolUseBehavior = "run_llm_again",
    reset_tool_choice: bool = True,
    store: Store | None = None,
    conversation: str | PendingPass | None = None,
    lazy: bool = True,
) -> Session:
    """Run one agent pass on the runtime and return its output `Session` at once.

    The output holds the user session's rows plus the pass's new rows (agent rows are never
    copied in), shares the user session's sandbox, and records both inputs as parents. Reading it
    blocks until the pass ends; `await` it from async code; `out.cancel()` stops it with
    `stop_reason == "cancelled"`. `lazy=False` waits before returning.

    Args:
        user_session: The conversation so far; may itself be a pending output of another pass.
        agent_session: The agent's rows (system prompt), sent first.
        agent_provider: The model endpoint and its options.
        provider: Alias of `agent_provider` (the name `Agent` takes); give one of the two.
        tools: Extra tools (`@tool` functions, `Tool`s or plain callables).
        executor: A custom executor (tests, other transports) instead of HTTP.
        max_tool_rounds: Tool rounds before the pass stops with `stop_reason == "max_steps"`.
        on_event: Called with each raw stream delta (sync callbacks run off the event loop).
        persist: Write the transcript to `.treadle/sessions/<id>.jsonl` as it grows.
        persist_path: A directory for that file, or the `.jsonl` file itself.
        limits: Step, token, deadline and tool-call limits (see `Limits`).
        guardrails: Checks run before each request or after each reply (see `Guardrail`).
        on_message: Called as `on_message(row, control)` after each assistant and tool_result
            row; `control.interrupt(reason)` stops the pass, resumable.
        approvals: Decisions for calls to tools marked `needs_approval`, by tool call id:
            True runs the call, False or a reason string denies it.
        hooks: Lifecycle hooks (model call and tool start/end) for this pass; see `Hooks`.
        deps: Dependencies for this pass (a database handle, the user's id, ...): tools,
            guardrails and callbacks with a parameter annotated `ToolContext` read them as
            `context.deps`. Kept in memory only; never written to the transcript or a file.
        tool_use_behavior: `"run_llm_again"` (the model answers after its tools ran),
            `"stop_on_first_tool"` or `StopAtTools("name", ...)`: a round calling such a tool
            ends the pass (`"final_answer"`) with that call's result as `out.output`.
        reset_tool_choice: When the provider forces a tool call (`tool_choice="required"` or
            a named function), ask with `"auto"` once a tool ran, so the pass can answer.
        store: A conversation store (`Store.sqlite(...)`, `Store.postgres(...)`); with
            `conversation`, the pass continues the stored conversation (the user session's
            rows follow it) and commits its new rows in one transaction when it ends
            (`ConflictError` if another writer committed first).
        conversation: The conversation's key in `store`, or an item of `store.pending()` to
            resume (the pass takes it over).
        lazy: Return at once (True) or after the pass ends (False).
    """
    out_id = new_session_id()
    # By position (`plan_pass`'s order): re-binding twenty-two keywords cost 1.5 µs a call.
    plan = plan_in_order(
        user_session, agent_session, out_id, None, agent_provider, provider, tools, executor,
        max_tool_rounds, on_event, persist, persist_path, limits, guardrails, on_message,
        approvals, hooks, deps, tool_use_behavior, reset_tool_choice, store, conversation,
    )  # fmt: skip
    handle = user_session.sandbox_handle
    if handle is not None:
        # Hold a share across the submit: a sandbox closed by another thread meanwhile raises
        # here, before the pass exists (no model call, no file), never after.
        handle.acquire()
    try:
        out = pending_output(
            submit(run_pass(plan, out_id, cancel_as_stop=True)),
            out_id,
            user_session,
            agent_session,
            handle,
        )
    finally:
        if handle is not None:
            handle.release()
    if not lazy:
        out.synchronize()
    return out


async def arun_session_loop(
    user_session: Session, agent_session: Session, **options: Unpack[PassOptions]
) -> Session:
    """Run one agent pass on the calling event loop and return the finished output `Session`.

    Takes the same keyword arguments as `run_session_loop`. The pass is a plain coroutine that
    you own: cancelling it cancels the pass and propagates `CancelledError`.
    """
    out_id = new_session_id()
    plan = plan_pass(user_session, agent_session, out_id, **options)
    return pass_output(plan, out_id, await run_pass(plan, out_id))


async def arun_pass_emitting(
    user_session: Session,
    agent_session: Session,
    emit: Callable[[Event], None],
    **options: Unpack[PassOptions],
) -> Session:
    """`arun_session_loop`, handing each typed event to `emit` (how `Agent.stream` sees its
    passes; the final `PassStopped` is the caller's to send)."""
    out_id = new_session_id()
    plan = plan_pass(user_session, agent_session, out_id, emit, **options)
    return pass_output(plan, out_id, await run_pass(plan, out_id))


async def stream_session_loop(
    user_session: Session, agent_session: Session, **options: Unpack[PassOptions]
) -> AsyncGenerator[Event, None]:
    """Run one agent pass and yield its typed events as they happen.

    Takes the same keyword arguments as `run_session_loop`. The last event is `PassStopped`,
    which carries the output session. Leaving the loop early cancels the pass.
    """
    out_id = new_session_id()
    next_seq = 0
    send_event: Callable[[Event], None] | None = None

    def sink(event: Event) -> None:
        nonlocal next_seq
        next_seq = event.seq + 1
        assert send_event is not None  # events come only from the pass, which `produce` runs
        send_event(event)

    plan = plan_pass(user_session, agent_session, out_id, sink, **options)

    async def pass_events(send: Callable[[Event], None]) -> SessionData:
        nonlocal send_event
        send_event = send
        return await run_pass(plan, out_id)

    # Leaving early cancels the pass: it must not outlive its iterator.
    async with produce(pass_events) as events:
        async for event in events:
            yield event
        data = events.result()  # re-raises the pass's error
    yield PassStopped(
        session_id=out_id,
        seq=next_seq,
        stop_reason=data.stop_reason or "",
        session=pass_output(plan, out_id, data),
    )
