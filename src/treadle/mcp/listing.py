"""A connection's tool list: every page of it, each tool's schema compiled, refreshes spaced out.

A server's listing is peer data: its pages are capped (`MAX_LIST_PAGES`), its schemas compiled
on a worker thread by the caller (`compile_all` refuses a tool whose schema cannot be used, see
`treadle.mcp.schema`; `CheckedSession` checks results against the compiled output schemas), and
its `notifications/tools/list_changed` announcements are folded so a
storm of them costs a listing every few seconds at most (`until_quiet`). This module must never
block the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import mcp_types as types
from mcp import ClientSession

from treadle.mcp.tool import checked_validator, object_schema

__all__ = [
    "MAX_LIST_PAGES",
    "REFRESH_MAX_WAIT",
    "REFRESH_QUIET",
    "CheckedSession",
    "compile_all",
    "list_all",
    "until_quiet",
]

#: Pages of `tools/list` read before a server that keeps returning cursors is cut off.
MAX_LIST_PAGES = 100
#: After a re-listing, further announcements fold into one more, made once the server has been
#: quiet for `REFRESH_QUIET` seconds (or `REFRESH_MAX_WAIT` seconds have passed): a storm of
#: `notifications/tools/list_changed` costs a listing every few seconds at most.
REFRESH_QUIET = 0.25
REFRESH_MAX_WAIT = 5.0


async def list_all(session: ClientSession) -> tuple[types.Tool, ...]:
    """Every page of the server's tool list (up to `MAX_LIST_PAGES`)."""
    tools: list[types.Tool] = []
    cursor: str | None = None
    for _ in range(MAX_LIST_PAGES):
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            break
    return tuple(tools)


def compile_all(listing: tuple[types.Tool, ...], label: str) -> list[tuple[Any, Any]]:
    """Each tool's compiled input and output schemas (None: no output schema), in listing order;
    `MCPSchemaError` for a refused one. Blocking (pure Python over peer data): call it on a
    worker thread."""
    return [
        (
            checked_validator(object_schema(tool.input_schema), tool.name, label),
            None
            if tool.output_schema is None
            else checked_validator(dict(tool.output_schema), tool.name, label, "output"),
        )
        for tool in listing
    ]


class CheckedSession(ClientSession):
    """The SDK's client session with its check of structured results replaced: a result is
    checked against the output schema compiled when the tool was listed (regexes on RE2, `$ref`
    loops refused), not recompiled with Python's `re` on the shared loop."""

    output_validators: Mapping[str, Any] = {}
    """The compiled output schema of each listed tool that has one, by its name."""

    async def validate_tool_result(self, name: str, result: types.CallToolResult) -> None:
        """Raise `RuntimeError` (a tool error to the caller) when a result does not match its
        tool's output schema."""
        from jsonschema import exceptions  # type: ignore[import-untyped]

        validator = self.output_validators.get(name)
        if validator is None:
            return
        if result.structured_content is None:
            raise RuntimeError(f"tool {name} has an output schema but sent no structured content")
        try:
            error = exceptions.best_match(validator.iter_errors(result.structured_content))
        except RecursionError:
            raise RuntimeError(f"the structured result of {name} is nested too deeply") from None
        if error is not None:
            raise RuntimeError(f"the structured result of {name} does not match: {error.message}")


async def until_quiet(announced: Callable[[], float], finished: asyncio.Event) -> None:
    """Wait until the last announcement (`announced()`, loop time) is `REFRESH_QUIET` seconds
    old, at most `REFRESH_MAX_WAIT` seconds, or until the connection is `finished`."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + REFRESH_MAX_WAIT
    while (now := loop.time()) < give_up and not finished.is_set():
        calm = now - announced()
        if calm >= REFRESH_QUIET:
            return
        await asyncio.sleep(min(REFRESH_QUIET - calm, give_up - now))
