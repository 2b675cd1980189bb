"""A connection's tool list: every page of it, each tool's schema compiled, refreshes spaced out.

A server's listing is peer data: its pages are capped (`MAX_LIST_PAGES`), its schemas compiled
on a worker thread by the caller (`compile_all` refuses a tool whose schema cannot be used, see
`treadle.mcp.schema`), and its `notifications/tools/list_changed` announcements are folded so a
storm of them costs a listing every few seconds at most (`until_quiet`). This module must never
block the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import mcp_types as types
from mcp import ClientSession

from treadle.mcp.tool import checked_validator, object_schema

__all__ = [
    "MAX_LIST_PAGES",
    "REFRESH_MAX_WAIT",
    "REFRESH_QUIET",
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


def compile_all(listing: tuple[types.Tool, ...], label: str) -> list[Any]:
    """Each tool's compiled input schema, in listing order; `MCPSchemaError` for a refused one.
    Blocking (pure Python over peer data): call it on a worker thread."""
    return [
        checked_validator(object_schema(tool.input_schema), tool.name, label) for tool in listing
    ]


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
