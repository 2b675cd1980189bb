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
import copy
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, cast

import anyio
import pydantic
from typing_extensions import TypeVar

from treadle.agents.agent_run import AgentRun, RunSettings, check_deps, lazy_session
from treadle.agents.agent_tool import agent_tool
from treadle.agents.compaction import (
    DEFAULT_KEEP_LAST,
    TokenEstimator,
    _compactable,
    arun_session_compress,
    compaction_guardrail,
)
from treadle.agents.handoffs import Handoff, check_handoffs, transfer_tools, worker_handoffs
from treadle.agents.outcomes import check_error_handlers, check_retries, check_validators
from treadle.agents.streaming import (
    AgentEvent,
    AgentRunStopped,
    current_sink,
    pass_sink,
    streaming_to,
)
from treadle.agents.structured import DEFAULT_OUTPUT_RETRIES, OutputSpec, StructuredMode
from treadle.errors import ConfigurationError
from treadle.llm import validate_executor
from treadle.llm.provider import Provider
from treadle.loop import (
    DEFAULT_MAX_TOOL_ROUNDS,
    Limits,
    arun_session_loop,
    run_session_loop,
)
from treadle.loop.api import arun_pass_emitting, naming_next_pass
from treadle.loop.control import call_user
from treadle.loop.hooks import Hooks
from treadle.loop.tooling import ToolUseBehavior, check_tool_use_behavior
from treadle.session import Session, new_session_id
from treadle.tools import Tool, ToolSet
from treadle.tools.context import Deps, ToolContext, context_parameter

if TYPE_CHECKING:  # stores load with the first run given one
    from treadle.stores import PendingPass, Store

__all__ = ["MAX_COMPACTIONS_PER_RUN", "Agent", "AgentInput"]

#: Automatic compactions one run may do; past this the run goes on uncompacted (and may overflow).
MAX_COMPACTIONS_PER_RUN = 4

AgentInput = Session[Any] | str
"""What an agent accepts: a session (possibly still pending) or a user message."""

Output = TypeVar("Output", default=Any)
"""The type of an agent's structured output (`output_type`)."""

_COMPACTION_GUARD = "treadle.auto_compaction"


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


def _caller_module() -> str | None:
    """The module that built the agent (past `Agent[...]`'s alias and subclasses' __init__)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in ("typing", __name__):
        frame = frame.f_back  # type: ignore[assignment]
    return frame.f_globals.get("__name__") if frame is not None else None


class Agent(Generic[Deps, Output]):
    """A named agent: instructions, tools, a provider, limits, guardrails and an output type.

    `Agent[Deps, Output]`: `deps_type` types the `deps=` each run takes (tools, guardrails and
    callbacks read them through a `ToolContext[Deps]` parameter); `output_type` types
    `out.output` as `Output | None` (None when the pass stopped without an answer).

    Args:
        name: Shown in lineage, tool names (`as_tool`) and handoffs.
        instructions: The system prompt, or a function of the session a pass starts from
            (sync or async) returning it: dynamic instructions, computed per pass. A function
            whose parameter is annotated `ToolContext[Deps]` gets the run's context instead
            (`ctx.deps`, `ctx.session`).
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
        description: What the agent does, for the model, when it is used as a tool or a
            handoff target.
        handoffs: Agents (or `handoff(agent, ...)` values) this agent may hand the
            conversation to; each is a transfer tool, and the target continues the same
            transcript.
        hooks: Lifecycle hooks (`Hooks`) for this agent's runs and passes.
        output_validators: `fn(output)` or `fn(session, output)` checks of the final answer;
            raising `ModelRetry(message)` sends the message back to the model.
        error_handlers: `{"max_turns" | "refusal" | "invalid_output": fn}`; `fn` receives an
            `AgentErrorContext` and returns the final output instead of the stop or error.
    """

    def __init__(
        self,
        name: str,
        instructions: str | Callable[[Session], Any] | Callable[[ToolContext[Deps]], Any] = "",
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
        handoffs: Sequence[Agent | Handoff] = (),
        hooks: Hooks | None = None,
        output_validators: Sequence[Callable[..., Any]] = (),
        error_handlers: Mapping[str, Callable[..., Any]] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigurationError("an Agent needs a non-empty name, e.g. Agent('researcher').")
        self.dynamic_instructions = instructions if callable(instructions) else None
        # Asked once here: a function annotated `ToolContext[...]` gets the run's context.
        self._instructions_context: str | None = None
        if self.dynamic_instructions is not None:
            self._instructions_context = context_parameter(self.dynamic_instructions)
            instructions = ""
        if not isinstance(instructions, str):
            raise ConfigurationError(
                "instructions must be a str (the agent's system prompt) or a function of the "
                "session returning one."
            )
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
        if hooks is not None and not isinstance(hooks, Hooks):
            raise ConfigurationError(
                f"hooks must be a treadle Hooks (subclass it), got {type(hooks).__name__}."
            )
        self.hooks = hooks
        self.validators = check_validators(output_validators)
        self.error_handlers = check_error_handlers(error_handlers)
        self.output_retries = check_retries(output_retries)
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
        self.handoffs = check_handoffs(name, handoffs)
        transfers = [h.tool for h in self.handoffs]
        self._tools_json = ToolSet.build([*self.tools, *transfers]).schemas_json()  # validates
        self._provider = self.spec.provider_for(provider) if self.spec else provider
        self.agent_session = (
            Session.from_agent_prompt(instructions)
            if instructions
            else Session((), operator="from_agent_prompt", kind="agent")
        )
        self.estimator = TokenEstimator()
        # Where the agent was defined: a distributed map finds it there by its import path.
        self._defined_in = _caller_module()

    def __repr__(self) -> str:
        return f"<Agent {self.name!r}>"

    def on_worker(
        self,
        provider: Provider,
        guardrails: Sequence[Any] = (),
        *,
        _done: dict[int, Agent] | None = None,
    ) -> Agent:
        """This agent with a worker's `provider` (its share of the limits, its key) and extra
        `guardrails` (the worker's shared rate gate); everything else is the same definition.
        Handoff targets defined on the same provider get the worker's one too (they send to
        the same endpoint, within the same share); targets on another provider keep theirs."""
        done = {} if _done is None else _done
        clone = done[id(self)] = copy.copy(self)
        clone.provider = provider
        clone._provider = self.spec.provider_for(provider) if self.spec else provider
        clone.guardrails = (*guardrails, *self.guardrails)
        clone.estimator = TokenEstimator()
        clone.handoffs = worker_handoffs(self, provider, guardrails, done)
        return clone

    # -- entry points ------------------------------------------------------------------------
    def __call__(
        self,
        session: AgentInput,
        *,
        deps: Deps | None = None,
        hooks: Hooks | None = None,
        settings: RunSettings | None = None,
        store: Store | None = None,
        conversation: str | PendingPass | None = None,
    ) -> Session[Output | None]:
        """Run the agent on the runtime and return its output `Session` at once (lazy).

        `session` may be a pending output of another pass or agent: the run waits for it on
        the runtime, so chains never block the caller. `out.cancel()` stops the pass with
        `stop_reason == "cancelled"`; `out.cancel(after_turn=True)` lets the current turn
        finish first. `deps` reach tools, guardrails and callbacks that ask for a `ToolContext`
        (in memory only: never written to the transcript or a file). `hooks` (for this run)
        are called before the answering agent's own; `settings` override the provider,
        limits or tool rounds of every agent of this run (see `RunSettings`). With `store=` and
        `conversation=` the run continues that stored conversation and commits to it (as
        `run_session_loop` does).
        """
        user = as_session(session)
        check_deps(self, deps)
        from treadle.stores import store_options

        stored = store_options(store, conversation)
        run_id = new_session_id()
        return lazy_session(
            lambda: AgentRun(
                self,
                run_id=run_id,
                lazy=True,
                hooks=hooks,
                deps=deps,
                settings=settings,
                stored=stored,
            ).run(user),
            parents=[user, self.agent_session],
            operator=f"agent:{self.name}",
            id=run_id,
        )

    async def run(
        self,
        session: AgentInput,
        *,
        deps: Deps | None = None,
        hooks: Hooks | None = None,
        settings: RunSettings | None = None,
        store: Store | None = None,
        conversation: str | PendingPass | None = None,
    ) -> Session[Output | None]:
        """Run the agent on the calling event loop and return the finished output `Session`.

        Cancelling the awaiting task cancels the pass (the `CancelledError` propagates).
        Inside a streamed run (an agent used as a tool), its events join that stream.
        `store=` and `conversation=` continue a stored conversation, as on a call.
        """
        check_deps(self, deps)
        from treadle.stores import store_options

        stored = store_options(store, conversation)
        run = AgentRun(
            self,
            run_id=new_session_id(),
            lazy=False,
            hooks=hooks,
            emit=current_sink(),
            deps=deps,
            settings=settings,
            stored=stored,
        )
        return cast("Session[Output | None]", await run.run(as_session(session)))

    async def stream(
        self,
        session: AgentInput,
        *,
        deps: Deps | None = None,
        hooks: Hooks | None = None,
        settings: RunSettings | None = None,
    ) -> AsyncIterator[AgentEvent]:
        """Run the agent and yield its events as they happen (see `treadle.agents.streaming`).

        Events of every pass, of agents it hands off to and of agents it uses as tools come
        tagged with their agent's name; the last is `AgentRunStopped` with the output session.
        Leaving the loop early cancels the run.
        """
        user = as_session(session)
        check_deps(self, deps)

        async def events(send: Callable[[AgentEvent], None]) -> Session:
            with streaming_to(send):
                run = AgentRun(
                    self,
                    run_id=new_session_id(),
                    lazy=False,
                    hooks=hooks,
                    emit=send,
                    deps=deps,
                    settings=settings,
                )
                return await run.run(user)

        from treadle.runtime.streams import produce

        async with produce(events) as stream:
            async for event in stream:
                yield event
            out = stream.result()
        yield AgentRunStopped(agent=str(out.metadata.get("agent", self.name)), session=out)

    def as_tool(
        self,
        *,
        name: str | None = None,
        description: str | None = None,
        input_type: type[pydantic.BaseModel] | None = None,
        output_extractor: Callable[[Session], Any] | None = None,
    ) -> Tool:
        """This agent as an async tool, for a manager agent to delegate to.

        Each call runs the agent on a fresh session holding the task; calls in one reply run
        concurrently. By default the tool takes `task: str` and returns the structured output,
        or `{"answer", "stop_reason"}`. With `input_type` (a pydantic model) the model fills
        that model instead and the agent receives it as JSON; `output_extractor(session)` (sync
        or async) chooses what the tool returns from the agent's output session. In a streamed
        run, the agent's events join the stream under its own name.
        """
        return agent_tool(self, name, description, input_type, output_extractor)

    # -- one pass ----------------------------------------------------------------------------
    async def _pass(self, user: Session, run: AgentRun) -> Session:
        guards = [g for g in self.guardrails if run.first_pass or getattr(g, "when", "") != "input"]
        if self.compact_at_tokens is not None:
            guards.insert(0, compaction_guardrail(self, lambda: run.compactions))
        offered = [target for target in self.handoffs if await target.enabled(user)]
        tools: list[Any] = [*self.tools, *transfer_tools(offered)]
        options: dict[str, Any] = {
            "agent_provider": run.settings.provider_for(self),
            "tools": tools,
            "executor": self.executor,
            "max_tool_rounds": run.settings.max_tool_rounds or self.max_tool_rounds,
            "limits": run.settings.limits or self.limits,
            "guardrails": guards,
            "hooks": run.hooks,
            "on_message": run.on_message(offered),
            "deps": run.deps,
            "tool_use_behavior": self.tool_use_behavior,
            "reset_tool_choice": self.reset_tool_choice,
            **run.stored,
        }
        agent_session = await self._agent_session_for(user, run.deps)
        if run.emit is not None:
            with naming_next_pass(self.name):
                return await arun_pass_emitting(
                    user, agent_session, pass_sink(run.emit, self.name), **options
                )
        if not run.lazy:
            with naming_next_pass(self.name):
                return await arun_session_loop(user, agent_session, **options)
        # The lazy form owns its pass like run_session_loop does: a cancellation becomes the
        # pass's `cancelled` stop instead of an error on every read.
        with naming_next_pass(self.name):
            out = run_session_loop(user, agent_session, **options)
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

    async def _agent_session_for(self, user: Session, deps: object) -> Session:
        """The agent rows of a pass from `user`: fixed, or computed by dynamic instructions
        (given a `ToolContext` with the run's `deps` when they ask for one, else the session)."""
        make = self.dynamic_instructions
        if make is None:
            return self.agent_session
        named = self._instructions_context
        if named is None:
            text = await call_user(make, user)
        else:
            text = await call_user(make, **{named: ToolContext(session=user, deps=deps)})
        if not isinstance(text, str):
            raise ConfigurationError(
                f"the instructions function of agent {self.name!r} returned "
                f"{type(text).__name__}; it must return the system prompt as a str."
            )
        if not text:
            return self.agent_session
        return Session.from_agent_prompt(text)

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
