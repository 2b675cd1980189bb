"""`ToolSet`: the tools offered in one pass, a read-only name -> `Tool` mapping.

Built once per pass; schemas are encoded once and joined into every request body. The built-in
workspace tools are handed in by the caller (the loop), since they live in the sandbox layer
above this one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from treadle.errors import ConfigurationError
from treadle.tools.tool import Tool, tool

__all__ = ["ToolSet"]


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
        builtins: Iterable[Tool] = (),
    ) -> ToolSet:
        """The tool set of a pass: `builtins` (the sandbox's workspace tools, when the session
        has a placement) followed by `custom_tools` (functions are wrapped with `@tool`).

        Raises `ConfigurationError` when a custom tool shadows a built-in or two share a name.
        """
        custom = [_as_tool(item) for item in custom_tools or ()]
        reserved = list(builtins)
        names = {t.name for t in reserved}
        for item in custom:
            if item.name in names:
                raise ConfigurationError(
                    f"tool {item.name!r} shadows a built-in sandbox tool; rename it with "
                    "@tool(name=...)."
                )
        return cls([*reserved, *custom])

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
