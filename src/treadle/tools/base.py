"""`BaseTool`: a tool with a hand-written JSON schema and a sync or async `__call__`.

This module must never run a sync `__call__` on the event loop thread (it goes to the sync-tool
threads, as function tools do).
"""

from __future__ import annotations

import abc
import inspect
import types
from collections.abc import Mapping
from typing import Any

from treadle.errors import ConfigurationError, ToolArgumentsError
from treadle.tools.context import ToolContext
from treadle.tools.schema import type_hints
from treadle.tools.tool import (
    Injected,
    Tool,
    _call_implementation,
    _check_options,
    _inject,
    _injection,
    _is_async,
)

__all__ = ["BaseTool"]


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
    strict: bool | None = None

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
        hints = type_hints(call, sig)
        injected: dict[str, Injected] = {}
        for param in sig.parameters.values():
            what = _injection(hints.get(param.name, Any))
            if what is not None:
                injected[param.name] = what
        self.injected = types.MappingProxyType(injected)
        self._is_async = _is_async(call)
        self._set_policies(self.strict, self.on_error, self.on_timeout, self.is_enabled)

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
