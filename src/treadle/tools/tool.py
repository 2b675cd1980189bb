"""`Tool`, the `@tool` decorator and `BaseTool`: what a model may call, its schema and validation.

A function tool gets its name from the function, its description and parameter descriptions from
the docstring, and its JSON schema and argument validation from the type hints (through a pydantic
model built once at decoration time). A parameter annotated `ToolContext` receives the calling
pass's context; `Session` and `Sandbox` are shorthands for its session and sandbox. Those
parameters are found by type (each such type declares `__treadle_inject__`), never by name, and
are left out of the schema. `BaseTool` is the hand-written form: class attributes `name`,
`description`, `parameters` (a JSON schema) and a sync or async `__call__`.

This module must never run a tool on the event loop thread when the tool is sync (sync tools go to
`treadle.tools.threads`), and never import the sandbox layer above it.
"""

from __future__ import annotations

import abc
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Generic, Literal, overload

import pydantic
import pydantic_core
from pydantic.json_schema import GenerateJsonSchema
from typing_extensions import ParamSpec, TypeVar

from treadle.errors import ConfigurationError, ToolArgumentsError
from treadle.tools.context import ToolContext, injection_of
from treadle.tools.docstrings import parse_docstring
from treadle.tools.threads import run_sync_tool

__all__ = ["BaseTool", "FunctionTool", "ResourceKey", "Tool", "tool"]

ResourceKey = str | Callable[[Mapping[str, Any]], str | None] | None
"""A fixed key, or a function of the validated arguments returning one (None: no ordering)."""

Injected = Literal["session", "sandbox", "context"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

P = ParamSpec("P", default=...)
R = TypeVar("R", default=Any)


class _ToolJsonSchema(GenerateJsonSchema):
    """Pydantic's schema generator without per-field titles (they cost tokens and add nothing)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


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

    _schema_json: bytes | None = None

    def schema(self) -> dict[str, Any]:
        """The OpenAI tool schema: `{"type": "function", "function": {...}}`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

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


def _type_hints(fn: Callable[..., Any], sig: inspect.Signature) -> dict[str, Any]:
    """Resolved annotations; a name that cannot be resolved is a clear configuration error."""
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:
        pass
    hints: dict[str, Any] = {}
    namespace = getattr(fn, "__globals__", {})
    for param in sig.parameters.values():
        annotation = param.annotation
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, dict(namespace))  # resolving a forward reference
            except Exception:
                raise ConfigurationError(
                    f"cannot resolve the type hint {annotation!r} of parameter "
                    f"{param.name!r}; import that type at module level (not only under "
                    "TYPE_CHECKING)."
                ) from None
        if annotation is not inspect.Parameter.empty:
            hints[param.name] = annotation
    return hints


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
        doc = parse_docstring(inspect.getdoc(fn))
        self.description = description if description is not None else doc.summary
        self._build_model(fn, doc.params)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def _build_model(self, fn: Callable[..., Any], param_docs: Mapping[str, str]) -> None:
        sig = inspect.signature(fn)
        hints = _type_hints(fn, sig)
        fields: dict[str, Any] = {}
        self._field_names: dict[str, str] = {}  # internal model field -> parameter name
        injected: dict[str, Injected] = {}
        extra: Literal["allow", "forbid"] = "forbid"
        for i, param in enumerate(sig.parameters.values()):
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                extra = "allow"
                continue
            if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
                raise ConfigurationError(
                    f"tool {self.name!r}: parameter {param.name!r} is positional-only or *args; "
                    "tools are called with keyword arguments only."
                )
            annotation = hints.get(param.name, Any)
            what = _injection(annotation)
            if what is not None:
                injected[param.name] = what
                continue
            default = ... if param.default is inspect.Parameter.empty else param.default
            # Internal names avoid clashes with BaseModel attributes (`json`, `copy`, `_x`).
            internal = f"p{i}"
            self._field_names[internal] = param.name
            fields[internal] = (
                annotation,
                pydantic.Field(default, alias=param.name, description=param_docs.get(param.name)),
            )
        self.injected = types.MappingProxyType(injected)
        try:
            self._model: type[pydantic.BaseModel] = pydantic.create_model(
                f"{self.name}_arguments",
                __config__=pydantic.ConfigDict(extra=extra, arbitrary_types_allowed=False),
                **fields,
            )
            schema = self._model.model_json_schema(schema_generator=_ToolJsonSchema)
        except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError, TypeError) as e:
            raise ConfigurationError(
                f"tool {self.name!r}: a parameter type has no JSON schema ({e}); use JSON-friendly "
                "types (str, int, float, bool, list, dict, Literal, Enum, pydantic models)."
            ) from None
        schema.pop("title", None)
        if extra == "forbid":
            schema["additionalProperties"] = False
        schema.setdefault("properties", {})
        self.parameters = schema

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Validated keyword arguments (pydantic lax mode); `ToolArgumentsError` on mismatch."""
        try:
            model = self._model.model_validate(arguments)
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


class BaseTool(Tool):
    """Subclass for a hand-written schema: set `name`, `description`, `parameters`, `__call__`.

    `parameters` is a JSON schema object. Arguments are checked lightly before the call (an
    object, required properties present, no unknown properties when `additionalProperties` is
    false, top-level JSON types); validate deeper inside `__call__` and raise
    `ToolArgumentsError` for anything else. `__call__` may be sync or async and may declare a
    parameter annotated `ToolContext`, `Session` or `Sandbox` to receive it.
    """

    # Declared as the plain attributes of `Tool` with class-level defaults (not ClassVar), so a
    # user's subclass body `name = "lookup"` type-checks under `mypy --strict`.
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def __init__(self) -> None:
        name = getattr(self, "name", None)
        if not isinstance(name, str):
            raise ConfigurationError(f"{type(self).__name__} must set the class attribute `name`.")
        _check_options(name, self.timeout, self.max_result_chars)
        if not isinstance(self.parameters, Mapping) or self.parameters.get("type") != "object":
            raise ConfigurationError(
                f"tool {name!r}: `parameters` must be a JSON schema with type 'object'."
            )
        call = self.__call__
        sig = inspect.signature(call)
        hints = _type_hints(call, sig)
        injected: dict[str, Injected] = {}
        for param in sig.parameters.values():
            what = _injection(hints.get(param.name, Any))
            if what is not None:
                injected[param.name] = what
        self.injected = types.MappingProxyType(injected)
        self._is_async = _is_async(call)

    @abc.abstractmethod
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The implementation; override it (sync or `async def`) with the tool's parameters as
        keyword arguments (`(*args: Any, **kwargs: Any)` lets any such signature override it)."""

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Check `arguments` against the top level of `parameters`."""
        problems = _check_object(self.parameters, arguments)
        if problems:
            raise ToolArgumentsError(
                f"invalid arguments for tool {self.name!r}: " + "; ".join(problems),
                detail="fix these fields and call the tool again",
            )
        return dict(arguments)

    async def invoke(self, arguments: Mapping[str, Any], *, context: ToolContext) -> Any:
        """Call `__call__` (sync ones on the sync-tool threads) with injected values."""
        return await _call_implementation(
            self.__call__, _inject(self, arguments, context), self._is_async
        )


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _check_object(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> list[str]:
    properties: Mapping[str, Any] = schema.get("properties") or {}
    problems = [
        f"{name}: Field required" for name in schema.get("required", ()) if name not in arguments
    ]
    for name, value in arguments.items():
        spec = properties.get(name)
        if spec is None:
            if schema.get("additionalProperties") is False:
                problems.append(f"{name}: Extra inputs are not permitted")
            continue
        wanted = spec.get("type") if isinstance(spec, Mapping) else None
        names = [wanted] if isinstance(wanted, str) else list(wanted or [])
        accepted = tuple(t for n in names for t in _JSON_TYPES.get(n, ()))
        wrong_bool = isinstance(value, bool) and "boolean" not in names
        if accepted and (not isinstance(value, accepted) or wrong_bool):
            problems.append(f"{name}: Input should be of type {' or '.join(names)}")
    return problems


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
) -> FunctionTool[..., Any] | Callable[[Callable[..., Any]], FunctionTool[..., Any]]:
    """Turn a sync or async function into a `Tool` (use bare, `@tool`, or with options).

    The docstring gives the description and the per-parameter descriptions; the type hints give
    the JSON schema and argument validation. Parameters annotated `ToolContext`, `Session` or
    `Sandbox` receive the calling pass's context, session or sandbox and are not shown to the
    model.
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
        )

    return wrap if fn is None else wrap(fn)
