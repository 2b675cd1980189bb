"""Planning a pass: the call's arguments checked and turned into a `PassPlan`.

The entry points (`treadle.loop.api`) load this module, and with it the engine, the tool layer
and the model layer, on their first call: `from treadle import run_session_loop` does not
(docs/performance.md, imports).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.errors import ConfigurationError, SandboxError
from treadle.llm.provider import Provider
from treadle.llm.turn import HttpExecutor, ModelExecutor, validate_executor
from treadle.loop.api import DEFAULT_MAX_TOOL_ROUNDS, next_pass_name
from treadle.loop.control import Limits, split_guardrails
from treadle.loop.events import Event
from treadle.loop.hooks import Hooks
from treadle.loop.plan import PassPlan
from treadle.loop.soft_stop import current_stop
from treadle.loop.tooling import ToolUseBehavior, check_stop_names, check_tool_use_behavior
from treadle.session import Session, SessionData
from treadle.telemetry import capture_parent
from treadle.tools import ToolSet
from treadle.tools.context import context_parameter

if TYPE_CHECKING:  # loaded with the first pass that uses a store (docs/performance.md)
    from treadle.stores import PendingPass, Store

__all__ = ["PLAN_FIELDS", "pass_output", "plan_in_order", "plan_pass"]

PLAN_FIELDS = (
    "user", "agent", "provider", "tools", "executor", "max_tool_rounds", "on_event",
    "persist_path", "stream", "limits", "guardrails", "on_message", "approvals", "emit",
    "trace_parent", "agent_name", "hooks", "stop", "tool_guardrails", "tool_use_behavior",
    "reset_tool_choice", "on_message_context", "deps", "store", "conversation",
)  # fmt: skip
"""`PassPlan`'s fields in the order `plan_in_order` gives them (a test checks it)."""

_NO_LIMITS = Limits()  # frozen: every pass without limits shares it
_HTTP = HttpExecutor()  # stateless: every HTTP pass shares it


def plan_pass(
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
    """The call's arguments checked (raising `ConfigurationError` at the call) and planned."""
    return plan_in_order(
        user_session, agent_session, out_id, emit, agent_provider, provider, tools, executor,
        max_tool_rounds, on_event, persist, persist_path, limits, guardrails, on_message,
        approvals, hooks, deps, tool_use_behavior, reset_tool_choice, store, conversation,
    )  # fmt: skip


def plan_in_order(
    user_session: Session,
    agent_session: Session,
    out_id: str,
    emit: Callable[[Event], None] | None,
    agent_provider: Provider | None,
    provider: Provider | None,
    tools: Iterable[Any] | None,
    executor: object | None,
    max_tool_rounds: int,
    on_event: Callable[[Any], Any] | None,
    persist: bool,
    persist_path: str | os.PathLike[str] | None,
    limits: Limits | None,
    guardrails: Iterable[Any] | None,
    on_message: Callable[..., Any] | None,
    approvals: Mapping[str, bool | str] | None,
    hooks: Hooks | None,
    deps: Any,
    tool_use_behavior: ToolUseBehavior,
    reset_tool_choice: bool,
    store: Store | None,
    conversation: str | PendingPass | None,
) -> PassPlan:
    """`plan_pass` with every argument given by position, in `plan_pass`'s order.

    `run_session_loop` calls this: binding twenty-two keyword arguments costs about 1.5 µs per
    call in CPython 3.11, a tenth of a lazy submission (docs/performance.md, issue 33).
    """
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
    if on_event is not None and not callable(on_event):
        raise ConfigurationError("on_event must be callable.")
    if on_message is not None and not callable(on_message):
        raise ConfigurationError("on_message must be callable.")
    behavior = check_tool_use_behavior(tool_use_behavior)
    if limits is not None and not isinstance(limits, Limits):
        raise ConfigurationError("limits must be a treadle Limits(...).")
    if hooks is not None and not isinstance(hooks, Hooks):
        raise ConfigurationError(
            f"hooks must be a treadle Hooks (subclass it), got {type(hooks).__name__}."
        )
    if approvals is not None and (
        not isinstance(approvals, Mapping)
        or not all(isinstance(d, bool | str) for d in approvals.values())
    ):  # a stray 0, [] or dict would read as an approval
        raise ConfigurationError("approvals must map tool call ids to True, False or a reason.")
    if store is not None or conversation is not None:
        # Loads with the first store. From the module, not the package: a package's
        # `from ... import` runs importlib's `_handle_fromlist` (Python) on every pass.
        from treadle.stores.store import check_store_arguments

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
    pass_guards, tool_guards = split_guardrails(guardrails) if guardrails is not None else ((), ())
    agent_name = next_pass_name.get()
    if agent_name is not None:  # this pass only: the tasks it starts copy the context from here
        next_pass_name.set(None)
    # By position, in field order (`PLAN_FIELDS`, checked by the tests): keyword binding of
    # twenty-five fields cost 1.7 µs of every submission, position 0.5 µs (docs/performance.md).
    return PassPlan(
        user_session,
        agent_session,
        resolved,
        toolset,
        runner,
        max_tool_rounds,
        on_event,
        path,
        bool(resolved.stream) if resolved is not None and executor is None else False,
        limits or _NO_LIMITS,
        pass_guards,
        on_message,
        dict(approvals) if approvals else None,
        emit,
        capture_parent(),
        agent_name,
        hooks,
        current_stop(),
        tool_guards,
        behavior,
        bool(reset_tool_choice),
        context_parameter(on_message) if on_message is not None else None,
        deps,
        store,
        conversation,
    )


def pass_output(plan: PassPlan, out_id: str, data: SessionData) -> Session:
    return Session._derive(
        data,
        operator="run_session_loop",
        kind="output",
        parents=[plan.user, plan.agent],
        sandbox=plan.user.sandbox_handle,
        id=out_id,
    )
