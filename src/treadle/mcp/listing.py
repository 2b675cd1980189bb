"""A connection's tool list: every page of it, each tool's schema compiled, refreshes spaced out.

A server's listing is peer data: its pages are capped (`MAX_LIST_PAGES`), its schemas compiled
on a worker thread by the caller (`compile_all` refuses a tool whose schema cannot be used, see
`treadle.mcp.schema`; `CheckedSession` checks results against the compiled output schemas), and
its `notifications/tools/list_changed` announcements are folded so a
storm of them costs a listing every few seconds at most (`until_quiet`). A bulky result (more
than `OFF_LOOP_ITEMS` content blocks or tools) is typed on a worker thread: the SDK's own typing
of 130,000 content blocks takes seconds of pure Python. This module must never block the event
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable, Mapping
from typing import Any

import mcp_types as types
from mcp import ClientSession
from mcp_types import methods as result_rows
from pydantic import TypeAdapter

from treadle.errors import MCPServerError
from treadle.mcp.checks import CheckThreads
from treadle.mcp.regex import ListingStopped
from treadle.mcp.schema import BudgetExceeded, Patterns, run_check
from treadle.mcp.tool import (
    CHEAP_SCHEMA_COST,
    CHECK_BUDGET_SECONDS,
    checked_validator,
    object_schema,
    small_value,
)
from treadle.runtime.threads import run_internal_io

__all__ = [
    "MAX_LISTED_TOOLS",
    "MAX_LIST_PAGES",
    "OFF_LOOP_ITEMS",
    "REFRESH_MAX_WAIT",
    "REFRESH_QUIET",
    "CheckedSession",
    "compile_all",
    "list_all",
    "until_quiet",
]

#: Pages of `tools/list` read before a server that keeps returning cursors is cut off.
MAX_LIST_PAGES = 100
#: Tools one server may list. Each compiled schema is a few dozen objects that every full
#: collection of the garbage collector walks while it holds the GIL: 19,000 tools (what fits in
#: 1 MiB) took 34 s to compile and made each full collection take over a second, stalling the
#: runtime loop with it; 1,000 compile in 2 s and stall it 20 to 50 ms. A model is offered far
#: fewer tools at once (OpenAI's limit is 128).
MAX_LISTED_TOOLS = 1000
#: After a re-listing, further announcements fold into one more, made once the server has been
#: quiet for `REFRESH_QUIET` seconds (or `REFRESH_MAX_WAIT` seconds have passed): a storm of
#: `notifications/tools/list_changed` costs a listing every few seconds at most.
REFRESH_QUIET = 0.25
REFRESH_MAX_WAIT = 5.0
#: A result with more content blocks (or tools) than this is typed on a worker thread.
OFF_LOOP_ITEMS = 500

# What each bulky result's placeholder is (an empty result the SDK types in no time on the loop,
# then swapped for the real one typed on a worker): by method, the list key emptied.
_BULKY = {"tools/call": "content", "tools/list": "tools"}
# The type of one item of each bulky list, and how many are typed in one pydantic call.
_ITEM_TYPES: dict[str, TypeAdapter[Any]] = {
    "tools/call": TypeAdapter(list[types.ContentBlock]),
    "tools/list": TypeAdapter(list[types.Tool]),
}
_TYPED_PER_STEP = 2000
# A result's fields of free-form JSON: such a result is always typed on a worker thread, and the
# fields are kept as plain data rather than checked in one long call.
_FREE_FORM = ("_meta", "structuredContent")
# The request being sent by this task: its result type, and the typed result once a bulky one
# was typed off the loop.
_typing: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("treadle_mcp_typing")


def _typed(session: Any, method: str, raw: dict[str, Any], result_type: Any) -> Any:
    """`raw` checked and typed as the SDK does it (blocking: on a worker thread), its long list
    `_TYPED_PER_STEP` items at a time: each pydantic call holds the GIL throughout, so one call
    over 130,000 blocks would keep the runtime loop from running for a second or more even from
    another thread; between steps the loop gets its turn. Free-form extra data (`_meta`,
    `structuredContent`) is kept as the plain JSON it was parsed into: the SDK's check walks it
    as JSON values in one call (a 4 MiB `_meta` holds the GIL for most of 100 ms), so the check
    sees an empty value of the same kind instead and the real one is put back untouched."""
    version = getattr(session, "_negotiated_version", None) or "2025-11-25"
    key = _BULKY[method]
    items = raw.get(key)
    items = items if isinstance(items, list) else []
    free = {k: raw[k] for k in _FREE_FORM if k in raw}
    rest = {k: v for k, v in raw.items() if k != key}
    # Checked as an empty value of the same kind: a dict must stay a dict, and so on.
    rest.update({k: type(v)() if isinstance(v, dict | list) else v for k, v in free.items()})
    typed: list[Any] = []
    adapter = _ITEM_TYPES[method]
    for start in range(0, max(len(items), 1), _TYPED_PER_STEP):
        step = items[start : start + _TYPED_PER_STEP]
        # KeyError: a method or version without a row, which the SDK skips too
        with contextlib.suppress(KeyError):
            result_rows.validate_server_result(method, version, {**rest, key: step})
        typed.extend(adapter.validate_python(step, by_name=False))
        time.sleep(0)  # let the loop thread take the GIL
    # Typed items pass through unchecked again; free-form fields are `Any` or `dict[str, Any]`
    # in the result type, taken as they are without a walk.
    whole = {**rest, **free, key: typed}
    if isinstance(result_type, TypeAdapter):
        return result_type.validate_python(whole, by_name=False)
    return result_type.model_validate(whole, by_name=False)


class _Tap:
    """The session's dispatcher, handing a bulky result's typing to a worker thread."""

    def __init__(self, inner: Any, session: Any) -> None:
        self._inner = inner
        self._session = session

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def send_raw_request(self, method: str, params: Any, opts: Any = None) -> Any:
        raw = await self._inner.send_raw_request(method, params, opts)
        key = _BULKY.get(method)
        pending = _typing.get(None)
        if key is None or pending is None or not isinstance(raw, dict):
            return raw
        items = raw.get(key)
        bulky = isinstance(items, list) and len(items) > OFF_LOOP_ITEMS
        if not bulky and not any(field in raw for field in _FREE_FORM):
            return raw
        pending.append(await run_internal_io(_typed, self._session, method, raw, pending[0]))
        return {key: []}


async def list_all(session: ClientSession, label: str) -> tuple[types.Tool, ...]:
    """Every page of the server's tool list (up to `MAX_LIST_PAGES`); `MCPServerError` naming
    server `label` when it lists more than `MAX_LISTED_TOOLS` tools."""
    tools: list[types.Tool] = []
    cursor: str | None = None
    for _ in range(MAX_LIST_PAGES):
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools.extend(page.tools)
        if len(tools) > MAX_LISTED_TOOLS:
            raise MCPServerError(
                f"MCP server {label} lists more than {MAX_LISTED_TOOLS:,} tools "
                f"({len(tools):,} so far), more than Treadle offers from one server; serve "
                "fewer tools from it or split it into several servers."
            )
        cursor = page.next_cursor
        if not cursor:
            break
    return tuple(tools)


def compile_all(
    listing: tuple[types.Tool, ...], label: str, closed: Callable[[], bool] = lambda: False
) -> list[tuple[Any, Any]]:
    """Each tool's compiled input and output schemas (None: no output schema), in listing order;
    `MCPSchemaError` for a refused one, `MCPServerError` once `closed()` says the server was
    closed meanwhile (no compile starts after that). Blocking (pure Python over peer data):
    call it on a worker thread."""
    patterns = Patterns(closed)  # a pattern several tools share is compiled once
    compiled = []
    try:
        for tool in listing:
            if closed():
                raise ListingStopped
            compiled.append(
                (
                    checked_validator(
                        object_schema(tool.input_schema), tool.name, label, "input", patterns
                    ),
                    None
                    if tool.output_schema is None
                    else checked_validator(
                        dict(tool.output_schema), tool.name, label, "output", patterns
                    ),
                )
            )
    except ListingStopped:
        raise MCPServerError(
            f"MCP server {label} was closed while its tools were listed."
        ) from None
    return compiled


class CheckedSession(ClientSession):
    """The SDK's client session with its check of structured results replaced: a result is
    checked against the output schema compiled when the tool was listed (regexes on RE2, `$ref`
    loops refused), not recompiled with Python's `re` on the shared loop."""

    output_validators: Mapping[str, Any] = {}
    """The compiled output schema of each listed tool that has one, by its name."""
    check_threads: CheckThreads | None = None
    """The server's own check threads, which its output checks run on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dispatcher = _Tap(self._dispatcher, self)

    async def send_request(self, request: Any, result_type: Any, *args: Any, **kwargs: Any) -> Any:
        """The SDK's `send_request`, with a bulky result typed on a worker thread."""
        pending: list[Any] = [result_type]
        token = _typing.set(pending)
        try:
            result = await super().send_request(request, result_type, *args, **kwargs)
        finally:
            _typing.reset(token)
        return pending[1] if len(pending) > 1 else result

    async def validate_tool_result(self, name: str, result: types.CallToolResult) -> None:
        """Raise `RuntimeError` (a tool error to the caller) when a result does not match its
        tool's output schema, or its check takes over `CHECK_BUDGET_SECONDS` (a large result,
        or one against a costly schema, is checked on a worker thread)."""
        validator = self.output_validators.get(name)
        if validator is None:
            return
        structured = result.structured_content
        if structured is None:
            raise RuntimeError(f"tool {name} has an output schema but sent no structured content")
        if validator.cost <= CHEAP_SCHEMA_COST and not validator.heavy and small_value(structured):
            error = _output_error(validator, structured, name)
        else:
            try:
                error = await run_check(
                    _output_error,
                    validator,
                    structured,
                    name,
                    budget=CHECK_BUDGET_SECONDS,
                    threads=self.check_threads,
                )
            except BudgetExceeded:  # still running (one RE2 call cannot be stopped)
                raise RuntimeError(_overrun(name)) from None
        if error is not None:
            raise RuntimeError(f"the structured result of {name} does not match: {error.message}")


def _output_error(validator: Any, structured: Any, name: str) -> Any:
    """The most relevant error of `structured` against `validator` (None: it matches)."""
    try:
        return validator.best_error(structured, CHECK_BUDGET_SECONDS)
    except RecursionError:
        raise RuntimeError(f"the structured result of {name} is nested too deeply") from None
    except BudgetExceeded:
        raise RuntimeError(_overrun(name)) from None


def _overrun(name: str) -> str:
    return (
        f"checking the structured result of {name} against its output schema took over "
        f"{CHECK_BUDGET_SECONDS:g} s and was stopped"
    )


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
