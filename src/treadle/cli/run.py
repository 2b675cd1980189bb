"""`treadle run`: one pass against the configured endpoint, shown live, then a summary.

Configuration comes from flags or the environment (`OPENAI_API_KEY`, `OPENAI_BASE_URL`,
`TREADLE_MODEL`). Missing configuration is reported before any request, with the variable to set.
This module must never print an API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treadle.cli.console import Console
from treadle.cli.describe import summary_line
from treadle.cli.failures import EXIT_CODES, CliFailure
from treadle.cli.live import LiveView
from treadle.cli.preflight import (
    check_endpoint,
    check_host_resolves,
    check_limits,
    check_mcp_urls,
    check_sandbox,
)
from treadle.cli.status import StatusLine
from treadle.llm.provider import Provider
from treadle.loop import Limits, PassStopped, stream_session_loop
from treadle.session import Session

__all__ = ["DEFAULT_SYSTEM_PROMPT", "RunOptions", "run_command", "session_json"]

#: The system prompt of `treadle run --sandbox ...` when `--system` is not given.
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Use the workspace tools for file and shell work."
)
# Without a workspace the model has no such tools: a prompt naming them invites made-up calls.
_PROMPT_WITH_MCP = "You are a helpful assistant. Use the tools you are given when they help."
_PROMPT_WITHOUT_TOOLS = "You are a helpful assistant."


def _default_prompt(opts: RunOptions) -> str:
    if opts.sandbox:
        return DEFAULT_SYSTEM_PROMPT
    return _PROMPT_WITH_MCP if opts.mcp or opts.mcp_urls else _PROMPT_WITHOUT_TOOLS


@dataclass(frozen=True, slots=True)
class RunOptions:
    """The flags of `treadle run`."""

    prompt: str
    system: str | None = None
    model: str | None = None
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    sandbox: str | None = None
    stream: bool = True
    persist: bool = False
    max_steps: int | None = None
    json: bool = False
    retries: int | None = None
    timeout: float | None = None
    extra_body: dict[str, Any] | None = None
    mcp: tuple[str, ...] = ()
    mcp_urls: tuple[str, ...] = ()
    mcp_prefixes: tuple[str | None, ...] = ()
    """Tool-name prefix of each MCP server, in the order of `(*mcp, *mcp_urls)` (None: none)."""
    mcp_timeout: float | None = None
    """Seconds an MCP server may take to start and list its tools (None: `timeout`, else the
    MCP default)."""


def provider_for(opts: RunOptions) -> Provider:
    """The provider the flags and environment describe; `CliFailure` naming what is missing
    (checked in `treadle.cli.preflight`'s order: the URL's scheme first, then model, then key)."""
    endpoint = check_endpoint(model=opts.model, base_url=opts.base_url, api_key=opts.api_key)
    options: dict[str, Any] = {
        "model": endpoint.model,
        "base_url": endpoint.base_url,
        "stream": opts.stream,
    }
    if opts.api_key:
        options["api_key"] = opts.api_key
    if opts.retries is not None:
        options["max_retries"] = opts.retries
    if opts.timeout is not None:
        options["timeout"] = opts.timeout
    if opts.extra_body:
        options["extra_body"] = opts.extra_body
    return Provider(**options)


def session_json(session: Session, *, seconds: float | None = None) -> dict[str, Any]:
    """The output session as plain JSON data (what `--json` prints)."""
    data: dict[str, Any] = {
        "id": session.id,
        "stop_reason": session.stop_reason,
        "final_text": session.final_text,
        "usage": session.usage.to_dict(),
        "messages": session.to_messages(),
        "transcript": session.metadata.get("path"),
    }
    if seconds is not None:
        data["seconds"] = round(seconds, 3)
    return data


async def run_pass(
    user: Session,
    agent: Session,
    provider: Provider,
    view: LiveView | None,
    **options: Any,
) -> Session:
    """Run one pass with `view` showing its events; returns the output session."""
    out: Session | None = None
    status = view.status if view is not None else None
    ticking = status.ticking() if status is not None else contextlib.nullcontext()
    async with ticking:
        if view is not None:
            view.start()
        try:
            stream = stream_session_loop(user, agent, agent_provider=provider, **options)
            async for event in stream:
                if view is not None:
                    view(event)
                if isinstance(event, PassStopped):
                    out = event.session
        finally:
            if view is not None:
                view.finish()
    if out is None:  # pragma: no cover - stream_session_loop always ends with PassStopped
        raise CliFailure(
            "The pass ended without a result.",
            "rerun the same command with TREADLE_DEBUG=1 in front to see why.",
            EXIT_CODES["error"],
        )
    return out


def run_command(opts: RunOptions, console: Console, *, status: StatusLine | None = None) -> int:
    """Run `treadle run`; returns the exit code. `status` is the line already showing that
    treadle is starting (the pass's phases continue on it)."""
    try:
        provider = provider_for(opts)
        check_limits(
            timeout=opts.timeout,
            retries=opts.retries,
            max_steps=opts.max_steps,
            mcp_timeout=opts.mcp_timeout,
        )
        check_mcp_urls(opts.mcp_urls)
        check_sandbox(opts.sandbox)
        check_host_resolves(str(provider.base_url))
        if opts.sandbox and opts.sandbox not in ("local", "isolated"):
            # a command-line user expects `--sandbox ./work` to be created (its parent exists:
            # check_sandbox refused a missing one)
            Path(opts.sandbox).mkdir(exist_ok=True)
    except BaseException:
        if status is not None:
            status.set(None)  # the error is printed on a clean line
        raise
    return asyncio.run(_run(opts, provider, console, status))


async def _run(
    opts: RunOptions, provider: Provider, console: Console, status: StatusLine | None = None
) -> int:
    user = Session.from_user_message(opts.prompt)
    if opts.sandbox:
        user = user.to(opts.sandbox)
    agent = Session.from_agent_prompt(opts.system or _default_prompt(opts))
    limits = Limits(max_steps=opts.max_steps) if opts.max_steps is not None else None
    view = (
        None
        if opts.json
        else LiveView(
            console,
            status=StatusLine(console.out),
            model=provider.model or "the model",
            base_url=provider.base_url,
        )
    )
    servers: list[Any] = []
    tools: list[Any] | None = None
    if opts.mcp or opts.mcp_urls:
        from treadle.cli.mcp_tools import open_servers

        servers, tools = await open_servers(
            opts.mcp,
            opts.mcp_urls,
            opts.mcp_prefixes,
            connect_timeout=opts.mcp_timeout or opts.timeout,
        )
    started = time.perf_counter()
    out: Session | None = None
    try:
        out = await run_pass(
            user, agent, provider, view, persist=opts.persist, limits=limits, tools=tools
        )
    finally:
        if out is not None:
            out.close_sandbox()
        user.close_sandbox()
        if servers:
            from treadle.cli.mcp_tools import close_servers

            await close_servers(servers)
    seconds = time.perf_counter() - started
    if opts.json:
        console.line(json.dumps(session_json(out, seconds=seconds), ensure_ascii=False, indent=2))
        return EXIT_CODES["ok"]
    tool_calls = view.tool_calls if view is not None else 0
    console.line(
        summary_line(
            rows=len(out.rows),
            tool_calls=tool_calls,
            usage=out.usage,
            seconds=seconds,
            stop_reason=out.stop_reason,
            path=out.metadata.get("path"),
        ),
        "summary",
    )
    return EXIT_CODES["ok"]
