"""Run one shell command in its own process group, with a timeout and capped, streamed output.

The command runs under `/bin/sh -c` with `start_new_session=True`, so the whole group (the shell
and everything it started) is killed with SIGKILL on timeout, on cancellation and when the shell
exits (background jobs do not outlive their command). Output is read incrementally: at most
`max_bytes` per stream are kept, the rest is counted and dropped, so a flood never sits in memory.
This module must never block the event loop and never leave a child process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import anyio
import anyio.abc

from treadle.errors import ConfigurationError
from treadle.sandbox.backend import CommandResult
from treadle.tools.results import truncation_marker

__all__ = ["DEFAULT_COMMAND_TIMEOUT", "MAX_STREAM_BYTES", "kill_process_group", "run_command"]

#: Seconds a sandbox command may run before its process group is killed.
DEFAULT_COMMAND_TIMEOUT = 60.0
#: Bytes kept per output stream (stdout, stderr); the rest is dropped with a truncation marker.
MAX_STREAM_BYTES = 64 * 1024

_READ_CHUNK = 64 * 1024


def kill_process_group(pgid: int) -> None:
    """SIGKILL every process in group `pgid` (no error when it is already gone)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class _CappedBuffer:
    """Keeps the first `limit` bytes of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.dropped = 0

    def feed(self, chunk: bytes) -> None:
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        text = self.kept.decode("utf-8", errors="replace")
        return text + truncation_marker(self.dropped, "bytes") if self.dropped else text


async def _pump(stream: anyio.abc.ByteReceiveStream | None, buffer: _CappedBuffer) -> None:
    if stream is None:
        return
    try:
        while True:
            buffer.feed(await stream.receive(_READ_CHUNK))
    except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass


async def _spawn(
    command: str,
    cwd: Path,
    env: Mapping[str, str],
    launcher: Sequence[str] = (),
    kill: Callable[[int], None] = kill_process_group,
    on_start: Callable[[int], None] | None = None,
    on_exit: Callable[[int], None] | None = None,
) -> anyio.abc.Process:
    """Start `/bin/sh -c command` in a new session; a cancellation waits for the start, then kills.

    asyncio, cancelled while it still sets a child up, waits for the child's pipes to close, and
    a grandchild (`sleep 60` under the shell) holds them open for as long as it lives. So the
    start runs in its own task; if the caller is cancelled meanwhile, the group it started is
    killed as soon as its id is known, and the cancellation goes on (`on_start` and `on_exit`
    see that group too: a backend's `kill` may need what it tracks from the start).
    """
    start = asyncio.ensure_future(
        anyio.open_process(
            [*launcher, "/bin/sh", "-c", command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=dict(env),
            start_new_session=True,
        )
    )
    try:
        return await asyncio.shield(start)
    except asyncio.CancelledError:
        with anyio.CancelScope(shield=True):
            try:
                process = await start
            except Exception:  # the start itself failed: nothing is left running
                raise asyncio.CancelledError from None
            if on_start is not None:
                on_start(process.pid)
            try:
                kill(process.pid)
                await process.aclose()
            finally:
                if on_exit is not None:
                    on_exit(process.pid)
        raise


async def run_command(
    command: str,
    *,
    cwd: Path,
    env: Mapping[str, str],
    timeout: float | None = DEFAULT_COMMAND_TIMEOUT,  # noqa: ASYNC109 (reported, not raised)
    max_bytes: int = MAX_STREAM_BYTES,
    on_start: Callable[[int], None] | None = None,
    on_exit: Callable[[int], None] | None = None,
    launcher: Sequence[str] = (),
    kill: Callable[[int], None] = kill_process_group,
) -> CommandResult:
    """Run `command` through `/bin/sh -c` in `cwd`; kill its process group when done or late.

    `on_start(pgid)` / `on_exit(pgid)` let the backend track live groups (to kill them on close).
    `launcher` is an argv prefix the shell runs under (the isolated backend's box, which as root
    switches to the box's uid itself). `kill(pgid)` stops the group (the isolated backend stops
    its box's namespace init first, see `treadle.sandbox.box_reaping`).
    Cancelling the caller kills the group too, then re-raises the cancellation. `timeout` is None
    (no limit) or a finite number of seconds > 0; anything else is a `ConfigurationError`.
    """
    if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
        raise ConfigurationError(
            f"a command timeout must be a number of seconds > 0 (or None), got {timeout!r}."
        )
    started = time.monotonic()
    process = await _spawn(command, cwd, env, launcher, kill, on_start, on_exit)
    pgid = process.pid  # a new session's leader: its pid is the group id
    if on_start is not None:
        on_start(pgid)
    out, err = _CappedBuffer(max_bytes), _CappedBuffer(max_bytes)
    try:
        with anyio.move_on_after(timeout) as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(_pump, process.stdout, out)
                group.start_soon(_pump, process.stderr, err)
                await process.wait()
                kill(pgid)  # background jobs would hold the pipes open
    finally:
        kill(pgid)
        with anyio.CancelScope(shield=True):
            await process.aclose()
        if on_exit is not None:
            on_exit(pgid)
    return CommandResult(
        exit_code=process.returncode,
        stdout=out.text(),
        stderr=err.text(),
        elapsed_ms=int((time.monotonic() - started) * 1000),
        timed_out=scope.cancelled_caught,
    )
