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
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from treadle.errors import ConfigurationError, SandboxError
from treadle.llm.provider import Provider
from treadle.llm.turn import HttpExecutor, ModelExecutor, validate_executor
from treadle.loop.control import Limits, normalise_guardrails, tool_guardrails_of
from treadle.loop.engine import PassPlan, run_pass
from treadle.loop.events import Event, PassStopped
from treadle.loop.hooks import Hooks
from treadle.loop.soft_stop import current_stop
from treadle.loop.tooling import ToolUseBehavior, check_stop_names, check_tool_use_behavior
from treadle.runtime import submit
from treadle.session import Session, SessionData, new_session_id
from treadle.telemetry import capture_parent
from treadle.tools import ToolSet
from treadle.tools.context import context_parameter

if TYPE_CHECKING:  # loaded with the first pass that uses a store (docs/performance.md)
    from treadle.stores import PendingPass, Store

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
_next_pass_name: ContextVar[str | None] = ContextVar("treadle_next_pass_name", default=None)


@contextmanager
def naming_next_pass(name: str) -> Iterator[None]:
    """Inside the block, the next pass planned in this context is traced as agent `name`
    (`invoke_agent {name}`, `gen_ai.agent.name`). This is how `Agent` names its passes without
    a public argument; passes its tools start are not named by it."""
    token = _next_pass_name.set(name)
    try:
        yield
    finally:
        _next_pass_name.reset(token)


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


_NO_LIMITS = Limits()  # frozen: every pass without limits shares it
_HTTP = HttpExecutor()  # stateless: every HTTP pass shares it


def _plan(
    user_session: Session,
    agent_session: Session,
    out_id: str,
    emit: Callable[[Event], None] | None = None,
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
) -> PassPlan:
    if provider is not None:
        if agent_provider is not None:
            raise ConfigurationError(
                "give the model endpoint once: provider= or agent_provider= (they are the same "
                "argument), not both."
            )
        agent_provider = provider
    if not isinstance(user_session, Session):
        raise ConfigurationError(
            f"user_session must be a Session, got {type(user_session).__name__}; "
            "build one with Session.from_user_message(...)."
        )
    if not isinstance(agent_session, Session):
        raise ConfigurationError(
            f"agent_session must be a Session, got {type(agent_session).__name__}; "
            "build one with Session.from_agent_prompt(...)."
        )
    handle = user_session.sandbox_handle
    if handle is not None and (handle.closed or user_session.sandbox_closed):
        raise SandboxError(
            "user_session's sandbox is closed, so the pass could not use it; bind a new one "
            "with session.to(...). Nothing was started."
        )
    if isinstance(max_tool_rounds, bool) or not isinstance(max_tool_rounds, int):
        raise ConfigurationError("max_tool_rounds must be an int.")
    if max_tool_rounds < 1:
        raise ConfigurationError(f"max_tool_rounds must be at least 1, got {max_tool_rounds}.")
    for name, fn in (("on_event", on_event), ("on_message", on_message)):
        if fn is not None and not callable(fn):
            raise ConfigurationError(f"{name} must be callable.")
    behavior = check_tool_use_behavior(tool_use_behavior)
    if limits is not None and not isinstance(limits, Limits):
        raise ConfigurationError("limits must be a treadle Limits(...).")
    if hooks is not None and not isinstance(hooks, Hooks):
        raise ConfigurationError(
            f"hooks must be a treadle Hooks (subclass it), got {type(hooks).__name__}."
        )
    if approvals is not None and not isinstance(approvals, Mapping):
        raise ConfigurationError("approvals must map tool call ids to True, False or a reason.")
    if store is not None or conversation is not None:
        from treadle.stores import check_store_arguments  # loads with the first store

        check_store_arguments(store, conversation)
    if agent_provider is not None and not isinstance(agent_provider, Provider):
        raise ConfigurationError(
            f"agent_provider must be a treadle Provider, got {type(agent_provider).__name__}."
        )
    if executor is None:
        if agent_provider is None:
            raise ConfigurationError(
                "run_session_loop needs agent_provider=Provider(model=...) (or a custom executor)."
            )
        resolved: Provider | None = agent_provider.resolve()
        runner: ModelExecutor = _HTTP
    else:
        runner = validate_executor(executor)
        if on_event is not None:
            raise ConfigurationError(
                "on_event needs the default HTTP executor (custom executors do not stream); "
                "drop on_event or the executor."
            )
        resolved = agent_provider
    builtins: tuple[Any, ...] = ()
    if user_session.placement is not None:
        from treadle.sandbox.builtin_tools import global_system_tools  # loads with the first one

        builtins = global_system_tools()
    toolset = ToolSet.build(tools, builtins=builtins)
    check_stop_names(behavior, toolset)
    path: Path | None = None
    if persist or persist_path is not None:
        target = Path(persist_path) if persist_path is not None else None
        if target is not None and target.suffix == ".jsonl":
            path = target
        else:
            from treadle.persist.writer import default_session_path

            path = default_session_path(out_id, target)
    agent_name = _next_pass_name.get()
    if agent_name is not None:  # this pass only: the tasks it starts copy the context from here
        _next_pass_name.set(None)
    return PassPlan(
        user=user_session,
        agent=agent_session,
        provider=resolved,
        tools=toolset,
        executor=runner,
        max_tool_rounds=max_tool_rounds,
        on_event=on_event,
        persist_path=path,
        stream=bool(resolved.stream) if resolved is not None and executor is None else False,
        limits=limits or _NO_LIMITS,
        guardrails=normalise_guardrails(guardrails),
        tool_guardrails=tool_guardrails_of(guardrails),
        hooks=hooks,
        stop=current_stop(),
        on_message=on_message,
        on_message_context=context_parameter(on_message) if on_message is not None else None,
        approvals=dict(approvals) if approvals else None,
        emit=emit,
        trace_parent=capture_parent(),
        agent_name=agent_name,
        deps=deps,
        tool_use_behavior=behavior,
        reset_tool_choice=bool(reset_tool_choice),
        store=store,
        conversation=conversation,
    )


def _output(plan: PassPlan, out_id: str, data: SessionData) -> Session:
    return Session._derive(
        data,
        operator="run_session_loop",
        kind="output",
        parents=[plan.user, plan.agent],
        sandbox=plan.user.sandbox_handle,
        id=out_id,
    )


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
    plan = _plan(
        user_session,
        agent_session,
        out_id,
        agent_provider=agent_provider,
        provider=provider,
        tools=tools,
        executor=executor,
        max_tool_rounds=max_tool_rounds,
        on_event=on_event,
        persist=persist,
        persist_path=persist_path,
        limits=limits,
        guardrails=guardrails,
        on_message=on_message,
        approvals=approvals,
        hooks=hooks,
        deps=deps,
        tool_use_behavior=tool_use_behavior,
        reset_tool_choice=reset_tool_choice,
        store=store,
        conversation=conversation,
    )
    handle = user_session.sandbox_handle
    if handle is not None:
        # Hold a share across the submit: a sandbox closed by another thread meanwhile raises
        # here, before the pass exists (no model call, no file), never after.
        handle.acquire()
    try:
        out = Session._pending(
            submit(run_pass(plan, out_id, cancel_as_stop=True)),
            id=out_id,
            operator="run_session_loop",
            kind="output",
            parents=[user_session, agent_session],
            sandbox=handle,
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
    plan = _plan(user_session, agent_session, out_id, **options)
    return _output(plan, out_id, await run_pass(plan, out_id))


async def arun_pass_emitting(
    user_session: Session,
    agent_session: Session,
    emit: Callable[[Event], None],
    **options: Unpack[PassOptions],
) -> Session:
    """`arun_session_loop`, handing each typed event to `emit` (how `Agent.stream` sees its
    passes; the final `PassStopped` is the caller's to send)."""
    out_id = new_session_id()
    plan = _plan(user_session, agent_session, out_id, emit, **options)
    return _output(plan, out_id, await run_pass(plan, out_id))


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

    plan = _plan(user_session, agent_session, out_id, sink, **options)

    async def pass_events(send: Callable[[Event], None]) -> SessionData:
        nonlocal send_event
        send_event = send
        return await run_pass(plan, out_id)

    # The memory streams load with the first streamed pass, not with `import treadle`.
    from treadle.runtime.streams import produce

    # Leaving early cancels the pass: it must not outlive its iterator.
    async with produce(pass_events) as events:
        async for event in events:
            yield event
        data = events.result()  # re-raises the pass's error
    yield PassStopped(
        session_id=out_id,
        seq=next_seq,
        stop_reason=data.stop_reason or "",
        session=_output(plan, out_id, data),
    )
