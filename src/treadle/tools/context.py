"""`ToolContext[Deps]`: what a tool may know about the call it serves (deps, session, usage, call).

A tool asks for it by declaring a parameter annotated `ToolContext` (or `ToolContext[MyDeps]`; as
shorthands, `Session` or `Sandbox`); the dispatcher fills it in and leaves it out of the schema
the model sees. Guardrails and pass callbacks (`on_message`, `on_budget_exceeded`) receive it the
same way: by a parameter annotated with the type, never by a parameter's or type's name. The
context is a value: building one does no I/O, and the sandbox opens only when a tool reads it.
`deps` is whatever the caller passed for this pass (`agent(..., deps=...)`,
`run_session_loop(..., deps=...)`); it lives only in memory and is never written to a transcript
or a persisted file.
"""

from __future__ import annotations

import inspect
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Union

from typing_extensions import TypeVar

from treadle._frozen import quick_init
from treadle.errors import ToolError
from treadle.session import Session, ToolCall, Usage

if TYPE_CHECKING:
    from treadle.sandbox import Sandbox

__all__ = ["Deps", "ToolContext", "context_parameter", "injection_of"]

Deps = TypeVar("Deps", default=Any)
"""The type of the dependencies a pass carries (`Agent[Deps, Output]`, `ToolContext[Deps]`)."""

_USAGE = Usage()


@quick_init
@dataclass(frozen=True, slots=True)
class ToolContext(Generic[Deps]):
    """The calling pass, as a tool, guardrail or callback sees it.

    Annotate a parameter `ToolContext[MyDeps]` to have `deps` typed as `MyDeps`.
    """

    __treadle_inject__: ClassVar[str] = "context"

    session: Session | None = None
    """The pass's output session so far (None when a tool runs outside a pass)."""
    pass_id: str | None = None
    """Id of the output session the pass produces."""
    deadline: float | None = None
    """`time.monotonic()` value by which the pass must end (None: no deadline)."""
    call: ToolCall | None = None
    """The call being served (set by the dispatcher for each call; None in guardrails)."""
    tool_timeout: float | None = None
    """The pass's timeout for tools that set none (None: `DEFAULT_TOOL_TIMEOUT`)."""
    deps: Deps = field(default=typing.cast(Any, None))
    """What the caller passed as `deps=` for this pass (None when it passed nothing)."""
    usage: Usage = _USAGE
    """Tokens this pass has used so far."""

    @property
    def tool_call_id(self) -> str | None:
        """The id of the call being served (None outside a tool call)."""
        return self.call.id if self.call is not None else None

    @property
    def sandbox(self) -> Sandbox:
        """The session's sandbox, opened on first use; `ToolError` when the pass has none."""
        session = self.require_session()
        return session.require_sandbox()

    def require_session(self) -> Session:
        """The calling session; `ToolError` when the tool runs outside a pass."""
        if self.session is None:
            name = self.call.name if self.call is not None else "this tool"
            raise ToolError(f"tool {name!r} needs the calling session, but none was given.")
        return self.session

    def seconds_left(self) -> float | None:
        """Seconds until the pass's deadline (None without one; never negative)."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    def for_call(self, call: ToolCall) -> ToolContext[Deps]:
        """This context serving `call`."""
        return ToolContext(
            self.session,
            self.pass_id,
            self.deadline,
            call,
            self.tool_timeout,
            self.deps,
            self.usage,
        )


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def injection_of(annotation: Any) -> str | None:
    """What `annotation` asks the dispatcher for (`"context"`, `"session"`, `"sandbox"`), by the
    type's `__treadle_inject__` marker; a parametrised `ToolContext[X]` counts as its origin."""
    base = _strip_optional(annotation)
    base = typing.get_origin(base) or base
    if not isinstance(base, type):
        return None
    what = getattr(base, "__treadle_inject__", None)
    return what if what in ("session", "sandbox", "context") else None


def context_parameter(fn: Callable[..., Any]) -> str | None:
    """The name of `fn`'s keyword parameter annotated `ToolContext`, if any (checked once, when a
    callback is configured, so asking costs nothing per round)."""
    # A callable object's hints live on its class's `__call__` (resolved in that module).
    target = fn if inspect.isroutine(fn) else type(fn).__call__
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # some other annotation does not resolve: resolve each one alone
        hints = {}
    namespace = dict(getattr(target, "__globals__", {}))
    for param in sig.parameters.values():
        if param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            continue
        annotation = hints.get(param.name, param.annotation)
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, namespace)  # a forward reference, as hints do
            except Exception:
                continue
        if injection_of(annotation) == "context":
            return param.name
    return None
