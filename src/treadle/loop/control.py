"""Control of a pass: `Limits`, guardrails and their `Tripwire`, and `PassControl` for interrupts.

Every stop ends the pass with a `stop_reason` and keeps the transcript:

| mechanism | stop_reason | resumable |
| --- | --- | --- |
| `Limits.max_steps` / `max_tool_calls` | `max_steps` | yes |
| `Limits.max_total_tokens`, budget callback | `budget` | yes |
| `Limits.deadline_seconds` | `deadline` | yes |
| `PassControl.interrupt`, a tool needing approval | `interrupted` | yes |
| a guardrail tripwire | `blocked` | no (by design) |
| cancellation | `cancelled` | yes |

This module defines values and runs user callbacks; sync callbacks run in worker threads so a
slow check never stalls other passes on the loop.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio

from treadle.errors import ConfigurationError, GuardrailError
from treadle.runtime.threads import _USER_CODE, run_user_code
from treadle.session.rows import valid_text
from treadle.tools.context import ToolContext, context_parameter

if TYPE_CHECKING:
    from treadle.llm import ChatCompletion, CompletionRequest
    from treadle.session import Session, ToolCall

__all__ = [
    "DEFAULT_GUARDRAIL_TIMEOUT",
    "Guardrail",
    "GuardrailInput",
    "GuardrailResult",
    "Limits",
    "PassControl",
    "ToolGuardrail",
    "ToolGuardrailInput",
    "Tripwire",
    "after_model",
    "before_model",
    "call_user",
    "normalise_guardrails",
    "split_guardrails",
    "tool_guardrails_of",
]


@dataclass(frozen=True, slots=True)
class Limits:
    """Limits of one pass; reaching one ends it with a stop reason instead of raising."""

    max_steps: int | None = None
    """Tool rounds before `stop_reason == "max_steps"` (overrides `max_tool_rounds`)."""
    max_total_tokens: int | None = None
    """Tokens this pass may use before `stop_reason == "budget"`."""
    deadline_seconds: float | None = None
    """Wall-clock seconds from the pass start before `stop_reason == "deadline"`; a model request
    or tool call still running then is cancelled (a sync tool's thread is abandoned) and the
    call is reported to the model as `timeout`."""
    max_tool_calls: int | None = None
    """Tool calls this pass may run before `stop_reason == "max_steps"`."""
    tool_timeout_seconds: float | None = None
    """Seconds a tool call may run when its tool sets no `timeout` (None:
    `treadle.tools.DEFAULT_TOOL_TIMEOUT`); a call is also never let run past the deadline."""
    final_answer_on_limit: bool = False
    """On `max_steps` or `budget`, ask for one last completion without tools, so the user still
    gets an answer (the stop reason stays the limit's)."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "max_total_tokens", "max_tool_calls"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigurationError(f"Limits.{name} must be an int or None.")
            if value is not None and value < 1:
                raise ConfigurationError(f"Limits.{name} must be at least 1, got {value}.")
        for name in ("deadline_seconds", "tool_timeout_seconds"):
            seconds = getattr(self, name)
            if seconds is not None and (isinstance(seconds, bool) or not seconds > 0):
                raise ConfigurationError(f"Limits.{name} must be a positive number.")


@dataclass(frozen=True, slots=True)
class Tripwire:
    """Why a guardrail blocked a pass (`out.metadata["tripwire"]`)."""

    reason: str
    """What the guardrail said."""
    guardrail: str
    """The guardrail's name."""
    when: Literal["before", "after", "input", "output", "tool_input", "tool_output"]
    """`before`/`input`: the model was not called (or its call was cancelled and not charged);
    `after`/`output`: its reply was discarded; `tool_*`: a tool guardrail stopped the pass."""
    info: Any = None
    """Anything the guardrail attached."""

    def __post_init__(self) -> None:
        # The reason often quotes the model's reply: text a file or database can hold, so the
        # trailer (JSONL) and the store's commit keep the same (see `valid_text`).
        object.__setattr__(self, "reason", valid_text(self.reason))
        object.__setattr__(self, "guardrail", valid_text(self.guardrail))


@dataclass(frozen=True, slots=True)
class GuardrailInput:
    """What a guardrail sees."""

    session: Session
    """The output session so far."""
    request: CompletionRequest
    """The request about to be sent (before) or that was sent (after)."""
    reply: ChatCompletion | None = None
    """The model's reply (after guardrails only)."""


GuardrailWhen = Literal["before", "after", "input", "output"]
#: Seconds a guardrail check may run before its pass fails with `GuardrailError`
#: (`Guardrail(timeout=...)` / `ToolGuardrail(timeout=...)` override; a pass deadline bounds it).
DEFAULT_GUARDRAIL_TIMEOUT = 60.0


def _check_timeout(owner: str, timeout: Any) -> None:
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not ok or not (0 < timeout < math.inf):
        raise ConfigurationError(f"{owner}.timeout must be a positive number of seconds.")


async def _bounded(label: str, limit: float, fn: Callable[..., Any], *args: Any) -> Any:
    """Call a guardrail check within `limit` seconds (a sync one's thread is abandoned)."""
    with anyio.move_on_after(limit) as scope:
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
            return await fn(*args)
        result = await _USER_CODE.run(functools.partial(fn, *args), abandon_on_cancel=True)
        return (await result) if inspect.isawaitable(result) else result
    assert scope.cancelled_caught
    raise GuardrailError(
        f"guardrail {label} ran over {limit} s, so its pass failed; make it return sooner "
        "or raise its timeout=."
    )


@dataclass(frozen=True, slots=True)
class Guardrail:
    """A check on a pass's requests or replies.

    `check(input)` returns None or False to let the pass go on, or trips the wire by returning
    True, a reason string, or a `Tripwire`. An exception raised by a check fails the pass.
    `when` says what it checks: `"before"` each request, `"after"` each reply, `"input"` the
    first request only (with `parallel=True`, concurrently with that model call, which is
    cancelled and not charged when the wire trips), `"output"` each reply that calls no tools
    (the final answer). Guardrails of one kind run concurrently with each other, and every
    result, passing ones too, is in `out.metadata["guardrail_results"]`. A check with a keyword
    parameter annotated `ToolContext` (e.g. `ctx: ToolContext[MyDeps]`) also receives the pass's
    context there: its `deps`, usage and deadline.
    """

    check: Callable[..., Any]
    when: GuardrailWhen = "before"
    name: str = ""
    parallel: bool = True
    """`"input"` guardrails only: run concurrently with the first model call (False: before)."""
    timeout: float = DEFAULT_GUARDRAIL_TIMEOUT
    """Seconds the check may run before the pass fails with `GuardrailError`."""
    context_param: str | None = field(default=None, init=False, repr=False, compare=False)
    """The check's parameter that receives the `ToolContext` (found once, by annotation)."""

    def __post_init__(self) -> None:
        if not callable(self.check):
            raise ConfigurationError("Guardrail.check must be callable.")
        if self.when not in ("before", "after", "input", "output"):
            raise ConfigurationError(
                "Guardrail.when must be 'before', 'after', 'input' or 'output'."
            )
        _check_timeout("Guardrail", self.timeout)
        object.__setattr__(self, "context_param", context_parameter(self.check))

    @property
    def label(self) -> str:
        """The name shown in tripwires and events."""
        return self.name or getattr(self.check, "__name__", "guardrail")

    async def run(
        self, data: GuardrailInput, context: ToolContext | None = None
    ) -> Tripwire | None:
        """Run the check (with `context` when it asks for one); return a tripwire when it trips."""
        param = self.context_param
        check = self.check
        if param is not None and context is not None:
            check = functools.partial(check, **{param: context})
        verdict = await _bounded(self.label, self.timeout, check, data)
        return _verdict(verdict, self.label, self.when)


def _verdict(verdict: Any, label: str, when: Any) -> Tripwire | None:
    if verdict is None or verdict is False:
        return None
    if isinstance(verdict, Tripwire):
        return verdict
    reason = verdict if isinstance(verdict, str) else f"{label} tripped"
    return Tripwire(reason=reason, guardrail=label, when=when)


@dataclass(frozen=True, slots=True)
class GuardrailResult:
    """One guardrail's verdict (`out.metadata["guardrail_results"]` holds all of them)."""

    guardrail: str
    """The guardrail's name."""
    when: str
    """Its kind: `before`, `after`, `input`, `output`, `tool_input` or `tool_output`."""
    tripwire: Tripwire | None = None
    """The tripwire when it tripped, else None (it passed)."""

    @property
    def tripped(self) -> bool:
        """True when the guardrail tripped."""
        return self.tripwire is not None


@dataclass(frozen=True, slots=True)
class ToolGuardrailInput:
    """What a tool guardrail sees: the call, and (`tool_output` only) the result's JSON text."""

    call: ToolCall
    """The tool call (name, id, JSON arguments)."""
    content: str | None = None
    """The tool result's content, as the model would see it (`tool_output` only)."""


@dataclass(frozen=True, slots=True)
class ToolGuardrail:
    """A check on tool calls (`when="tool_input"`, before the call runs) or their results
    (`"tool_output"`, before the model sees them).

    `check(ToolGuardrailInput)` returns None/False to allow; a string to *reject* (input: the
    call does not run and the model is told the reason; output: the model sees the reason
    instead of the result); or a `Tripwire` to stop the pass with `stop_reason == "blocked"`.
    `tools` limits it to those tool names (empty: every tool).
    """

    check: Callable[[ToolGuardrailInput], Any]
    when: Literal["tool_input", "tool_output"] = "tool_input"
    name: str = ""
    tools: frozenset[str] = frozenset()
    timeout: float = DEFAULT_GUARDRAIL_TIMEOUT
    """Seconds the check may run before the pass fails with `GuardrailError`."""

    def __post_init__(self) -> None:
        if not callable(self.check):
            raise ConfigurationError("ToolGuardrail.check must be callable.")
        _check_timeout("ToolGuardrail", self.timeout)
        if self.when not in ("tool_input", "tool_output"):
            raise ConfigurationError("ToolGuardrail.when must be 'tool_input' or 'tool_output'.")
        object.__setattr__(self, "tools", frozenset(self.tools))

    @property
    def label(self) -> str:
        """The name shown in results and tripwires."""
        return self.name or getattr(self.check, "__name__", "tool_guardrail")

    def applies(self, tool_name: str) -> bool:
        """True when this guardrail checks calls of `tool_name`."""
        return not self.tools or tool_name in self.tools

    async def run(self, data: ToolGuardrailInput) -> str | Tripwire | None:
        """Run the check: None (allow), a rejection message, or a tripwire."""
        verdict = await _bounded(self.label, self.timeout, self.check, data)
        if verdict is None or verdict is False:
            return None
        if isinstance(verdict, Tripwire):
            return verdict
        if verdict is True:
            return f"{self.label} rejected this call"
        return str(verdict)


def before_model(fn: Callable[..., Any]) -> Guardrail:
    """Decorator: a guardrail that sees each request; a trip means the model is not called."""
    return Guardrail(fn, "before", getattr(fn, "__name__", ""))


def after_model(fn: Callable[..., Any]) -> Guardrail:
    """Decorator: a guardrail that sees each reply; a trip discards the reply."""
    return Guardrail(fn, "after", getattr(fn, "__name__", ""))


def split_guardrails(
    items: Iterable[Any] | None,
) -> tuple[tuple[Guardrail, ...], tuple[ToolGuardrail, ...]]:
    """`guardrails=` read once: the pass's `Guardrail`s (plain callables run `before`) and the
    `ToolGuardrail`s, so a generator gives both (reading it twice saw nothing the second time)."""
    if items is None:
        return (), ()
    if isinstance(items, (Guardrail, str)) or callable(items):
        raise ConfigurationError("guardrails takes a list, e.g. guardrails=[my_check].")
    out: list[Guardrail] = []
    tool_guards: list[ToolGuardrail] = []
    for item in items:
        if isinstance(item, Guardrail):
            out.append(item)
        elif isinstance(item, ToolGuardrail):
            tool_guards.append(item)
        elif callable(item):
            out.append(Guardrail(item, "before", getattr(item, "__name__", "")))
        else:
            raise ConfigurationError(
                f"a guardrail must be a Guardrail or a callable, got {type(item).__name__}."
            )
    return tuple(out), tuple(tool_guards)


def normalise_guardrails(items: Iterable[Any] | None) -> tuple[Guardrail, ...]:
    """Guardrails from a list of `Guardrail`s or plain callables (plain ones run `before`);
    `ToolGuardrail`s are kept apart (see `tool_guardrails_of`; `split_guardrails` gives both
    from one read)."""
    return split_guardrails(items)[0]


def tool_guardrails_of(items: Iterable[Any] | None) -> tuple[ToolGuardrail, ...]:
    """The `ToolGuardrail`s among `guardrails=` items."""
    if items is None or isinstance(items, (Guardrail, str)) or callable(items):
        return ()
    return tuple(item for item in items if isinstance(item, ToolGuardrail))


@dataclass(slots=True)
class PassControl:
    """Handed to `on_message(row, control)`: lets the callback interrupt its pass."""

    session_id: str
    """Id of the output session being produced."""
    reason: str | None = None
    """Set by `interrupt`."""
    data: dict[str, Any] = field(default_factory=dict)

    def interrupt(self, reason: str = "interrupted") -> None:
        """End the pass after the current step with `stop_reason == "interrupted"`."""
        self.reason = reason or "interrupted"

    @property
    def interrupted(self) -> bool:
        """True once `interrupt` was called."""
        return self.reason is not None


async def call_user(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a user callback: async ones are awaited, sync ones run in a worker thread."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        return await fn(*args, **kwargs)
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    result = await run_user_code(fn, *args)
    if inspect.isawaitable(result):
        return await result
    return result


def approvals_of(
    tools: Mapping[str, Any],
    approvals: Mapping[str, bool | str] | None,
    calls: Sequence[ToolCall],
    metadata: dict[str, Any],
    started: Collection[str] = (),
    prior: Mapping[str, bool | str] | None = None,
) -> dict[str, str] | None:
    """The denied calls of a round (id -> reason), or None when some call still waits for a
    decision (then `metadata` holds `pending_approvals` and `approval_reason`). A call in
    `started` (recorded as started by a pass this one resumes, its outcome unknown) was decided
    before it started: it is never asked for again (given again, the approval would run it a
    second time); the round answers it as of unknown outcome. `prior`: decisions given to an
    earlier pass on this round that stopped for others (kept in `approval_decisions`): a
    decision is given once, however many resumes the round takes.

    A round that is decided spends the decisions given for it: `approvals` (the pass's own
    copy, `PassPlan.approvals`) loses its calls' ids, and all of it once a round with a call
    needing approval is decided (the calls the user was shown), so a later call that reuses an
    id (providers that number calls per reply, or send none and get `call_<n>`) is asked for
    again: a decision is for the call the user saw."""
    given = approvals
    if prior:
        approvals = {**prior, **(approvals or {})}
    waiting = [
        c
        for c in calls
        if c.name in tools
        and tools[c.name].needs_approval
        and c.id not in started
        and approval_decision(approvals, c.id) is None
    ]
    if waiting:
        metadata["pending_approvals"] = [
            {"id": c.id, "name": c.name, "arguments": c.arguments} for c in waiting
        ]
        metadata["approval_reason"] = "approval required for " + ", ".join(c.name for c in waiting)
        decided = {c.id: d for c in calls if (d := approval_decision(approvals, c.id)) is not None}
        if decided:  # kept for the resume that decides the rest
            metadata["approval_decisions"] = decided
        return None
    metadata.pop("pending_approvals", None)
    metadata.pop("approval_decisions", None)
    denied: dict[str, str] = {}
    for c in calls:
        if c.id in started:  # it may have run: a denial now would tell the model it did not
            continue
        decision = approval_decision(approvals, c.id)
        if decision is False or isinstance(decision, str):
            denied[c.id] = decision if isinstance(decision, str) else ""
    if isinstance(given, dict):
        if any(c.name in tools and tools[c.name].needs_approval for c in calls):
            given.clear()  # the decisions were for these calls: none is left for later ones
        else:
            for c in calls:
                given.pop(c.id, None)
    return denied


def approval_decision(
    approvals: Mapping[str, bool | str] | None, call_id: str
) -> bool | str | None:
    """The user's decision on a call: True (run), False or a reason (deny), None (undecided)."""
    if not approvals:
        return None
    return approvals.get(call_id)
