"""`ToolSet`: the tools offered in one pass, a read-only name -> `Tool` mapping.

Built once per pass; schemas are encoded once and joined into every request body. The built-in
workspace tools are handed in by the caller (the loop), since they live in the sandbox layer
above this one. A *tool source* (an MCP server) may stand in the list for the tools it lists:
the set keeps it aside and `expanded()` lists its tools when the pass starts, on the pass's own
loop, so building the set never connects anywhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeGuard

from treadle.errors import ConfigurationError
from treadle.tools.tool import Tool, tool

__all__ = ["ToolSet", "ToolSource"]


class ToolSource(Protocol):
    """Something that stands for the tools it lists when a pass starts (`treadle.mcp.MCPServer`).

    Marked by the class attribute `__treadle_tool_source__ = True` (a marker, not a structural
    check: any object with a `list_tools` method is not taken for one by accident).
    """

    __treadle_tool_source__: ClassVar[bool]

    async def list_tools(self) -> Sequence[Tool]:
        """The tools on offer now."""
        ...


def _is_source(item: object) -> TypeGuard[ToolSource]:
    return getattr(type(item), "__treadle_tool_source__", False) is True


def _as_tool(item: Tool | type[Tool] | Callable[..., Any]) -> Tool:
    # A `Tool` subclass's instance is found by its type's MRO (a C-level tuple scan) before the
    # ABC's `isinstance` (a Python-level call): once per tool in every submitted pass.
    mro: tuple[type, ...] = type(item).__mro__  # type: ignore[assignment]  # a class's MRO
    if Tool in mro or isinstance(item, Tool):
        return item  # type: ignore[return-value]  # an instance of a Tool subclass
    if isinstance(item, type) and issubclass(item, Tool):
        return item()
    if callable(item):
        return tool(item)
    raise ConfigurationError(f"a tool must be a function or a Tool, got {type(item).__name__}.")


def _check_shadowing(builtins: Sequence[Tool], custom: Sequence[Tool]) -> None:
    names = {t.name for t in builtins}
    for item in custom:
        if item.name in names:
            raise ConfigurationError(
                f"tool {item.name!r} shadows a built-in sandbox tool; rename it with "
                "@tool(name=...)."
            )


class ToolSet(Mapping[str, Tool]):
    """The tools offered in one pass: a read-only name -> `Tool` mapping, schemas encoded once."""

    __slots__ = ("_schemas_json", "_tools", "sources")

    def __init__(self, tools: Iterable[Tool] = (), sources: Sequence[ToolSource] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for item in tools:
            if item.name in self._tools:
                raise ConfigurationError(
                    f"two tools are named {item.name!r}; give one a different name with "
                    "@tool(name=...)."
                )
            self._tools[item.name] = item
        self._schemas_json: bytes | None = None
        self.sources = tuple(sources) if sources else ()
        """Tool sources whose tools are not listed yet (see `expanded`)."""

    @classmethod
    def build(
        cls,
        custom_tools: Iterable[Tool | type[Tool] | Callable[..., Any] | ToolSource] | None,
        *,
        builtins: Iterable[Tool] = (),
    ) -> ToolSet:
        """The tool set of a pass: `builtins` (the sandbox's workspace tools, when the session
        has a placement) followed by `custom_tools` (functions are wrapped with `@tool`).

        Raises `ConfigurationError` when a custom tool shadows a built-in or two share a name.
        """
        sources: list[ToolSource] = []
        custom: list[Tool] = []
        for item in custom_tools or ():
            if _is_source(item):
                sources.append(item)
            else:
                custom.append(_as_tool(item))  # type: ignore[arg-type]  # not a source
        reserved = tuple(builtins)
        if not reserved:  # the usual pass (no sandbox): nothing to shadow, no copy
            return cls(custom, sources)
        _check_shadowing(reserved, custom)
        return cls([*reserved, *custom], sources)

    async def expanded(self) -> ToolSet:
        """This set with every source's tools listed in (itself when it has no sources).

        Sources are listed concurrently. Raises what a source raises when it cannot list (an
        MCP server that does not start), and `ConfigurationError` on a name clash.
        """
        if not self.sources:
            return self
        listed = await asyncio.gather(*(source.list_tools() for source in self.sources))
        tools = dict(self._tools)
        for source, offered in zip(self.sources, listed, strict=True):
            for item in map(_as_tool, offered):
                if item.name in tools:
                    raise ConfigurationError(
                        f"{source!r} offers a tool named {item.name!r}, and the pass already has "
                        "one; give the server a prefix (e.g. MCPServer.stdio(..., prefix='x_'))."
                    )
                tools[item.name] = item
        return ToolSet(tools.values())

    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI tool schemas, in the order they are offered."""
        return [t.schema() for t in self._tools.values()]

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
