"""Run one round of model tool calls: the function the session loop calls, and the tool set.

`ToolSet.build` makes the name -> tool mapping once per pass; `run_tool_calls` parses, validates
and runs a round of OpenAI wire `tool_calls` and returns one `ToolOutcome` per call, in call
order. Calls run concurrently inside one task group that owns every task; calls sharing a resource
key run one at a time in call order. Problems with a call (unknown tool, bad arguments, an
exception, a timeout, a path outside the workspace) become an error body for the model.

This module must never raise for a tool's problem, never leave a task running after it returns
(cancellation cancels async tools and kills sandbox commands), and never block the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from treadle.errors import (
    ConfigurationError,
    ToolArgumentsError,
    ToolError,
    ToolTimeoutError,
    TreadleError,
)
from treadle.tools.results import error_content, exception_detail, success_content
from treadle.tools.tool import Tool, tool

if TYPE_CHECKING:
    from treadle.session.session import Session

__all__ = ["ToolOutcome", "ToolSet", "run_tool_calls"]


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """The result of one tool call, ready to become a `tool_result` row."""

    tool_call_id: str
    """The `id` of the call this answers."""
    name: str
    """The tool name the model called (as sent, even when unknown)."""
    content: str
    """JSON text the model sees next: `{"ok": true, ...}` or `{"ok": false, "error_kind", ...}`."""
    ok: bool
    """True when the tool ran and returned."""
    error_kind: str | None
    """`unknown_tool`, `invalid_tool_arguments`, `tool_execution_exception`, `timeout`,
    `path_violation` (or a custom `ToolError.error_kind`); None when `ok`."""


def _as_tool(item: Tool | type[Tool] | Callable[..., Any]) -> Tool:
    if isinstance(item, Tool):
        return item
    if isinstance(item, type) and issubclass(item, Tool):
        return item()
    if callable(item):
        return tool(item)
    raise ConfigurationError(f"a tool must be a function or a Tool, got {type(item).__name__}.")


class ToolSet(Mapping[str, Tool]):
    """The tools offered in one pass: a read-only name -> `Tool` mapping, schemas encoded once."""

    __slots__ = ("_schemas_json", "_tools")

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for item in tools:
            if item.name in self._tools:
                raise ConfigurationError(
                    f"two tools are named {item.name!r}; give one a different name with "
                    "@tool(name=...)."
                )
            self._tools[item.name] = item
        self._schemas_json: bytes | None = None

    @classmethod
    def build(
        cls,
        custom_tools: Iterable[Tool | type[Tool] | Callable[..., Any]] | None,
        *,
        builtins: bool,
    ) -> ToolSet:
        """The tool set of a pass: `custom_tools` (functions are wrapped with `@tool`), plus the
        built-in workspace tools when `builtins` (the session has a sandbox placement).

        Raises `ConfigurationError` when a custom tool shadows a built-in or two share a name.
        """
        custom = [_as_tool(item) for item in custom_tools or ()]
        tools: list[Tool] = []
        if builtins:
            # The sandbox layer sits above this one, so its tools are imported only when asked.
            from treadle.sandbox.builtin_tools import global_system_tools

            tools = list(global_system_tools())
            reserved = {t.name for t in tools}
            for item in custom:
                if item.name in reserved:
                    raise ConfigurationError(
                        f"tool {item.name!r} shadows a built-in sandbox tool; rename it with "
                        "@tool(name=...)."
                    )
        return cls([*tools, *custom])

    def schemas_json(self) -> bytes | None:
        """The JSON array of tool schemas, encoded once (None when the set is empty)."""
        if not self._tools:
            return None
        if self._schemas_json is None:
            self._schemas_json = b"[" + b",".join(t.schema_json() for t in self.values()) + b"]"
        return self._schemas_json

    @property
    def names(self) -> list[str]:
        """The tool names, in the order they are offered."""
        return list(self._tools)

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def __repr__(self) -> str:
        return f"<ToolSet {self.names}>"


def _failure(call_id: str, name: str, error: ToolError) -> ToolOutcome:
    return ToolOutcome(
        call_id,
        name,
        error_content(error.error_kind, error.message, error.detail),
        False,
        error.error_kind,
    )


def _parse_arguments(raw: Any) -> dict[str, Any]:
    """The arguments object of a call; empty or whitespace text means `{}`."""
    if isinstance(raw, Mapping):
        return dict(raw)
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if not isinstance(raw, (str, bytes)):
        raise ToolArgumentsError("the arguments must be a JSON object text.")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ToolArgumentsError(
            f"the arguments are not valid JSON ({e}); send a JSON object.",
        ) from None
    if not isinstance(value, dict):
        raise ToolArgumentsError(
            f"the arguments must be a JSON object, got {type(value).__name__}; "
            'send e.g. {"name": value}.'
        )
    return value


@dataclass(slots=True)
class _Ready:
    index: int
    call_id: str
    tool: Tool
    arguments: dict[str, Any]


async def _execute(ready: _Ready, session: Session | None) -> ToolOutcome:
    item = ready.tool
    try:
        if item.timeout is None:
            result = await item.invoke(ready.arguments, session=session)
        else:
            with anyio.move_on_after(item.timeout) as scope:
                result = await item.invoke(ready.arguments, session=session)
            if scope.cancelled_caught:
                sync_note = (
                    ""
                    if getattr(item, "_is_async", True)
                    else "; its thread cannot be stopped and may still be running"
                )
                raise ToolTimeoutError(
                    f"tool {item.name!r} ran past its {item.timeout:g} s timeout and was "
                    f"abandoned{sync_note}. Try a smaller task or different arguments."
                )
    except ToolError as error:
        return _failure(ready.call_id, item.name, error)
    except TreadleError as error:  # our own clear message (e.g. a missing file): no traceback
        message = f"tool {item.name!r} failed: {error}"
        return ToolOutcome(
            ready.call_id,
            item.name,
            error_content("tool_execution_exception", message),
            False,
            "tool_execution_exception",
        )
    except Exception as error:
        message = f"tool {item.name!r} raised {type(error).__name__}: {error}"
        detail = exception_detail(error)
        return ToolOutcome(
            ready.call_id,
            item.name,
            error_content("tool_execution_exception", message, detail),
            False,
            "tool_execution_exception",
        )
    content = success_content(result, max_chars=item.max_result_chars)
    return ToolOutcome(ready.call_id, item.name, content, True, None)


async def run_tool_calls(
    calls: Sequence[Mapping[str, Any]], tools: ToolSet, *, session: Session | None
) -> list[ToolOutcome]:
    """Run one round of OpenAI wire tool calls; one `ToolOutcome` per call, in call order.

    Each call is `{"id", "type": "function", "function": {"name", "arguments": "<json>"}}`.
    Calls run concurrently; calls sharing a resource key (or of a tool with
    `parallel_safe=False`) run one at a time in call order. Never raises for a tool's problem;
    cancelling the caller cancels every call (sandbox commands are killed).
    """
    outcomes: list[ToolOutcome | None] = [None] * len(calls)
    lanes: dict[str, list[_Ready]] = {}
    free: list[_Ready] = []
    for index, call in enumerate(calls):
        function = call.get("function") or {}
        call_id = str(call.get("id") or f"call_{index}")
        name = str(function.get("name") or "")
        found = tools.get(name)
        if found is None:
            known = ", ".join(tools.names) or "none"
            outcomes[index] = _failure(
                call_id,
                name,
                _UnknownTool(f"there is no tool named {name!r}; available tools: {known}."),
            )
            continue
        try:
            arguments = found.validate(_parse_arguments(function.get("arguments")))
        except ToolError as error:
            outcomes[index] = _failure(call_id, name, error)
            continue
        ready = _Ready(index, call_id, found, arguments)
        key = found.key_for(arguments)
        if key is None:
            free.append(ready)
        else:
            lanes.setdefault(key, []).append(ready)

    async def run_one(ready: _Ready) -> None:
        outcomes[ready.index] = await _execute(ready, session)

    async def run_lane(lane: list[_Ready]) -> None:
        for ready in lane:
            outcomes[ready.index] = await _execute(ready, session)

    if len(free) == 1 and not lanes:
        await run_one(free[0])  # the common single-call round needs no task group
    elif free or lanes:
        async with anyio.create_task_group() as group:
            for ready in free:
                group.start_soon(run_one, ready)
            for lane in lanes.values():
                group.start_soon(run_lane, lane)
    return [o for o in outcomes if o is not None]


class _UnknownTool(ToolError):
    error_kind = "unknown_tool"
