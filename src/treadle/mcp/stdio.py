"""The stdio transport of an MCP server: a subprocess speaking newline-delimited JSON-RPC.

Treadle's own, in place of the SDK's `stdio_client`, whose reader joins its whole buffer to each
new chunk (quadratic in the size of a message) and keeps any size in memory. Here the server's
stdout is read in chunks, each scanned once for a newline, and a message is kept only up to
`max_message_bytes`: past the cap the rest of the line is read and dropped, and the connection
ends with a `MessageTooLarge` fault (the link reports it to the call and restarts the server on
the next one). The server's stderr goes where the caller says, or, with `subprocess.PIPE`, to a
bounded reader that logs each line and keeps the last few for error messages; no pipe of the
server is ever left unread. On Linux the server runs under a small supervisor
(`treadle.mcp.reaper`: the init of a PID namespace of its own, or a child subreaper where
namespaces are not allowed), so closing also stops descendants that left the server's process
group with `setsid()`. A message over `PARSE_OFF_LOOP_BYTES` is parsed on a
worker thread, and only when it holds at most `MAX_MESSAGE_CONTAINERS` arrays and objects and
`MAX_MESSAGE_EXPONENTS` numbers with a large exponent, and whose estimated cost, all its shapes
together, is at most `MAX_MESSAGE_COST_NS` (`treadle.mcp.parse`: `json.loads` holds the
GIL for the whole message, and its cost is the objects it makes); one with more is a
`MessageTooComplex` fault, as one over the cap is. A large notification or server request is
slimmed there too (`treadle.mcp.parse.slim`), so the SDK types only a small one on the loop.

This module must never hold more than the cap of one message, never block the event loop, and
never leave its server process running once its context has exited (closing is shielded from
cancellation and every wait in it is bounded).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.abc
import anyio.lowlevel
import mcp_types as types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.client.stdio import get_default_environment
from mcp.shared.message import SessionMessage

from treadle.mcp.parse import (
    MAX_MESSAGE_CONTAINERS,
    MAX_MESSAGE_COST_NS,
    MAX_MESSAGE_EXPONENTS,
    collector_paused,
    containers,
    cost,
    exponents,
    slim,
)
from treadle.runtime.threads import run_internal_io

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "PARSE_OFF_LOOP_BYTES",
    "MalformedMessage",
    "MessageTooComplex",
    "MessageTooLarge",
    "StdioTransport",
    "TransportFault",
]

log = logging.getLogger("treadle.mcp")

#: Bytes one message from a server may have before the connection is ended as faulty. A tool
#: result reaches the model capped at 100,000 characters, so anything near this size is a
#: server's mistake. The cap also bounds the one step that holds the GIL for a whole message,
#: `json.loads` on a worker thread: about 25 ms of CPU per MiB of small objects (docs/mcp.md).
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
#: A message longer than this is parsed on a worker thread (a shorter one parses in about a
#: millisecond, less than the hand-over costs).
PARSE_OFF_LOOP_BYTES = 64 * 1024
#: Bytes read from a pipe at once.
_CHUNK = 64 * 1024
#: Characters kept of one stderr line, and lines kept for error messages.
_STDERR_LINE_CAP = 2000
_STDERR_TAIL_LINES = 10
#: Stderr lines logged before the reader lets the loop run other tasks.
_STDERR_LINES_PER_STEP = 32
#: Seconds a stopped server's stderr is still read for its last lines.
_STDERR_DRAIN_SECONDS = 0.5
#: Seconds a server has to exit after its stdin closes, then after SIGTERM, then after SIGKILL.
_EXIT_SECONDS = 2.0
_POLL_SECONDS = 0.01


class TransportFault(Exception):
    """A transport's reason for ending a connection, put on its read stream as its last item."""


class MessageTooLarge(TransportFault):
    """The server sent a message over the size cap."""


class MessageTooComplex(MessageTooLarge):
    """The server sent a message of more JSON arrays and objects than `MAX_MESSAGE_CONTAINERS`,
    or over another parse budget of `treadle.mcp.parse` (refused unparsed: parsing it would
    hold the GIL too long)."""


class MalformedMessage(TransportFault):
    """The server sent a line that is not a JSON-RPC message (not JSON, nested too deeply, or not
    shaped as a request, notification or response): the connection ends at once, since the
    reply a call waits for may have been that line."""


class StdioTransport:
    """An MCP server run as a subprocess; `async with` it to get the (read, write) stream pair.

    Enter and exit it from the same task (the link's owner task does).
    """

    def __init__(
        self,
        command: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None,
        cwd: str | os.PathLike[str] | None,
        stderr: IO[str] | int | None,
        max_message_bytes: int,
        label: str,
    ) -> None:
        self._argv = _supervised([command, *args])
        self._env = get_default_environment() | dict(env or {})
        self._cwd = Path(cwd) if cwd is not None else None
        self._stderr = stderr
        self._cap = max_message_bytes
        self._label = label
        self._process: anyio.abc.Process | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._streams: list[Any] = []
        self._stderr_read = anyio.Event()
        self.abrupt = False
        """Set when the server failed to start: closing then skips the wait for it to exit
        after its stdin closes (it did not answer; the wait would only add to the timeout)."""
        self.stop_phases: list[str] = []
        """How closing went: `stdin` (closed, then waited), `SIGTERM`, `SIGKILL`, in order."""
        self.stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        """The last lines the server wrote to stderr (when it goes to a pipe we read), quoted
        when the server fails to start."""

    async def __aenter__(self) -> tuple[Any, Any]:
        self._process = process = await anyio.open_process(
            self._argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self._env,
            cwd=self._cwd,
            start_new_session=True,  # its own process group: closing stops its children too
        )
        incoming_send, incoming = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        outgoing, outgoing_receive = anyio.create_memory_object_stream[SessionMessage](0)
        self._streams = [incoming_send, incoming, outgoing, outgoing_receive]
        group = anyio.create_task_group()
        try:
            await group.__aenter__()
        except BaseException:  # cancelled right after the spawn: the process must not live on
            with anyio.CancelScope(shield=True):
                await _stop(process, self._label, True, self.stop_phases)
            raise
        self._group = group
        group.start_soon(self._read_stdout, process, incoming_send)
        group.start_soon(self._write_stdin, process, outgoing_receive, incoming_send)
        if process.stderr is not None:
            group.start_soon(self._read_stderr, process.stderr)
        return incoming, outgoing

    async def __aexit__(self, *exc_info: object) -> None:
        group, process = self._group, self._process
        with anyio.CancelScope(shield=True):
            try:
                if process is not None:
                    await _stop(process, self._label, self.abrupt, self.stop_phases)
                    if process.stderr is not None:
                        # What it said last, read to the end (bounded: a child may keep it open).
                        with anyio.move_on_after(_STDERR_DRAIN_SECONDS):
                            await self._stderr_read.wait()
                        with contextlib.suppress(
                            OSError, anyio.BrokenResourceError, anyio.ClosedResourceError
                        ):
                            await process.stderr.aclose()
                for stream in self._streams:
                    await stream.aclose()
            finally:
                if group is not None:
                    group.cancel_scope.cancel()
        if group is not None:  # outside the shield: scopes are left in the order entered
            await group.__aexit__(None, None, None)

    # -- the pumps ------------------------------------------------------------------------------

    async def _read_stdout(
        self, process: anyio.abc.Process, sink: MemoryObjectSendStream[SessionMessage | Exception]
    ) -> None:
        """Split stdout into lines, each chunk scanned once; a line over the cap ends it all."""
        assert process.stdout is not None
        parts: list[bytes] = []
        size = 0
        try:
            async with sink:
                while True:
                    try:
                        chunk = await process.stdout.receive(_CHUNK)
                    except (anyio.EndOfStream, anyio.ClosedResourceError, OSError):
                        return
                    start = 0
                    while (end := chunk.find(b"\n", start)) >= 0:
                        if size + end - start > self._cap:
                            break
                        parts.append(chunk[start:end])
                        line = b"".join(parts)
                        parts.clear()
                        size = 0
                        start = end + 1
                        if len(line) > PARSE_OFF_LOOP_BYTES:
                            message = await run_internal_io(_parse, line, self._label)
                        elif line.strip():
                            message = _parse(line, self._label)
                        else:
                            continue
                        await sink.send(message)
                        if isinstance(message, TransportFault):
                            return  # its reply may have been that line: nothing waits for it
                    size += len(chunk) - start
                    if size > self._cap:
                        # Said at once, not at the line's end: a line may never end.
                        parts.clear()
                        await sink.send(self._too_large(size))
                        return
                    if start < len(chunk):
                        parts.append(chunk[start:] if start else chunk)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the session is gone; closing stops the process
        finally:
            await _drain(process.stdout)

    def _too_large(self, seen: int) -> MessageTooLarge:
        return MessageTooLarge(
            f"MCP server {self._label} sent a message over its max_message_bytes cap of "
            f"{self._cap:,} bytes ({seen:,} read so far); raise the cap with "
            "MCPServer.stdio(..., max_message_bytes=...) if such replies are expected."
        )

    async def _write_stdin(
        self,
        process: anyio.abc.Process,
        source: MemoryObjectReceiveStream[SessionMessage],
        incoming: MemoryObjectSendStream[SessionMessage | Exception],
    ) -> None:
        assert process.stdin is not None
        try:
            async with source:
                async for item in source:
                    data = item.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send(data.encode() + b"\n")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            # The server stopped reading: end the read side too, so no request waits forever.
            await incoming.aclose()

    async def _read_stderr(self, stream: anyio.abc.ByteReceiveStream) -> None:
        """Log each stderr line (cut to a bounded length) and keep the last few, to its end."""
        try:
            with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError, OSError):
                await self._log_stderr(stream)
        finally:
            self._stderr_read.set()

    async def _log_stderr(self, stream: anyio.abc.ByteReceiveStream) -> None:
        pending = b""
        while True:
            chunk = await stream.receive(_CHUNK)
            lines = chunk.split(b"\n")
            lines[0] = pending + lines[0]
            pending = lines.pop()[:_STDERR_LINE_CAP]
            logged = log.isEnabledFor(logging.DEBUG)
            for count, raw in enumerate(lines[-_STDERR_TAIL_LINES:] if not logged else lines):
                text = raw[:_STDERR_LINE_CAP].decode(errors="replace").rstrip()
                self.stderr_tail.append(text)
                if logged:
                    log.debug("MCP server %s stderr: %s", self._label, text)
                    if count % _STDERR_LINES_PER_STEP == _STDERR_LINES_PER_STEP - 1:
                        await anyio.lowlevel.checkpoint()  # handlers may be slow: share the loop


_REAPER = Path(__file__).with_name("reaper.py")


def _supervised(argv: list[str]) -> list[str]:
    """`argv` run under the supervisor where it works (Linux with /proc), else as is."""
    if sys.platform != "linux" or not os.path.isdir("/proc/self") or not sys.executable:
        return argv
    return [sys.executable, "-I", "-S", str(_REAPER), *argv]


def _parse(line: bytes, label: str) -> SessionMessage | TransportFault:
    """One line as a JSON-RPC message, or a `MalformedMessage` fault for one that is not.

    `json.loads` (C) builds the plain data, then pydantic types only the envelope: a result
    stays a plain dict here (typed later in small steps, see `treadle.mcp.listing`). A large
    message is parsed only when it holds at most `MAX_MESSAGE_CONTAINERS` arrays and objects
    and its estimated cost (`treadle.mcp.parse.cost`) is within `MAX_MESSAGE_COST_NS`, and
    with the garbage collector paused: `json.loads` holds the GIL throughout (a
    `MessageTooComplex` fault for more)."""
    try:
        # MCP messages are UTF-8: decoded first (one C call, about a millisecond per MiB), so the
        # container count and the parser read the same text; `json.loads` on bytes would also
        # take UTF-16, whose quote bytes the count would misread.
        text = line.decode("utf-8")
        if len(line) <= PARSE_OFF_LOOP_BYTES:
            data = json.loads(text)
        elif (count := containers(line)) > MAX_MESSAGE_CONTAINERS:
            return _too_complex(label, count, "JSON arrays and objects", MAX_MESSAGE_CONTAINERS)
        elif (count := exponents(line)) > MAX_MESSAGE_EXPONENTS:
            what = "numbers with a large exponent"
            return _too_complex(label, count, what, MAX_MESSAGE_EXPONENTS)
        elif (count := cost(line)) > MAX_MESSAGE_COST_NS:
            # each budget above kept, but one message near all of them would still cost their sum
            what = "ms of estimated parsing (its values, containers, exponents and long integers)"
            return _too_complex(label, count // 1_000_000, what, MAX_MESSAGE_COST_NS // 1_000_000)
        else:
            with collector_paused():
                # A large notification or server request is slimmed here, off the loop: the SDK
                # types its params on the loop, and Treadle needs none of a large one.
                data = slim(json.loads(text))
        return SessionMessage(types.jsonrpc_message_adapter.validate_python(data, by_name=False))
    except (ValueError, RecursionError) as error:
        why = "nested too deeply" if isinstance(error, RecursionError) else _first_line(error)
        log.warning("MCP server %s sent a line that is not JSON-RPC (%s)", label, why)
        return MalformedMessage(
            f"MCP server {label} sent a line that is not a JSON-RPC message ({why}); a reply "
            "may have been lost in it."
        )


def _too_complex(label: str, count: int, what: str, budget: int) -> MessageTooComplex:
    log.warning("MCP server %s sent a message of %d %s", label, count, what)
    return MessageTooComplex(
        f"MCP server {label} sent a message of {count:,} {what}, over the {budget:,} Treadle "
        "parses in one message (parsing it would stall every pass); send fewer, larger values "
        "(text, base64) or page them."
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


async def _drain(stream: anyio.abc.ByteReceiveStream) -> None:
    """Read and drop what the server still writes, so it never blocks on a full pipe on its way
    out; ends when the pipe closes (at the latest when closing kills the process)."""
    with (
        anyio.CancelScope(shield=True),
        contextlib.suppress(
            anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError
        ),
    ):
        while True:
            await stream.receive(_CHUNK)


async def _stop(process: anyio.abc.Process, label: str, abrupt: bool, phases: list[str]) -> None:
    """Close stdin, then SIGTERM the process group, then SIGKILL it, each with a bounded wait
    (`abrupt`: SIGTERM at once, for a server that never answered); `phases` gets each step."""
    if process.stdin is not None:
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await process.stdin.aclose()
    steps = (signal.SIGTERM, signal.SIGKILL) if abrupt else (None, signal.SIGTERM, signal.SIGKILL)
    for sig in steps:
        phases.append("stdin" if sig is None else sig.name)
        if sig is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
        if await _exited(process):
            break
    else:
        log.warning("MCP server %s (pid %d) survived SIGKILL; abandoning it", label, process.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        # A child the server left behind in its group must not outlive it either.
        os.killpg(process.pid, signal.SIGKILL)
    if process.stdout is not None:
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await process.stdout.aclose()


async def _exited(process: anyio.abc.Process) -> bool:
    """Whether the process exits within `_EXIT_SECONDS` (polled: on asyncio, `wait()` also waits
    for the pipes to close, which a grandchild may hold open)."""
    with anyio.move_on_after(_EXIT_SECONDS):
        while process.returncode is None:  # noqa: ASYNC110 - no event to wait on
            await anyio.sleep(_POLL_SECONDS)
    return process.returncode is not None
