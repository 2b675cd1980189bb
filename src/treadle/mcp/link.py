"""One connection to an MCP server, entered and exited by one owner task on the runtime loop.

The SDK's `ClientSession` and its transports are anyio context managers, and the task that enters
them must be the one that exits them. A `Link` therefore starts one owner task per connection: it
holds the whole `async with` stack (transport, session, a task group for list refreshes and
health checks) and waits until the connection is retired. Calls from pass tasks on the runtime
loop use the entered session directly (JSON-RPC ids correlate concurrent requests, so many calls
share one connection); calls from another event loop are handed to the runtime loop.

When the server process dies, the transport's read stream ends; the owner sees it, exits the
stack (which stops the process) and the next call starts a fresh connection. A call that runs
past its timeout is cancelled (the SDK tells the server) and the server is pinged; one that does
not answer the ping is taken as hung, closed, and restarted on the next call.

This module must never block the event loop, never leave a server process running after its
`Link` closes, and never surface a server's failure as anything but a `ToolError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import mcp_types as types
from mcp import MCPError
from mcp.client.session import MessageHandlerFnT

from treadle.errors import MCPServerError, ToolArgumentsError, ToolError, ToolTimeoutError
from treadle.mcp.checks import CheckThreads
from treadle.mcp.listing import CheckedSession, compile_all, list_all, until_quiet
from treadle.mcp.stdio import StdioTransport, TransportFault
from treadle.runtime import Runtime
from treadle.runtime.threads import run_internal_io

__all__ = [
    "CLOSE_SECONDS",
    "Link",
    "LinkLimits",
    "Opener",
    "close_soon",
]

T = TypeVar("T")
log = logging.getLogger("treadle.mcp")

#: How long closing a connection may take before its owner task is cancelled (the SDK's own stdio
#: shutdown waits 2 s for the server to exit, then terminates and kills its process group).
CLOSE_SECONDS = 10.0

_CLIENT_INFO = types.Implementation(name="treadle", version="0.1.0")

Streams = tuple[Any, Any]
Opener = Callable[[], AbstractAsyncContextManager[Streams]]
"""Opens the transport: an async context manager yielding the (read, write) stream pair."""


@dataclass(frozen=True, slots=True)
class LinkLimits:
    """Time and concurrency limits of one server connection."""

    call_timeout: float
    """Seconds one tool call may take before it is cancelled and reported as `timeout`."""
    connect_timeout: float
    """Seconds to start the server, initialise the session and list its tools."""
    ping_timeout: float
    """Seconds the server has to answer a ping after a call timed out before it is restarted."""
    max_concurrency: int
    """Calls in flight on this connection at once; more wait for a free slot."""


class _WatchedStream:
    """The transport's read stream, setting its connection's `finished` when it ends (the server
    hung up or died) and keeping a transport's `TransportFault` as the reason."""

    def __init__(self, inner: Any, live: _Live) -> None:
        self._inner = inner
        self._live = live

    @property
    def last_context(self) -> Any:
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> Any:
        try:
            item = await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._live.finished.set()
            raise
        if isinstance(item, TransportFault):
            # Recorded before the session learns the stream ended, so the calls it then fails
            # can say why.
            self._live.fault = str(item)
            self._live.finished.set()
            raise anyio.EndOfStream
        return item

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> _WatchedStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def __aenter__(self) -> _WatchedStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _Live:
    """One connection's state: its session once initialised, and the event that retires it."""

    __slots__ = (
        "announced",
        "fault",
        "finished",
        "group",
        "refresh_again",
        "refreshing",
        "session",
    )

    def __init__(self) -> None:
        self.finished = asyncio.Event()
        self.session: CheckedSession | None = None
        self.group: anyio.abc.TaskGroup | None = None
        self.fault: str | None = None
        """Why the transport ended the connection, when it said."""
        self.refreshing = False
        """A re-listing runs (announcements meanwhile only ask for one more)."""
        self.refresh_again = False
        self.announced = 0.0
        """Loop time of the last `notifications/tools/list_changed`."""

    @property
    def usable(self) -> bool:
        return self.session is not None and not self.finished.is_set()


def describe(error: BaseException) -> str:
    """`Type: message` of an error, looking inside exception groups for the first real cause."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    text = str(error) or "no message"
    return f"{type(error).__name__}: {text}"


class Link:
    """One connection to one MCP server on one runtime: started on first use, restarted after a
    crash, closed by `aclose` or at runtime shutdown."""

    def __init__(self, opener: Opener, label: str, limits: LinkLimits, runtime: Runtime) -> None:
        self.runtime = runtime
        self.label = label
        self.limits = limits
        self._opener = opener
        self._live: _Live | None = None
        self._owner: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(limits.max_concurrency)
        self._closed = False
        self.listing: tuple[types.Tool, ...] = ()
        """The server's tools as last listed (refreshed on `notifications/tools/list_changed`)."""
        self.validators: dict[int, Any] = {}
        """The compiled input schema of each tool of `listing`, by the `id` of its `types.Tool`
        (so a reader holding an older listing never gets a newer tool's validator)."""
        self.listings = 0
        """How many times the tool list was fetched (first listings and refreshes)."""
        self.starts = 0
        """How many connections were opened so far (1 + restarts)."""
        self.checks = CheckThreads(label)
        """The threads this server's output checks run on (its own: `treadle.mcp.checks`)."""
        self.stop_phases: list[tuple[str, ...]] = []
        """How each closed stdio connection's process was stopped (see `StdioTransport`)."""
        _register(self)

    @property
    def closed(self) -> bool:
        """True once `aclose` ran (or the runtime shut down)."""
        return self._closed

    # -- entry points, callable from any event loop ----------------------------------------------

    async def call(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        """Call the server's tool `name`; a `ToolError` subclass for every failure."""
        return await self._on_runtime(self._call(name, arguments))

    async def tools(self) -> tuple[types.Tool, ...]:
        """The server's tool listing, connecting first when needed."""
        await self._on_runtime(self._ensure())
        if self._closed:  # closed while it was listed: that listing is not for a closed server
            raise MCPServerError(
                f"MCP server {self.label} was closed; open it again to call its tools."
            )
        return self.listing

    async def aclose(self) -> None:
        """Close the connection (stopping a stdio server's process); later calls fail."""
        if self.runtime.closed or self.runtime.loop.is_closed():
            self._closed = True
            return
        await self._on_runtime(self._close())

    async def _on_runtime(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self.runtime.loop
        if asyncio.get_running_loop() is loop:
            return await coro
        if self.runtime.closed:
            coro.close()
            raise MCPServerError(
                f"MCP server {self.label}: the Treadle runtime has shut down; "
                "make a new connection after starting new work."
            )
        # Cancelling the caller cancels the wrapped future, which cancels the runtime-side task.
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    # -- on the runtime loop ---------------------------------------------------------------------

    async def _ensure(self) -> _Live:
        live = self._live
        if live is not None and live.usable:
            return live
        async with self._lock:  # one starter; the others wait for its connection
            if self._closed:
                raise MCPServerError(
                    f"MCP server {self.label} was closed; open it again to call its tools."
                )
            live = self._live
            if live is not None and live.usable:
                return live
            await self._retire()
            return await self._start()

    async def _start(self) -> _Live:
        self.starts += 1
        live = _Live()
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._live = live
        self._owner = asyncio.get_running_loop().create_task(
            self._own(live, ready), name=f"treadle-mcp {self.label}"
        )
        try:
            await asyncio.shield(ready)
        except BaseException:
            await self._retire()
            raise
        return live

    async def _own(self, live: _Live, ready: asyncio.Future[None]) -> None:
        """The owner task: enter the transport and session, serve until retired, then exit."""
        transport = self._opener()
        # One deadline for the whole start: spawning and connecting count against it too.
        deadline = anyio.current_time() + self.limits.connect_timeout
        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(transport)
                session = await stack.enter_async_context(
                    CheckedSession(
                        _WatchedStream(read, live),
                        write,
                        message_handler=self._handler(live),
                        client_info=_CLIENT_INFO,
                    )
                )
                session.check_threads = self.checks
                async with anyio.create_task_group() as group:
                    live.group = group
                    try:
                        with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                            await session.initialize()
                            await self._list(session)
                    except BaseException:
                        if isinstance(transport, StdioTransport):
                            transport.abrupt = True  # it did not answer: no grace on closing
                        raise
                    live.session = session
                    if not ready.done():
                        ready.set_result(None)
                    await live.finished.wait()
                    group.cancel_scope.cancel()
        except Exception as error:
            refused = _refused(error)
            if not ready.done() and refused is not None:
                ready.set_exception(refused)
            elif not ready.done():
                said = ""
                if isinstance(transport, StdioTransport) and transport.stderr_tail:
                    said = " Its stderr ended with: " + " | ".join(transport.stderr_tail)
                ready.set_exception(
                    MCPServerError(
                        f"could not start MCP server {self.label} "
                        f"({live.fault or describe(error)}); "
                        f"check that it runs and speaks MCP, then call again.{said}"
                    )
                )
            else:
                log.warning("MCP server %s: connection ended (%s)", self.label, describe(error))
        finally:
            live.finished.set()
            if isinstance(transport, StdioTransport):
                self.stop_phases.append(tuple(transport.stop_phases))
            if not ready.done():
                ready.set_exception(
                    MCPServerError(f"MCP server {self.label} was closed while it started.")
                )

    def _handler(self, live: _Live) -> MessageHandlerFnT:
        async def handle(message: Any) -> None:
            if isinstance(message, types.ToolListChangedNotification) and live.group is not None:
                # Coalesced: a storm of announcements costs at most one re-listing running and
                # one pending. Not inline: the handler runs inside the session's receive loop,
                # and listing needs that loop to read the reply.
                live.announced = asyncio.get_running_loop().time()
                if live.refreshing:
                    live.refresh_again = True
                else:
                    live.refreshing = True
                    live.group.start_soon(self._refresh, live)
            elif isinstance(message, Exception):
                log.debug("MCP server %s: transport error %s", self.label, describe(message))

        return handle

    async def _list(self, session: CheckedSession) -> None:
        """List the tools and compile their schemas (on a worker thread: a schema is peer data
        whose size and shape we do not choose); `MCPSchemaError` naming a refused tool."""
        self.listings += 1
        listing = await list_all(session, self.label)
        # Stopped between compiles once the server is closed, so closing waits one compile at most.
        compiled = await run_internal_io(compile_all, listing, self.label, lambda: self._closed)
        self.validators = {id(tool): v for tool, (v, _) in zip(listing, compiled, strict=True)}
        session.output_validators = {
            tool.name: out
            for tool, (_, out) in zip(listing, compiled, strict=True)
            if out is not None
        }
        self.listing = listing

    async def _refresh(self, live: _Live) -> None:
        try:
            while live.session is not None and not live.finished.is_set():
                live.refresh_again = False
                try:
                    with anyio.fail_after(self.limits.call_timeout):
                        await self._list(live.session)
                except Exception as error:
                    log.warning(
                        "MCP server %s: re-listing tools failed, keeping the last list (%s)",
                        self.label,
                        describe(error),
                    )
                if not live.refresh_again:
                    return
                await until_quiet(lambda: live.announced, live.finished)
        finally:
            live.refreshing = False

    async def _call(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        async with self._slots:
            live = await self._ensure()
            session = live.session
            assert session is not None  # a usable connection has its session
            with anyio.move_on_after(self.limits.call_timeout) as scope:
                try:
                    return await session.call_tool(name, arguments)
                except MCPError as error:
                    if error.code == types.CONNECTION_CLOSED:
                        live.finished.set()
                        raise self._hung_up(name, live, error.message) from None
                    kind = ToolArgumentsError if error.code == types.INVALID_PARAMS else ToolError
                    raise kind(
                        f"MCP server {self.label} rejected the call to {name!r}: {error.message}"
                    ) from None
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    live.finished.set()
                    raise self._hung_up(name, live) from None
                except RuntimeError as error:  # the SDK's result checks (output schema)
                    raise ToolError(f"MCP tool {name!r} on {self.label}: {error}") from None
            assert scope.cancelled_caught
            if live.group is not None and live.usable:
                live.group.start_soon(self._check_alive, live)
            raise ToolTimeoutError(
                f"MCP tool {name!r} on {self.label} did not answer within "
                f"{self.limits.call_timeout:g} s and was cancelled. Try smaller arguments."
            )

    def _hung_up(self, name: str, live: _Live, detail: str = "") -> MCPServerError:
        if live.fault is not None:
            return MCPServerError(
                f"the call to {name!r} failed: {live.fault} The connection was closed and will "
                "be started again on the next call."
            )
        # The SDK's own reason when it has one (an HTTP stream that ended, an event too big).
        why = (
            detail.rstrip(".")
            if detail and detail != "Connection closed"
            else "it may have crashed"
        )
        return MCPServerError(
            f"MCP server {self.label} closed the connection during the call to {name!r} ({why}); "
            "it will be started again on the next call."
        )

    async def _check_alive(self, live: _Live) -> None:
        """After a timed-out call: a server that cannot answer a ping is hung; retire it."""
        session = live.session
        if session is None:
            return
        try:
            with anyio.fail_after(self.limits.ping_timeout):
                await session.send_ping()
            return
        except Exception:
            pass
        log.warning(
            "MCP server %s did not answer a ping after a call timed out; restarting it on the "
            "next call.",
            self.label,
        )
        live.finished.set()

    async def _retire(self) -> None:
        """Stop the current connection and wait for its owner to close it (bounded)."""
        live, owner = self._live, self._owner
        self._live = self._owner = None
        if live is not None:
            live.finished.set()
        if owner is not None and not owner.done():
            # Shielded: the process must be stopped even when our caller is cancelled meanwhile.
            await asyncio.shield(_wait_closed(owner))

    async def _close(self) -> None:
        self._closed = True
        async with self._lock:
            await self._retire()


async def _wait_closed(owner: asyncio.Task[None]) -> None:
    done, _ = await asyncio.wait({owner}, timeout=CLOSE_SECONDS)
    if not done:
        owner.cancel()
        await asyncio.wait({owner}, timeout=CLOSE_SECONDS)


def _refused(error: BaseException) -> MCPServerError | None:
    """Our own refusal of a listing (a tool's schema, too many tools) that ended a start."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error if isinstance(error, MCPServerError) else None


# -- closing every link when its runtime shuts down ----------------------------------------------

_open: weakref.WeakSet[Link] = weakref.WeakSet()
_hooked: weakref.WeakSet[Runtime] = weakref.WeakSet()


_closing: set[asyncio.Task[None]] = set()


def close_soon(link: Link) -> None:
    """Close `link` from any thread without waiting (a connection whose server object was
    garbage collected); the task is held here until it ends."""
    runtime = link.runtime
    if link.closed or runtime.closed or runtime.loop.is_closed():
        return

    def start() -> None:
        task = runtime.loop.create_task(link._close())
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    with contextlib.suppress(RuntimeError):  # a loop closed meanwhile: its shutdown hook closed it
        runtime.call_soon(start)


def _register(link: Link) -> None:
    _open.add(link)
    runtime = link.runtime
    if runtime not in _hooked:
        _hooked.add(runtime)

        async def close_links() -> None:
            links = [item for item in list(_open) if item.runtime is runtime]
            await asyncio.gather(*(item._close() for item in links), return_exceptions=True)

        runtime.add_shutdown_hook(close_links)
