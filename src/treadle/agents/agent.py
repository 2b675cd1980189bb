"""`Agent`: a reusable, stateless definition of an agent (instructions, tools, provider, limits).

`agent(session)` returns a lazy output `Session` at once (like `run_session_loop`); `await
agent.run(session)` runs on the calling event loop. One `Agent` may serve any number of
concurrent passes: each run keeps its own state, and the only thing runs share is the token
estimator's calibration. Around the session loop an agent adds structured output (validation and
bounded retries, see `treadle.agents.structured`) and automatic compaction (before a request whose
estimated size reaches `compact_at_tokens`, and once after a `ContextLengthError`).

This module must never copy agent rows into an output session and never block the event loop.
"""

from __future__ import annotations

import asyncio
import os
import re
import typing
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, Generic, cast

import anyio
from typing_extensions import TypeVar

from treadle.agents.compaction import (
    DEFAULT_KEEP_LAST,
    TokenEstimator,
    _compactable,
    arun_session_compress,
    request_bytes,
)
from treadle.agents.structured import (
    DEFAULT_OUTPUT_RETRIES,
    OutputSpec,
    OutputState,
    StructuredMode,
)
from treadle.errors import ConfigurationError, ContextLengthError
from treadle.llm import validate_executor
from treadle.llm.provider import Provider
from treadle.loop import (
    DEFAULT_MAX_TOOL_ROUNDS,
    Guardrail,
    GuardrailInput,
    Limits,
    Tripwire,
    arun_session_loop,
    run_session_loop,
)
from treadle.loop.api import naming_next_pass
from treadle.loop.tooling import ToolUseBehavior, check_tool_use_behavior
from treadle.runtime import submit
from treadle.session import ChunkRow, Session, SessionData, new_session_id
from treadle.tools import FunctionTool, Tool, ToolSet
from treadle.tools.context import Deps

__all__ = ["MAX_COMPACTIONS_PER_RUN", "Agent", "AgentInput"]

#: Automatic compactions one run may do; past this the run goes on uncompacted (and may overflow).
MAX_COMPACTIONS_PER_RUN = 4

AgentInput = Session[Any] | str
"""What an agent accepts: a session (possibly still pending) or a user message."""

Output = TypeVar("Output", default=Any)
"""The type of an agent's structured output (`output_type`)."""

_COMPACTION_GUARD = "treadle.auto_compaction"
_TOOL_NAME = re.compile(r"[^A-Za-z0-9_-]")


def lazy_session(
    make: Callable[[], Coroutine[Any, Any, Session]],
    *,
    parents: Sequence[Session],
    operator: str,
) -> Session:
    """A lazy output session whose data comes from `make()`, run on the runtime.

    Like `run_lazy`, but the coroutine is created only once the runtime starts the work, so a
    cancellation that arrives first leaves no never-awaited coroutine behind.
    """

    async def produce() -> SessionData:
        return await (await make()).wait_ready()

    sandbox = next((p.sandbox_handle for p in parents if p.sandbox_handle is not None), None)
    return Session._pending(
        submit(produce()),
        id=new_session_id(),
        operator=operator,
        kind="output",
        parents=parents,
        sandbox=sandbox,
    )


def as_session(value: AgentInput) -> Session:
    """A session from an agent input (a string becomes one user row)."""
    if isinstance(value, Session):
        return value
    if isinstance(value, str):
        return Session.from_user_message(value)
    raise ConfigurationError(
        f"an agent takes a Session or a str, got {type(value).__name__}; "
        "build one with Session.from_user_message(...)."
    )


def _type_name(value: object) -> str:
    return str(getattr(value, "__name__", value))


class _Run:
    """The state of one agent run (never shared between runs)."""

    def __init__(self, deps: object = None) -> None:
        self.deps = deps
        self.output = OutputState()
        self.compactions = 0
        self.overflow_retried = False


class Agent(Generic[Deps, Output]):
    """A named agent: instructions, tools, a provider, limits, guardrails and an output type.

    `Agent[Deps, Output]`: `deps_type` types the `deps=` each run takes (tools, guardrails and
    callbacks read them through a `ToolContext[Deps]` parameter); `output_type` types
    `out.output` as `Output | None` (None when the pass stopped without an answer).

    Args:
        name: Shown in lineage, tool names (`as_tool`) and handoffs.
        instructions: The system prompt.
        tools: Tools offered on every pass (`@tool` functions, `Tool`s, plain callables).
        provider: The model endpoint. Default: `Provider(model=$TREADLE_MODEL)` (endpoint and key
            from `OPENAI_BASE_URL` / `OPENAI_API_KEY`), as the `treadle` command reads them.
        executor: A custom executor (tests: `ScriptedExecutor`) instead of HTTP.
        limits: Per-pass limits (see `Limits`).
        guardrails: Checks before each request or after each reply.
        output_type: A pydantic model; `out.output` then holds the validated answer.
        deps_type: The type of the `deps=` every run must pass (for type checkers and a clear
            error when a run passes none); None: deps are optional and untyped.
        strict_output: Send the output schema in strict mode: None (default) when it allows,
            True always (`ConfigurationError` where it cannot), False never.
        tool_use_behavior: Whether a tool round ends the pass (see `run_session_loop`); not
            with `output_type`.
        reset_tool_choice: Reset a forced `tool_choice` to `"auto"` once a tool ran.
        structured_mode: `"tool"` (a `final_result` tool, works everywhere) or `"native"`
            (`response_format` JSON schema, for servers that support it).
        output_retries: Times an invalid answer goes back to the model before
            `StructuredOutputError` is raised.
        max_tool_rounds: Tool rounds per pass before `stop_reason == "max_steps"`.
        compact_at_tokens: Compact the conversation before a request estimated at this many
            prompt tokens or more (None: only on a `ContextLengthError`).
        compact_keep_last: Non-system rows kept verbatim by a compaction.
        compact_on_overflow: On a `ContextLengthError`, compact the input and retry the pass
            once instead of failing.
        compaction_instruction: What the summariser is asked (default: keep facts and tasks).
        description: What the agent does, for the model, when it is used as a tool.
    """

    def __init__(
        self,
        name: str,
        instructions: str = "",
        *,
        tools: Iterable[Any] | None = None,
        provider: Provider | None = None,
        executor: object | None = None,
        limits: Limits | None = None,
        guardrails: Iterable[Any] | None = None,
        output_type: type[Output] | None = None,
        deps_type: type[Deps] | None = None,
        strict_output: bool | None = None,
        tool_use_behavior: ToolUseBehavior = "run_llm_again",
        reset_tool_choice: bool = True,
        structured_mode: StructuredMode = "tool",
        output_retries: int = DEFAULT_OUTPUT_RETRIES,
        max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
        compact_at_tokens: int | None = None,
        compact_keep_last: int = DEFAULT_KEEP_LAST,
        compact_on_overflow: bool = True,
        compaction_instruction: str | None = None,
        description: str | None = None,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigurationError("an Agent needs a non-empty name, e.g. Agent('researcher').")
        if not isinstance(instructions, str):
            raise ConfigurationError("instructions must be a str (the agent's system prompt).")
        if provider is None and executor is None:
            # As the `treadle` command does: the model from TREADLE_MODEL, fixed now (an eval's
            # configuration hash names it); the endpoint and key from the environment at the
            # first request, as for any `Provider` whose fields are left as None.
            env_model = os.environ.get("TREADLE_MODEL")
            if not env_model:
                raise ConfigurationError(
                    f"Agent {name!r} needs a model: pass provider=Provider(model=...) or set "
                    "TREADLE_MODEL (or pass executor=... in tests)."
                )
            provider = Provider(model=env_model)
        if provider is not None and not isinstance(provider, Provider):
            raise ConfigurationError(
                f"provider must be a treadle Provider, got {type(provider).__name__}."
            )
        if executor is not None:
            validate_executor(executor)
        if compact_at_tokens is not None and (
            isinstance(compact_at_tokens, bool)
            or not isinstance(compact_at_tokens, int)
            or compact_at_tokens < 1
        ):
            raise ConfigurationError("compact_at_tokens must be a positive int or None.")
        if isinstance(compact_keep_last, bool) or not isinstance(compact_keep_last, int):
            raise ConfigurationError("compact_keep_last must be an int.")
        self.name = name
        self.instructions = instructions
        self.description = description
        self.provider = provider
        self.executor = executor
        self.limits = limits
        self.guardrails = tuple(guardrails or ())
        self.output_type = output_type
        self.deps_type = deps_type
        self.tool_use_behavior = check_tool_use_behavior(tool_use_behavior)
        if output_type is not None and tool_use_behavior != "run_llm_again":
            raise ConfigurationError(
                f"Agent {name!r}: tool_use_behavior needs no output_type (a tool's result is "
                "then the output); drop one of the two."
            )
        self.reset_tool_choice = reset_tool_choice
        self.max_tool_rounds = max_tool_rounds
        self.compact_at_tokens = compact_at_tokens
        self.compact_keep_last = compact_keep_last
        self.compact_on_overflow = compact_on_overflow
        self.compaction_instruction = compaction_instruction
        self.spec = (
            OutputSpec(
                cast(Any, output_type), structured_mode, output_retries, strict=strict_output
            )
            if output_type is not None
            else None
        )
        extra: list[Tool] = [self.spec.tool] if self.spec and self.spec.mode == "tool" else []
        self.tools: tuple[Any, ...] = (*(tools or ()), *extra)
        self._tools_json = ToolSet.build(self.tools).schemas_json()  # validates
        self._provider = self.spec.provider_for(provider) if self.spec else provider
        self.agent_session = (
            Session.from_agent_prompt(instructions)
            if instructions
            else Session((), operator="from_agent_prompt", kind="agent")
        )
        self.estimator = TokenEstimator()

    def __repr__(self) -> str:
        return f"<Agent {self.name!r}>"

    # -- entry points ------------------------------------------------------------------------
    def __call__(self, session: AgentInput, *, deps: Deps | None = None) -> Session[Output | None]:
        """Run the agent on the runtime and return its output `Session` at once (lazy).

        `session` may be a pending output of another pass or agent: the run waits for it on
        the runtime, so chains never block the caller. `out.cancel()` stops the pass with
        `stop_reason == "cancelled"`. `deps` reach tools, guardrails and callbacks that ask for
        a `ToolContext` (in memory only: never written to the transcript or a file).
        """
        user = as_session(session)
        self._check_deps(deps)
        return lazy_session(
            lambda: self._run(user, lazy=True, deps=deps),
            parents=[user, self.agent_session],
            operator=f"agent:{self.name}",
        )

    async def run(self, session: AgentInput, *, deps: Deps | None = None) -> Session[Output | None]:
        """Run the agent on the calling event loop and return the finished output `Session`.

        Cancelling the awaiting task cancels the pass (the `CancelledError` propagates).
        """
        self._check_deps(deps)
        return await self._run(as_session(session), lazy=False, deps=deps)

    def _check_deps(self, deps: object) -> None:
        wanted = self.deps_type
        if wanted is None:
            return
        if deps is None:
            raise ConfigurationError(
                f"Agent {self.name!r} declares deps_type={_type_name(wanted)}; pass deps=... "
                "to each run."
            )
        origin = typing.get_origin(wanted) or wanted
        try:  # a Protocol that is not runtime-checkable cannot be checked: type checkers do it
            wrong = isinstance(origin, type) and not isinstance(deps, origin)
        except TypeError:
            wrong = False
        if wrong:
            raise ConfigurationError(
                f"Agent {self.name!r} takes deps of type {_type_name(wanted)}, got "
                f"{type(deps).__name__}."
            )

    def as_tool(self, *, name: str | None = None, description: str | None = None) -> Tool:
        """This agent as an async tool taking `task: str`, for a manager agent to delegate to.

        Each call runs the agent on a fresh session holding the task; calls in one reply run
        concurrently. The tool returns the structured output, or `{"answer", "stop_reason"}`.
        """
        agent = self

        async def delegate(task: str) -> Any:
            """Args:
            task: The whole task, self-contained (the agent does not see this conversation).
            """
            out = await agent.run(Session.from_user_message(task))
            if out.output is not None:
                return out.output
            return {"answer": out.final_text, "stop_reason": out.stop_reason}

        tool_name = name or _TOOL_NAME.sub("_", self.name)[:64]
        text = description or self.description or f"Ask the {self.name} agent to do a task."
        return FunctionTool(delegate, name=tool_name, description=text)

    # -- one run -----------------------------------------------------------------------------
    async def _run(self, session: Session, *, lazy: bool, deps: object = None) -> Session[Any]:
        await session.wait_ready()
        run = _Run(deps)
        current = session
        while True:
            try:
                out = await self._pass(current, run, lazy=lazy)
            except ContextLengthError:
                if not self.compact_on_overflow or run.overflow_retried:
                    raise
                compacted = await self._compact(current)
                if compacted is None:
                    raise
                run.overflow_retried = True
                current = compacted
                continue
            self.estimator.observe_pass(
                self.agent_session.data.table.rows, current, out, self._tools_json
            )
            tripwire = out.tripwire
            if (
                out.stop_reason == "blocked"
                and isinstance(tripwire, Tripwire)
                and tripwire.guardrail == _COMPACTION_GUARD
            ):
                run.compactions += 1
                compacted = await self._compact(out)
                current = compacted if compacted is not None else out
                continue
            if self.spec is None:
                return out
            verdict = self.spec.finish(out, run.output)
            if isinstance(verdict, Session):
                return verdict
            current = out.append(ChunkRow.user(verdict))

    async def _pass(self, user: Session, run: _Run, *, lazy: bool) -> Session:
        guards = list(self.guardrails)
        if self.compact_at_tokens is not None:
            guards.insert(0, self._compaction_guard(run))
        options: dict[str, Any] = {
            "agent_provider": self._provider,
            "tools": self.tools,
            "executor": self.executor,
            "max_tool_rounds": self.max_tool_rounds,
            "limits": self.limits,
            "guardrails": guards,
            "deps": run.deps,
            "tool_use_behavior": self.tool_use_behavior,
            "reset_tool_choice": self.reset_tool_choice,
        }
        if self.spec is not None and self.spec.mode == "tool":
            options["on_message"] = self.spec.on_message(run.output)
        if not lazy:
            with naming_next_pass(self.name):
                return await arun_session_loop(user, self.agent_session, **options)
        # The lazy form owns its pass like run_session_loop does: a cancellation becomes the
        # pass's `cancelled` stop instead of an error on every read.
        with naming_next_pass(self.name):
            out = run_session_loop(user, self.agent_session, **options)
        try:
            await out.wait_ready()
        except asyncio.CancelledError:
            out.cancel()
            with anyio.CancelScope(shield=True):
                await out.wait_ready()
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        return out

    def _compaction_guard(self, run: _Run) -> Guardrail:
        limit = self.compact_at_tokens
        assert limit is not None
        keep = self.compact_keep_last

        async def check(data: GuardrailInput) -> Tripwire | None:
            if run.compactions >= MAX_COMPACTIONS_PER_RUN:
                return None
            request = data.request
            rows = request.rows
            nbytes = request_bytes(request.agent_rows, rows, request.tools.schemas_json())
            estimate = self.estimator.estimate(nbytes)
            if estimate < limit or not _compactable(rows, keep):
                return None
            return Tripwire(
                reason=f"estimated context of {estimate} tokens reached compact_at_tokens={limit}",
                guardrail=_COMPACTION_GUARD,
                when="before",
                info=estimate,
            )

        return Guardrail(check, "before", _COMPACTION_GUARD)

    async def _compact(self, session: Session) -> Session | None:
        """A compacted copy of `session`, or None when there is nothing to summarise."""
        data = await session.wait_ready()
        if not _compactable(data.table.rows, self.compact_keep_last):
            return None
        return await arun_session_compress(
            session,
            self.agent_session,
            agent_provider=self.provider,
            executor=self.executor,
            instruction=self.compaction_instruction,
            keep_last=self.compact_keep_last,
        )
