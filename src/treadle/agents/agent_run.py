"""`AgentRun`: the state and the loop of one agent run (never shared between runs).

A run is a sequence of passes: the first, then one more after a compaction, a transfer to
another agent (the same transcript continues under the target's instructions), a structured
output or validator retry. Around them it fires the agent hooks (`on_agent_start`/`end`,
`on_handoff`), applies error handlers (max turns, refusal, invalid output), gathers per-request
usage entries and guardrail results, and honours a soft cancel: a pass stopped after its turn
ends the run, and no further pass starts. This module never blocks the event loop and never
copies agent rows into an output session.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Coroutine, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from treadle.agents.handoffs import (
    HANDOFF_INTERRUPT,
    MAX_HANDOFFS_PER_RUN,
    Handoff,
    HandoffChoice,
    check_no_input_filter,
    handoff_rows,
    transfer_calls,
    transfer_result,
)
from treadle.agents.outcomes import (
    AgentErrorContext,
    ErrorKind,
    handled,
    refusal_error,
    refusal_of,
    replace_result,
    run_validators,
)
from treadle.agents.streaming import AgentEvent, HandoffEvent
from treadle.agents.structured import OutputState
from treadle.errors import (
    ConfigurationError,
    ContextLengthError,
    ModelRetry,
    StructuredOutputError,
    TreadleError,
)
from treadle.llm.provider import Provider
from treadle.loop import Limits, Tripwire
from treadle.loop.control import PassControl, call_user
from treadle.loop.hooks import HookContext, Hooks, both, fire
from treadle.loop.soft_stop import StopRequest, registered, sharing_stop
from treadle.runtime import submit
from treadle.session import ChunkRow, Session, SessionData, new_session_id
from treadle.tools.results import error_content

if TYPE_CHECKING:
    from treadle.agents.agent import Agent

__all__ = ["AgentRun", "RunSettings", "check_deps", "inherited", "lazy_session"]

_COMPACTION_GUARD = "treadle.auto_compaction"


@dataclass(frozen=True, slots=True)
class RunSettings:
    """Per-run overrides, for every agent of the run (handoff targets too): `agent.run(session,
    settings=RunSettings(provider=..., limits=...))`."""

    provider: Provider | None = None
    """The model endpoint to use instead of each agent's own."""
    limits: Limits | None = None
    """Per-pass limits instead of each agent's own."""
    max_tool_rounds: int | None = None
    """Tool rounds per pass instead of each agent's own."""

    def __post_init__(self) -> None:
        if self.provider is not None and not isinstance(self.provider, Provider):
            raise ConfigurationError("RunSettings.provider must be a treadle Provider.")
        if self.limits is not None and not isinstance(self.limits, Limits):
            raise ConfigurationError("RunSettings.limits must be a treadle Limits(...).")
        rounds = self.max_tool_rounds
        if rounds is not None and (isinstance(rounds, bool) or not isinstance(rounds, int)):
            raise ConfigurationError("RunSettings.max_tool_rounds must be an int or None.")

    def provider_for(self, agent: Agent) -> Provider | None:
        """The provider a pass of `agent` sends with (its output mode applied)."""
        if self.provider is None:
            return agent._provider
        return agent.spec.provider_for(self.provider) if agent.spec else self.provider


_NO_SETTINGS = RunSettings()
_running: ContextVar[AgentRun | None] = ContextVar("treadle_agent_run", default=None)


def inherited(agent: Agent) -> dict[str, Any]:
    """What a run of `agent` started inside another run (an agent used as a tool) inherits:
    the outer run's `settings`, and its `deps` when `agent` declares a `deps_type`."""
    outer = _running.get()
    if outer is None:
        return {}
    found: dict[str, Any] = {"settings": outer.settings}
    if agent.deps_type is not None and outer.deps is not None:
        found["deps"] = outer.deps
    return found


def _type_name(value: object) -> str:
    return str(getattr(value, "__name__", value))


def check_deps(agent: Agent, deps: object) -> None:
    """Refuse a run without the deps its agent declares, or with deps of another type."""
    wanted = agent.deps_type
    if wanted is None:
        return
    if deps is None:
        raise ConfigurationError(
            f"Agent {agent.name!r} declares deps_type={_type_name(wanted)}; pass deps=... "
            "to each run."
        )
    origin = typing.get_origin(wanted) or wanted
    try:  # a Protocol that is not runtime-checkable cannot be checked: type checkers do it
        wrong = isinstance(origin, type) and not isinstance(deps, origin)
    except TypeError:
        wrong = False
    if wrong:
        raise ConfigurationError(
            f"Agent {agent.name!r} takes deps of type {_type_name(wanted)}, got "
            f"{type(deps).__name__}."
        )


class AgentRun:
    """One run of an agent (and of the agents it hands off to)."""

    def __init__(
        self,
        agent: Agent,
        *,
        run_id: str,
        lazy: bool,
        hooks: Hooks | None = None,
        emit: Callable[[AgentEvent], None] | None = None,
        deps: object = None,
        settings: RunSettings | None = None,
        stored: dict[str, Any] | None = None,
    ) -> None:
        self.agent = agent
        self.stored = stored or {}
        """`store=` and `conversation=` for every pass of the run (empty without a store)."""
        if self.stored:
            check_no_input_filter(agent)
        self.deps = deps
        self.settings = settings or _NO_SETTINGS
        self.run_id = run_id
        self.lazy = lazy
        self.run_hooks = hooks
        self.emit = emit
        self.output = OutputState()
        self.compactions = 0
        self.overflow_retried = False
        self.first_pass = True
        self.choice: HandoffChoice | None = None
        self.transfers: list[dict[str, Any]] = []
        self.entries: list[Any] = []
        self.results: list[Any] = []
        self.stop = StopRequest()

    @property
    def hooks(self) -> Hooks | None:
        """The run's hooks, then the answering agent's (either may be absent)."""
        return both(self.run_hooks, self.agent.hooks)

    def context(self, session: Session) -> HookContext:
        return HookContext(self.agent.name, self.run_id, session.data.usage)

    async def run(self, session: Session) -> Session:
        token = _running.set(self)  # agents this run uses as tools inherit its settings
        try:
            return await self._run(session)
        finally:
            _running.reset(token)

    async def _run(self, session: Session) -> Session:
        with registered(self.run_id, self.stop), sharing_stop(self.stop):
            await session.wait_ready()
            await fire(self.hooks, "on_agent_start", self.context(session))
            out = self.finish(await self.passes(session))
            answer = out.output if out.output is not None else out.final_text
            await fire(self.hooks, "on_agent_end", self.context(out), answer)
            return out

    def on_message(
        self, offered: Sequence[Handoff] = ()
    ) -> Callable[[ChunkRow, PassControl], Any] | None:
        """The pass's `on_message`: ends it once a transfer offered on this pass (`offered`:
        the enabled handoffs) has its own successful result, or on an accepted final result."""
        agent = self.agent
        structured = (
            agent.spec.on_message(self.output)
            if agent.spec is not None and agent.spec.mode == "tool"
            else None
        )
        targets = {h.tool_name: h for h in offered}
        if not targets:
            return structured
        calls: dict[str, tuple[Handoff, str]] = {}

        async def hook(row: ChunkRow, control: PassControl) -> None:
            nonlocal calls
            if row.kind == "assistant":
                # The round still runs (sibling calls too); a transfer's result ends the pass.
                calls = transfer_calls(row, targets)
                self.choice = None
            elif row.kind == "tool_result" and calls and self.choice is None:
                self.choice = transfer_result(row, calls)
                if self.choice is not None:
                    control.interrupt(HANDOFF_INTERRUPT)
                    return
            if structured is not None:
                await structured(row, control)

        return hook

    async def passes(self, session: Session) -> Session:
        current = session
        while True:
            agent = self.agent
            try:
                out = await agent._pass(current, self)
            except ContextLengthError:
                if not agent.compact_on_overflow or self.overflow_retried:
                    raise
                compacted = await agent._compact(current)
                if compacted is None:
                    raise
                self.overflow_retried = True
                current = compacted
                continue
            self.first_pass = False
            metadata = out.data.metadata
            self.entries.extend(metadata.get("request_usage", ()))
            self.results.extend(metadata.get("guardrail_results", ()))
            agent.estimator.observe_pass(
                agent.agent_session.data.table.rows, current, out, agent._tools_json
            )
            tripwire = out.tripwire
            if (
                out.stop_reason == "blocked"
                and isinstance(tripwire, Tripwire)
                and tripwire.guardrail == _COMPACTION_GUARD
            ):
                self.compactions += 1
                compacted = await agent._compact(out)
                current = compacted if compacted is not None else out
                continue
            if out.stop_reason == "cancelled":
                return out
            if self.choice is not None and out.interrupt_reason == HANDOFF_INTERRUPT:
                if self.stop.requested:  # a soft cancel starts no further pass: no handoff
                    choice, self.choice = self.choice, None
                    return self.stopped_after_turn(handoff_rows(out, choice))
                current = await self.hand_off(out)
                if current.data.stop_reason == "max_steps" and "max_turns" in agent.error_handlers:
                    return await self.fail("max_turns", current, None)  # the handoff cap
                if current.data.stop_reason is not None or self.stop.requested:
                    return self.stopped_after_turn(current)
                continue
            verdict = await self.settle(out)
            if isinstance(verdict, Session):
                return verdict
            current = verdict[0]
            if self.stop.requested:
                return self.stopped_after_turn(current)

    def stopped_after_turn(self, session: Session) -> Session:
        if session.data.stop_reason is not None:
            return session
        metadata = {**session.data.metadata, "cancelled": True, "cancel_mode": "after_turn"}
        return session.with_data(stop_reason="cancelled", metadata=metadata)

    async def hand_off(self, out: Session) -> Session:
        choice, self.choice = self.choice, None
        assert choice is not None
        target = choice.handoff
        session = handoff_rows(out, choice)
        if len(self.transfers) >= MAX_HANDOFFS_PER_RUN:
            return session.with_data(stop_reason="max_steps")
        if target.input_filter is not None:
            filtered = await call_user(target.input_filter, session)
            if not isinstance(filtered, Session):
                raise ConfigurationError(
                    f"the input_filter of the handoff to {target.agent.name!r} returned "
                    f"{type(filtered).__name__}; it must return a Session."
                )
            session = filtered
        await target.run_callback(session, choice.value)
        source = self.agent.name
        await fire(self.hooks, "on_handoff", self.context(session), source, target.agent.name)
        self.transfers.append(
            {"from": source, "to": target.agent.name, "tool_call_id": choice.call_id}
        )
        if self.emit is not None:
            self.emit(HandoffEvent(agent=source, target=target.agent.name))
        self.agent = target.agent
        self.output = OutputState()
        await fire(self.hooks, "on_agent_start", self.context(session))
        return session

    async def settle(self, out: Session) -> Session | tuple[Session]:
        """The run's result, or `(session,)` to continue from after a correction."""
        agent = self.agent
        refusal = refusal_of(out)
        if refusal is not None:
            return await self.fail("refusal", out, refusal_error(agent.name, refusal))
        if out.stop_reason == "max_steps" and "max_turns" in agent.error_handlers:
            return await self.fail("max_turns", out, None)
        if agent.spec is None:
            if out.stop_reason != "final_answer" or not agent.validators:
                return out
            return await self.validate(out, out.final_text, None)
        try:
            verdict = agent.spec.finish(out, self.output)
        except StructuredOutputError as err:
            return await self.fail("invalid_output", out, err)
        if isinstance(verdict, str):
            return (out.append(ChunkRow.user(verdict)),)
        if verdict.stop_reason != "final_answer" or not agent.validators:
            return verdict
        return await self.validate(verdict, verdict.output, self.output.call_id)

    async def validate(
        self, out: Session, value: Any, call_id: str | None
    ) -> Session | tuple[Session]:
        agent = self.agent
        try:
            checked = await run_validators(agent.validators, out, value)
        except ModelRetry as retry:
            state = self.output
            state.failures += 1
            state.last_error = str(retry)
            limit = agent.spec.retries if agent.spec is not None else agent.output_retries
            if state.failures > limit:
                return await self.fail(
                    "invalid_output",
                    out,
                    StructuredOutputError(
                        f"agent {agent.name!r}: the output validators rejected every answer "
                        f"after {limit} retries (last: {retry}); raise output_retries or relax "
                        "the validator."
                    ),
                )
            if call_id:  # tool mode: the final_result call itself reports the problem
                return (replace_result(out, call_id, error_content("retry", str(retry))),)
            return (out.append(ChunkRow.user(f"Please fix your answer: {retry}")),)
        if agent.spec is None and checked == value:
            return out  # a text answer the validators kept as it was
        return out.with_data(metadata={**out.data.metadata, "output": checked})

    async def fail(self, kind: ErrorKind, out: Session, error: TreadleError | None) -> Session:
        handler = self.agent.error_handlers.get(kind)
        if handler is None:
            if error is not None:
                raise error
            return out
        context = AgentErrorContext(kind, self.agent.name, out, error)
        model = self.agent.spec.model if self.agent.spec is not None else None
        stop = "max_steps" if kind == "max_turns" else "final_answer"
        return await handled(handler, context, model, stop)

    def finish(self, out: Session) -> Session:
        """The run's result with who answered, the transfers, usage entries and guardrails."""
        metadata = dict(out.data.metadata)
        metadata["agent"] = self.agent.name
        if self.transfers:
            metadata["handoffs"] = list(self.transfers)
        if self.entries:
            metadata["request_usage"] = tuple(self.entries)
        if self.results:
            metadata["guardrail_results"] = tuple(self.results)
        return out.with_data(metadata=metadata)


def lazy_session(
    make: Callable[[], Coroutine[Any, Any, Session]],
    *,
    parents: Sequence[Session],
    operator: str,
    id: str | None = None,
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
        id=id or new_session_id(),
        operator=operator,
        kind="output",
        parents=parents,
        sandbox=sandbox,
    )
