"""`run_session_loop` and `arun_session_loop`: the public entry points of one agent pass.

Arguments are validated at the call, so configuration errors (no model, a tool shadowing a
built-in, `on_event` with a custom executor) raise there and not at the first read. The lazy form
submits the pass to the runtime and returns a `Session` facade at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from treadle.errors import ConfigurationError
from treadle.llm.provider import Provider
from treadle.loop.engine import PassPlan, run_pass
from treadle.loop.executor import HttpExecutor, validate_executor
from treadle.persist.writer import default_session_path
from treadle.runtime import submit
from treadle.session import Session, new_session_id
from treadle.tools import ToolSet

__all__ = ["DEFAULT_MAX_TOOL_ROUNDS", "arun_session_loop", "run_session_loop"]

#: Tool rounds a pass may run before it stops with `stop_reason == "max_steps"`.
DEFAULT_MAX_TOOL_ROUNDS = 64


def _plan(
    user_session: Session,
    agent_session: Session,
    *,
    agent_provider: Provider | None,
    tools: Iterable[Any] | None,
    executor: object | None,
    max_tool_rounds: int,
    on_event: Callable[[Any], Any] | None,
    persist: bool,
    persist_path: str | os.PathLike[str] | None,
    out_id: str,
) -> PassPlan:
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
    if isinstance(max_tool_rounds, bool) or not isinstance(max_tool_rounds, int):
        raise ConfigurationError("max_tool_rounds must be an int.")
    if max_tool_rounds < 1:
        raise ConfigurationError(f"max_tool_rounds must be at least 1, got {max_tool_rounds}.")
    if on_event is not None and not callable(on_event):
        raise ConfigurationError("on_event must be a callable taking one stream delta.")
    if agent_provider is not None and not isinstance(agent_provider, Provider):
        raise ConfigurationError(
            f"agent_provider must be a treadle Provider, got {type(agent_provider).__name__}."
        )
    if executor is None:
        if agent_provider is None:
            raise ConfigurationError(
                "run_session_loop needs agent_provider=Provider(model=...) (or a custom executor)."
            )
        provider: Provider | None = agent_provider.resolve()
        runner: object = HttpExecutor()
    else:
        validate_executor(executor)
        if on_event is not None:
            raise ConfigurationError(
                "on_event needs the default HTTP executor (custom executors do not stream); "
                "drop on_event or the executor."
            )
        provider = agent_provider
        runner = executor
    toolset = ToolSet.build(tools, builtins=user_session.placement is not None)
    path: Path | None = None
    if persist or persist_path is not None:
        target = Path(persist_path) if persist_path is not None else None
        if target is not None and target.suffix == ".jsonl":
            path = target
        else:
            path = default_session_path(out_id, target)
    return PassPlan(
        user=user_session,
        agent=agent_session,
        provider=provider,
        tools=toolset,
        executor=runner,
        max_tool_rounds=max_tool_rounds,
        on_event=on_event,
        persist_path=path,
        stream=bool(provider.stream) if provider is not None and executor is None else False,
    )


def run_session_loop(
    user_session: Session,
    agent_session: Session,
    *,
    agent_provider: Provider | None = None,
    tools: Iterable[Any] | None = None,
    executor: object | None = None,
    max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
    on_event: Callable[[Any], Any] | None = None,
    persist: bool = False,
    persist_path: str | os.PathLike[str] | None = None,
    lazy: bool = True,
) -> Session:
    """Run one agent pass on the runtime and return its output `Session` at once.

    The output holds the user session's rows plus the pass's new rows (agent rows are never
    copied in), shares the user session's sandbox, and records both inputs as parents. Reading it
    blocks until the pass ends; `await` it from async code. `lazy=False` waits before returning.

    Args:
        user_session: The conversation so far; may itself be a pending output of another pass.
        agent_session: The agent's rows (system prompt), sent first.
        agent_provider: The model endpoint and its options.
        tools: Extra tools (`@tool` functions, `Tool`s or plain callables).
        executor: A custom executor (tests, other transports) instead of HTTP.
        max_tool_rounds: Tool rounds before the pass stops with `stop_reason == "max_steps"`.
        on_event: Called with each stream delta (run off the event loop).
        persist: Write the transcript to `.treadle/sessions/<id>.jsonl` as it grows.
        persist_path: A directory for that file, or the `.jsonl` file itself.
        lazy: Return at once (True) or after the pass ends (False).
    """
    out_id = new_session_id()
    plan = _plan(
        user_session,
        agent_session,
        agent_provider=agent_provider,
        tools=tools,
        executor=executor,
        max_tool_rounds=max_tool_rounds,
        on_event=on_event,
        persist=persist,
        persist_path=persist_path,
        out_id=out_id,
    )
    out = Session._pending(
        submit(run_pass(plan, out_id)),
        id=out_id,
        operator="run_session_loop",
        kind="output",
        parents=[user_session, agent_session],
        sandbox=user_session.sandbox_handle,
    )
    if not lazy:
        out.synchronize()
    return out


async def arun_session_loop(
    user_session: Session,
    agent_session: Session,
    *,
    agent_provider: Provider | None = None,
    tools: Iterable[Any] | None = None,
    executor: object | None = None,
    max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
    on_event: Callable[[Any], Any] | None = None,
    persist: bool = False,
    persist_path: str | os.PathLike[str] | None = None,
) -> Session:
    """Run one agent pass on the calling event loop and return the finished output `Session`.

    Same arguments and result as `run_session_loop`; use it inside your own task groups when you
    want the pass to be a plain coroutine you own.
    """
    out_id = new_session_id()
    plan = _plan(
        user_session,
        agent_session,
        agent_provider=agent_provider,
        tools=tools,
        executor=executor,
        max_tool_rounds=max_tool_rounds,
        on_event=on_event,
        persist=persist,
        persist_path=persist_path,
        out_id=out_id,
    )
    data = await run_pass(plan, out_id)
    return Session._derive(
        data,
        operator="run_session_loop",
        kind="output",
        parents=[user_session, agent_session],
        sandbox=user_session.sandbox_handle,
        id=out_id,
    )
