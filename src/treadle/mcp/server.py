"""`MCPServer`: an MCP server over stdio or streamable HTTP whose tools a pass can call.

One `MCPServer` object is one connection, shared by every pass on the runtime that calls its
tools; `server.connect()` opens an independent one (for a single pass, say) that closes when its
block ends. The connection starts on first use, lives on Treadle's runtime loop, restarts after a
crash, and closes at runtime shutdown (so at interpreter exit) with its server process.

This module must never block the runtime loop (the blocking `tools()` refuses to run there) and
never start a server process at construction.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, ClassVar

import mcp_types as types

from treadle.errors import ConfigurationError, RuntimeLoopError
from treadle.mcp.checks import CheckThreads
from treadle.mcp.link import Link, LinkLimits, Opener, Streams, close_soon
from treadle.mcp.stdio import DEFAULT_MAX_MESSAGE_BYTES, StdioTransport
from treadle.mcp.tool import MCPTool
from treadle.runtime import get_runtime

__all__ = [
    "DEFAULT_CALL_TIMEOUT",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_PING_TIMEOUT",
    "MCPServer",
    "tools_from",
]

#: Seconds one MCP tool call may take before it is cancelled and reported as `timeout`.
DEFAULT_CALL_TIMEOUT = 60.0
#: Seconds to start a server, initialise the session and list its tools.
DEFAULT_CONNECT_TIMEOUT = 30.0
#: Seconds a server has to answer a ping after a timed-out call before it is restarted.
DEFAULT_PING_TIMEOUT = 5.0
#: Calls in flight on one connection at once (more wait for a slot).
DEFAULT_MAX_CONCURRENCY = 16

#: Timeouts of the HTTP client of a streamable HTTP connection: a server may hold a reply stream
#: open for long, so reads get the call timeout's order of magnitude and more.
_HTTP_CONNECT_SECONDS = 30.0
_HTTP_READ_SECONDS = 300.0


def _stderr_target(stderr: IO[str] | int | None) -> Any:
    """Where a stdio server's stderr goes: as given (`subprocess.PIPE`: to our bounded reader,
    which logs it), else ours when it is a real file."""
    if stderr == subprocess.STDOUT:
        raise ConfigurationError(
            "MCPServer.stdio stderr cannot be subprocess.STDOUT: stdout carries the protocol; "
            "pass a file, subprocess.PIPE (logged) or subprocess.DEVNULL."
        )
    if stderr is not None:
        return stderr
    try:
        sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # a captured or replaced stderr
        return subprocess.DEVNULL
    return sys.stderr


def _check_cap(max_message_bytes: object) -> None:
    if (
        isinstance(max_message_bytes, bool)
        or not isinstance(max_message_bytes, int)
        or max_message_bytes < 1024
    ):
        raise ConfigurationError("MCPServer max_message_bytes must be an int >= 1024.")


class MCPServer:
    """An MCP server whose tools a pass can call; build one with `MCPServer.stdio(...)` or
    `MCPServer.http(...)`.

    Give its tools to a pass with `tools=[server]`: the pass lists them when it starts, on its
    own loop, so nothing connects or blocks at the call. `server.tools()` (or `await
    server.list_tools()`) lists them now: each is a `Tool` like any other, so they mix with `@tool`
    functions and go on `Agent`.
    """

    __treadle_tool_source__: ClassVar[bool] = True
    """Marks a tool source: `tools=[server]` stands for the server's tools (see `ToolSet`)."""

    def __init__(
        self,
        opener: Opener,
        *,
        label: str,
        prefix: str | None = None,
        timeout: float = DEFAULT_CALL_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        ping_timeout: float = DEFAULT_PING_TIMEOUT,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    ) -> None:
        """Low-level constructor (use `stdio` or `http`): `opener` opens the transport."""
        for what, value in (
            ("timeout", timeout),
            ("connect_timeout", connect_timeout),
            ("ping_timeout", ping_timeout),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigurationError(f"MCPServer {what} must be a positive number of seconds.")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int):
            raise ConfigurationError("MCPServer max_concurrency must be an int.")
        if max_concurrency < 1:
            raise ConfigurationError("MCPServer max_concurrency must be at least 1.")
        if prefix is not None and (not isinstance(prefix, str) or not prefix):
            raise ConfigurationError("MCPServer prefix must be a non-empty string or None.")
        self.label = label
        """The server as named in messages: its command line or URL."""
        self.prefix = prefix
        """Put before each tool name (`prefix_name`) to keep servers' tools apart."""
        self.limits = LinkLimits(
            call_timeout=float(timeout),
            connect_timeout=float(connect_timeout),
            ping_timeout=float(ping_timeout),
            max_concurrency=max_concurrency,
        )
        """The time and concurrency limits of this connection."""
        self.checks = CheckThreads(label)
        """The threads this server's schema checks run on, its own: another server's runaway
        checks never hold them (`treadle.mcp.checks`)."""
        self._opener = opener
        self._link: Link | None = None
        self._link_lock = threading.Lock()
        self._tools: tuple[tuple[types.Tool, ...], list[MCPTool]] | None = None

    @classmethod
    def stdio(
        cls,
        command: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stderr: IO[str] | int | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        **options: Any,
    ) -> MCPServer:
        """A server run as a subprocess speaking MCP on its stdin and stdout.

        Args:
            command: The program (`"python"`, `"uvx"`, `"mcp-server-git"`).
            args: Its arguments.
            env: Extra environment variables. The server gets only these plus a safe few of ours
                (`HOME`, `PATH`, `USER`, ...): API keys are not passed on.
            cwd: Its working directory.
            stderr: Where its stderr goes: a file, `subprocess.DEVNULL`, or `subprocess.PIPE`
                (read by Treadle, each line logged at DEBUG on the `treadle.mcp` logger);
                default: ours.
            max_message_bytes: Largest message the server may send; a bigger one fails the
                call it answers (a tool error) and the connection is started again.
            **options: `prefix`, `timeout`, `connect_timeout`, `ping_timeout`, `max_concurrency`.
        """
        if not isinstance(command, str) or not command.strip():
            raise ConfigurationError("MCPServer.stdio needs a command, e.g. 'mcp-server-time'.")
        if isinstance(args, str):
            raise ConfigurationError("MCPServer.stdio args must be a list of strings, not a str.")
        _check_cap(max_message_bytes)
        argv = [str(a) for a in args]
        target = _stderr_target(stderr)
        label = shlex.join([command, *argv])
        label = label if len(label) <= 80 else label[:77] + "..."
        fixed_env = dict(env) if env is not None else None
        folder = Path(cwd) if cwd is not None else None

        def opener() -> contextlib.AbstractAsyncContextManager[Streams]:
            return StdioTransport(
                command,
                argv,
                env=fixed_env,
                cwd=folder,
                stderr=target,
                max_message_bytes=max_message_bytes,
                label=label,
            )

        return cls(opener, label=label, **options)

    @classmethod
    def http(
        cls,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        **options: Any,
    ) -> MCPServer:
        """A server reached over streamable HTTP at `url` (for example `http://host:8000/mcp`).

        Args:
            url: The MCP endpoint.
            headers: Sent with every request (an `Authorization` header, say).
            max_message_bytes: Largest reply (or server-sent event) the server may send; a bigger
                one fails the call it answers (a tool error) and the connection is started again.
            **options: `prefix`, `timeout`, `connect_timeout`, `ping_timeout`, `max_concurrency`.
        """
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigurationError(f"MCPServer.http needs an http(s) URL, got {url!r}.")
        _check_cap(max_message_bytes)
        fixed_headers = dict(headers or {})

        @contextlib.asynccontextmanager
        async def opener() -> AsyncIterator[Streams]:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            from treadle.mcp.http import Trip, TrippedStream, capped_client
            from treadle.runtime.threads import run_internal_io

            timeout = httpx2.Timeout(_HTTP_CONNECT_SECONDS, read=_HTTP_READ_SECONDS)
            trip = Trip()  # a reply over the cap ends this connection (a fresh one next call)
            # Made on a worker thread: loading the CA certificates takes 50-80 ms of CPU.
            client = await run_internal_io(
                capped_client, fixed_headers, timeout, max_message_bytes, trip
            )
            async with (
                client,
                streamable_http_client(
                    url, http_client=client, max_sse_event_size=max_message_bytes
                ) as (read, write),
            ):
                yield TrippedStream(read, trip), write

        return cls(opener, label=url, **options)

    # -- the connection ------------------------------------------------------------------------

    def _current(self) -> Link:
        """This object's connection on the current runtime (a new one after a runtime restart)."""
        runtime = get_runtime()
        with self._link_lock:  # the caller's thread and the runtime's may both get here first
            link = self._link
            if link is None or link.closed or link.runtime is not runtime:
                link = self._link = Link(self._opener, self.label, self.limits, runtime)
                link.checks = self.checks  # its tools' argument checks share them
                # A server object nobody holds any more (nor any of its tools) closes its link.
                weakref.finalize(self, close_soon, link)
            return link

    async def call(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        """Call the server's tool `name` (its own name, without prefix) with `arguments`.

        Raises a `ToolError` subclass for every failure (`MCPServerError` when the server cannot
        be reached or hung up, `ToolTimeoutError` past `timeout`).
        """
        return await self._current().call(name, arguments)

    def tools(self) -> list[MCPTool]:
        """The server's tools, connecting first when needed (blocks the calling thread for that).

        Refreshed when the server announces a changed list: passes started later see the new
        list. Raises `ConfigurationError` when two tools would get the same name, and
        `MCPServerError` when the server cannot be started.
        """
        runtime = get_runtime()
        if runtime.in_loop_thread():
            raise RuntimeLoopError(
                "MCPServer.tools() blocks, and this is the Treadle runtime's loop thread; use "
                "`await server.list_tools()` here."
            )
        link = self._current()
        return self._wrap(runtime.run(link.tools()))

    async def list_tools(self) -> list[MCPTool]:
        """`tools()` for async code: the same list, without blocking the event loop."""
        return self._wrap(await self._current().tools())

    def _wrap(self, listing: tuple[types.Tool, ...]) -> list[MCPTool]:
        cached = self._tools
        if cached is not None and cached[0] is listing:
            return list(cached[1])
        validators = self._link.validators if self._link is not None else {}
        wrapped = [
            MCPTool(self, remote, prefix=self.prefix, validator=validators.get(id(remote)))
            for remote in listing
        ]
        seen: dict[str, str] = {}
        for item in wrapped:
            if item.name in seen:
                raise ConfigurationError(
                    f"MCP server {self.label} lists tools {seen[item.name]!r} and "
                    f"{item.remote_name!r}, which both become {item.name!r}; they cannot be "
                    "offered together."
                )
            seen[item.name] = item.remote_name
        self._tools = (listing, wrapped)
        return list(wrapped)

    @property
    def listings(self) -> int:
        """How many times the current runtime's connection fetched the tool list (the first
        listing and each refresh after the server announced a change)."""
        link = self._link
        return link.listings if link is not None else 0

    @property
    def restarts(self) -> int:
        """How many times the current runtime's connection was started again after the first."""
        link = self._link
        return max(0, link.starts - 1) if link is not None else 0

    # -- lifetime ------------------------------------------------------------------------------

    def connect(self) -> MCPServer:
        """An independent connection to the same server with the same options, for one pass or
        a group of them; use it as `async with server.connect() as conn:` (or `with`), and it
        closes, with its process, when the block ends."""
        return MCPServer(
            self._opener,
            label=self.label,
            prefix=self.prefix,
            timeout=self.limits.call_timeout,
            connect_timeout=self.limits.connect_timeout,
            ping_timeout=self.limits.ping_timeout,
            max_concurrency=self.limits.max_concurrency,
        )

    async def aclose(self) -> None:
        """Close the connection (a stdio server's process stops); a later call opens a new one."""
        link, self._link = self._link, None
        self.checks.drop_queued()  # checks queued for calls that will never be made
        if link is not None:
            await link.aclose()

    def close(self) -> None:
        """`aclose` for sync code (not on the runtime's loop thread)."""
        link, self._link = self._link, None
        self.checks.drop_queued()
        if link is None or link.runtime.closed:
            return
        if link.runtime.in_loop_thread():
            raise RuntimeLoopError(
                "MCPServer.close() blocks, and this is the Treadle runtime's loop thread; use "
                "`await server.aclose()` here."
            )
        link.runtime.run(link.aclose())

    async def __aenter__(self) -> MCPServer:
        await self._current().tools()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __enter__(self) -> MCPServer:
        self.tools()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<MCPServer {self.label}>"


def tools_from(*sources: MCPServer | Iterable[Any]) -> list[Any]:
    """The tools of several servers (and any other tools) in one list for `tools=`.

    Raises `ConfigurationError` naming both sources when two tools share a name, with the fix
    (a `prefix=` on one server).
    """
    return _combine([(s, s.tools() if isinstance(s, MCPServer) else list(s)) for s in sources])


async def atools_from(*sources: MCPServer | Iterable[Any]) -> list[Any]:
    """`tools_from` for async code: servers are listed without blocking the event loop."""
    listed = [(s, await s.list_tools() if isinstance(s, MCPServer) else list(s)) for s in sources]
    return _combine(listed)


def _combine(listed: list[tuple[MCPServer | Iterable[Any], list[Any]]]) -> list[Any]:
    combined: list[Any] = []
    owners: dict[str, str] = {}
    for source, items in listed:
        origin = f"MCP server {source.label}" if isinstance(source, MCPServer) else "your tools"
        for item in items:
            name = getattr(item, "name", None) or getattr(item, "__name__", None)
            if isinstance(name, str):
                if name in owners:
                    raise ConfigurationError(
                        f"two tools are named {name!r}: one from {owners[name]}, one from "
                        f"{origin}; give one of the servers a prefix, e.g. "
                        "MCPServer.stdio(..., prefix='git')."
                    )
                owners[name] = origin
            combined.append(item)
    return combined
