"""`Tool`, the `@tool` decorator and `BaseTool`: what a model may call, its schema and validation.

A function tool gets its name from the function, its description and parameter descriptions from
the docstring, and its JSON schema and argument validation from the type hints (through a pydantic
model built once at decoration time). A parameter annotated `ToolContext` receives the calling
pass's context; `Session` and `Sandbox` are shorthands for its session and sandbox. Those
parameters are found by type (each such type declares `__treadle_inject__`), never by name, and
are left out of the schema. `BaseTool` is the hand-written form: class attributes `name`,
`description`, `parameters` (a JSON schema) and a sync or async `__call__`.

`BaseTool` lives in `treadle.tools.base`.

This module must never run a tool on the event loop thread when the tool is sync (sync tools go to
`treadle.tools.threads`), and never import the sandbox layer above it.
"""

from __future__ import annotations

import abc
import functools
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Generic, Literal, overload

import pydantic
import pydantic_core
from typing_extensions import ParamSpec, TypeVar

from treadle.errors import ConfigurationError, ToolArgumentsError
from treadle.tools.context import ToolContext, injection_of
from treadle.tools.docstrings import parse_docstring
from treadle.tools.schema import build_arguments, docstring_of, resolve_strict
from treadle.tools.threads import run_sync_tool

__all__ = [
    "ErrorPolicy",
    "FunctionTool",
    "IsEnabled",
    "ResourceKey",
    "TimeoutPolicy",
    "Tool",
    "tool",
]

ResourceKey = str | Callable[[Mapping[str, Any]], str | None] | None
"""A fixed key, or a function of the validated arguments returning one (None: no ordering)."""

Injected = Literal["session", "sandbox", "context"]

ErrorPolicy = Literal["report", "raise"] | Callable[[Exception], str]
"""What happens when a tool raises: `"report"` (the model gets a `tool_execution_exception`
body), `"raise"` (the exception fails the pass), or a function of the exception returning the
message the model sees in that body (`def explain(error: Exception) -> str`; a tool's own
`CancelledError` is passed to it too). A `ToolError` the tool raises (such as
`ToolArgumentsError`) is reported as its own `error_kind` and bypasses `on_error`."""

TimeoutPolicy = Literal["report", "raise"]
"""What a timed-out call does: `"report"` (the model gets a `timeout` body) or `"raise"` (the
pass fails with `ToolTimeoutError`)."""

IsEnabled = bool | Callable[[ToolContext[Any]], Any]
"""Whether a tool is offered: a bool, or a function of the pass's `ToolContext` returning one
(sync or async), asked before each model request. Its time counts against the pass's deadline;
a function that raises fails the pass with `ToolEnabledError` naming the tool."""

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

P = ParamSpec("P", default=...)
R = TypeVar("R", default=Any)


class Tool(abc.ABC):
    """Something a model can call: a name, a description, a JSON schema and an implementation.

    Build one with `@tool` (a function) or by subclassing `BaseTool` (a hand-written schema).
    """

    name: str
    """The name the model calls (letters, digits, `_` and `-`, at most 64 characters)."""
    description: str
    """What the tool does, for the model."""
    parameters: dict[str, Any]
    """The JSON schema of the arguments object."""
    timeout: float | None = None
    """Seconds before the call is abandoned and reported as `timeout` (None: the pass's
    `Limits.tool_timeout_seconds`, else `DEFAULT_TOOL_TIMEOUT`; `math.inf`: no limit)."""
    parallel_safe: bool = True
    """False: calls of this tool run one at a time, in call order."""
    resource_key: ResourceKey = None
    """Calls with the same key run one at a time in call order; others run concurrently."""
    max_result_chars: int | None = None
    """Cap on each text field of this tool's results (default `MAX_TEXT_CHARS`)."""
    needs_approval: bool = False
    """A human must approve each call (stored for the approval layer)."""
    idempotent: bool = False
    """Repeating a call has no further effect (stored for retry and resume logic)."""
    injected: Mapping[str, Injected] = types.MappingProxyType({})
    """Parameters the dispatcher fills in (`"session"`, `"sandbox"` or `"context"`), not in the
    schema."""
    strict: bool | None = False
    """Send the schema in OpenAI's strict mode (`"strict": true`, closed objects, every property
    required). None: when the schema allows it without changing its meaning (`@tool` and
    `BaseTool` default); True: always (an error where it cannot be strict)."""
    on_error: ErrorPolicy = "report"
    """What a raising call does (see `ErrorPolicy`)."""
    on_timeout: TimeoutPolicy = "report"
    """What a timed-out call does (see `TimeoutPolicy`)."""
    is_enabled: IsEnabled = True
    """Whether the tool is offered (see `IsEnabled`); a disabled tool's calls are unknown."""

    _schema_json: bytes | None = None
    _wire: tuple[dict[str, Any], bool] | None = None

    def schema(self) -> dict[str, Any]:
        """The OpenAI tool schema: `{"type": "function", "function": {...}}`."""
        parameters, strict = self._wire_parameters()
        function: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "parameters": parameters,
        }
        if strict:
            function["strict"] = True
        return {"type": "function", "function": function}

    def _wire_parameters(self) -> tuple[dict[str, Any], bool]:
        """The parameters schema as sent, and whether it is sent strict (decided once)."""
        if self._wire is None:
            self._wire = resolve_strict(f"tool {self.name!r}", self.parameters, self.strict)
        return self._wire

    def _set_policies(
        self,
        strict: bool | None,
        on_error: ErrorPolicy,
        on_timeout: TimeoutPolicy,
        is_enabled: IsEnabled,
    ) -> None:
        if on_error not in ("report", "raise") and not callable(on_error):
            raise ConfigurationError(
                f"tool {self.name!r}: on_error must be 'report', 'raise' or a function of the "
                "exception returning the message the model sees."
            )
        if callable(on_error) and _is_async_callable(on_error):
            raise ConfigurationError(
                f"tool {self.name!r}: on_error must be a plain (not async) function of the "
                "exception returning the message the model sees; compute the message without "
                "awaiting."
            )
        if on_timeout not in ("report", "raise"):
            raise ConfigurationError(f"tool {self.name!r}: on_timeout must be 'report' or 'raise'.")
        if not isinstance(is_enabled, bool) and not callable(is_enabled):
            raise ConfigurationError(
                f"tool {self.name!r}: is_enabled must be a bool or a function of the context."
            )
        if callable(is_enabled) and not _takes_one(is_enabled):
            raise ConfigurationError(
                f"tool {self.name!r}: is_enabled must take one argument (the pass's "
                "ToolContext), e.g. `def enabled(context: ToolContext) -> bool`."
            )
        if strict not in (None, True, False):
            raise ConfigurationError(f"tool {self.name!r}: strict must be True, False or None.")
        self.strict = strict
        self.on_error = on_error
        self.on_timeout = on_timeout
        self.is_enabled = is_enabled
        self._wire = None
        self._wire_parameters()  # strict=True on a schema that cannot be strict fails here

    def schema_json(self) -> bytes:
        """`schema()` encoded as JSON once (the loop joins these bytes into request bodies)."""
        if self._schema_json is None:
            self._schema_json = pydantic_core.to_json(self.schema())
        return self._schema_json

    @abc.abstractmethod
    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments to call with; raises `ToolArgumentsError` naming the bad field paths."""

    @abc.abstractmethod
    async def invoke(self, arguments: Mapping[str, Any], *, context: ToolContext) -> Any:
        """Run the tool with validated `arguments`, injecting the context values it asks for.

        No timeout here: `run_tool_calls` applies `timeout`. Sync implementations run on the
        sync-tool threads, never on the event loop.
        """

    def key_for(self, arguments: Mapping[str, Any]) -> str | None:
        """The ordering key of a call with these validated arguments (None: fully concurrent)."""
        key = self.resource_key
        if callable(key):
            try:
                key = key(arguments)
            except Exception:  # a broken key function must not lose the call: serialise it
                return f"tool:{self.name}"
        if key is not None:
            return f"key:{key}"
        return None if self.parallel_safe else f"tool:{self.name}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _check_options(name: str, timeout: float | None, max_result_chars: int | None) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(
            f"tool name {name!r} is invalid; use 1-64 letters, digits, '_' or '-'."
        )
    if timeout is not None and not timeout > 0:
        raise ConfigurationError(f"tool {name!r}: timeout must be a positive number of seconds.")
    if max_result_chars is not None and max_result_chars < 1:
        raise ConfigurationError(f"tool {name!r}: max_result_chars must be at least 1.")


def _injection(annotation: Any) -> Injected | None:
    """What `annotation` asks the dispatcher for, by the type's `__treadle_inject__` marker."""
    what = injection_of(annotation)
    return typing.cast(Injected, what) if what is not None else None


async def _call_implementation(
    fn: Callable[..., Any], kwargs: dict[str, Any], is_async: bool
) -> Any:
    result = await fn(**kwargs) if is_async else await run_sync_tool(fn, **kwargs)
    # Plain results first: `isawaitable` is an ABC check, slow on the hot path.
    if not isinstance(result, _PLAIN_RESULTS) and inspect.isawaitable(result):
        result = await result
    return result


_PLAIN_RESULTS = (dict, str, list, int, float, bool, type(None), bytes, tuple)


def _is_async(fn: Callable[..., Any]) -> bool:
    call = type(fn).__call__ if not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def _inject(tool: Tool, arguments: Mapping[str, Any], context: ToolContext) -> dict[str, Any]:
    kwargs = dict(arguments)
    for param, what in tool.injected.items():
        if what == "context":
            kwargs[param] = context
        elif what == "session":
            kwargs[param] = context.require_session()
        else:
            kwargs[param] = context.sandbox
    return kwargs


def _format_errors(tool_name: str, error: pydantic.ValidationError) -> ToolArgumentsError:
    parts = []
    for item in error.errors(include_url=False, include_input=False):
        path = ".".join(str(p) for p in item["loc"]) or "(arguments)"
        parts.append(f"{path}: {item['msg']}")
    return ToolArgumentsError(
        f"invalid arguments for tool {tool_name!r}: " + "; ".join(parts),
        detail="fix these fields and call the tool again",
    )


class FunctionTool(Tool, Generic[P, R]):
    """A tool made from a function by `@tool`; calling the tool calls the function.

    `FunctionTool[P, R]` keeps the function's signature: a direct call `my_tool(1, 2)` is checked
    against it and typed as its return value.
    """

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = None,
        parallel_safe: bool = True,
        resource_key: ResourceKey = None,
        max_result_chars: int | None = None,
        needs_approval: bool = False,
        idempotent: bool = False,
        strict: bool | None = None,
        on_error: ErrorPolicy = "report",
        on_timeout: TimeoutPolicy = "report",
        is_enabled: IsEnabled = True,
    ) -> None:
        if not callable(fn):
            raise ConfigurationError(f"@tool needs a function, got {type(fn).__name__}.")
        tool_name: str = name or str(getattr(fn, "__name__", type(fn).__name__))
        _check_options(tool_name, timeout, max_result_chars)
        self.fn: Callable[P, R] = fn
        self.name = tool_name
        self.timeout = timeout
        self.parallel_safe = parallel_safe
        self.resource_key = resource_key
        self.max_result_chars = max_result_chars
        self.needs_approval = needs_approval
        self.idempotent = idempotent
        self._is_async = _is_async(fn)
        doc = parse_docstring(docstring_of(fn))
        self.description = description if description is not None else doc.summary
        built = build_arguments(fn, self.name, doc.params)
        self._model = built.model
        self._field_names = built.field_names
        self.injected = types.MappingProxyType(dict(built.injected))
        self.parameters = built.parameters
        self._set_policies(strict, on_error, on_timeout, is_enabled)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Validated keyword arguments (pydantic lax mode); `ToolArgumentsError` on mismatch."""
        try:
            # The validator itself (the model is `create_model`'s, nothing overrides
            # `model_validate`): the classmethod's keyword passing is about 3 µs a call.
            model = self._model.__pydantic_validator__.validate_python(arguments)
        except pydantic.ValidationError as e:
            raise _format_errors(self.name, e) from None
        values = {param: getattr(model, internal) for internal, param in self._field_names.items()}
        if model.model_extra:
            values.update(model.model_extra)
        return values

    async def invoke(self, arguments: Mapping[str, Any], *, context: ToolContext) -> Any:
        """Call the function (sync ones on the sync-tool threads) with injected values."""
        return await _call_implementation(
            self.fn, _inject(self, arguments, context), self._is_async
        )

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the wrapped function directly (no validation, no injection)."""
        return self.fn(*args, **kwargs)


@overload
def tool(fn: Callable[P, R], /) -> FunctionTool[P, R]: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    parallel_safe: bool = True,
    resource_key: ResourceKey = None,
    max_result_chars: int | None = None,
    needs_approval: bool = False,
    idempotent: bool = False,
    strict: bool | None = None,
    on_error: ErrorPolicy = "report",
    on_timeout: TimeoutPolicy = "report",
    is_enabled: IsEnabled = True,
) -> Callable[[Callable[P, R]], FunctionTool[P, R]]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    parallel_safe: bool = True,
    resource_key: ResourceKey = None,
    max_result_chars: int | None = None,
    needs_approval: bool = False,
    idempotent: bool = False,
    strict: bool | None = None,
    on_error: ErrorPolicy = "report",
    on_timeout: TimeoutPolicy = "report",
    is_enabled: IsEnabled = True,
) -> FunctionTool[..., Any] | Callable[[Callable[..., Any]], FunctionTool[..., Any]]:
    """Turn a sync or async function into a `Tool` (use bare, `@tool`, or with options).

    The docstring gives the description and the per-parameter descriptions; the type hints give
    the JSON schema and argument validation (a pydantic `Field(...)` as a default, or in
    `Annotated[T, Field(...)]`, adds a description and constraints; `Annotated[T, "text"]` a
    description). Parameters annotated `ToolContext`, `Session` or `Sandbox` receive the calling
    pass's context, session or sandbox and are not shown to the model. `strict`, `on_error`,
    `on_timeout` and `is_enabled` are described on `Tool`. The decorated tool keeps the
    function's signature: calling it directly calls the function.
    """

    def wrap(function: Callable[..., Any]) -> FunctionTool[..., Any]:
        return FunctionTool(
            function,
            name=name,
            description=description,
            timeout=timeout,
            parallel_safe=parallel_safe,
            resource_key=resource_key,
            max_result_chars=max_result_chars,
            needs_approval=needs_approval,
            idempotent=idempotent,
            strict=strict,
            on_error=on_error,
            on_timeout=on_timeout,
            is_enabled=is_enabled,
        )

    return wrap if fn is None else wrap(fn)


def _is_async_callable(fn: object) -> bool:
    """True for an `async def` function, or an object whose `__call__` is one."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004 - the method itself, not callable()
    )


def _takes_one(fn: Callable[..., Any]) -> bool:
    """True when `fn` can be called with one positional argument (or its signature is unknown)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True  # a builtin without a signature: let the call decide
    try:
        signature.bind(None)
    except TypeError:
        return False
    return True
