"""`treadle run --mcp "command args"` and `--mcp-url URL`: MCP servers whose tools the pass gets.

Imported only when one of those flags is given, so `treadle run` without them never imports the
MCP SDK. A server that cannot start is reported before the pass, with the flag to check.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from treadle.cli.failures import EXIT_CODES, CliFailure
from treadle.errors import MCPServerError

if TYPE_CHECKING:
    from treadle.mcp import MCPServer

__all__ = ["close_servers", "open_servers"]


#: Seconds every server gets to start however long loading the SDK took (the rest of the
#: --mcp-timeout, counted from when the servers are opened, when that is longer; the whole
#: --mcp-timeout when that is shorter: the user's bound is never exceeded for a start).
_LEAST_SECONDS = 1.0

# Start failures that mean "could not be reached" (exit 4), by the type name the link reports.
_UNREACHABLE = ("ConnectError", "ConnectTimeout", "ConnectionRefusedError", "HostNotFoundError")

# The library's advice to a Python caller ("..., then call again."): a CLI user reruns instead.
_CALL_AGAIN = re.compile(r"; [^;]*?then call again\.")


async def open_servers(
    commands: Sequence[str],
    urls: Sequence[str],
    prefixes: Sequence[str | None] = (),
    *,
    connect_timeout: float | None = None,
) -> tuple[list[MCPServer], list[Any]]:
    """Start the servers and list their tools; `CliFailure` naming the flag when one fails.

    `prefixes[i]` (`--mcp-prefix`) names the tools of server i, counted over `commands` then
    `urls`; a missing or None entry leaves that server's tool names as they are.
    `connect_timeout` bounds the whole wait, loading the MCP SDK included, from the call to each
    server's first tool listing (None: the MCP default); each server gets at least
    `_LEAST_SECONDS` of it, or all of it when it is shorter.
    """
    named = list(prefixes) + [None] * (len(commands) + len(urls) - len(prefixes))
    argvs: list[list[str]] = []  # checked before the SDK loads: a typo is reported at once
    for command in commands:
        try:
            parts = shlex.split(command)
        except ValueError as error:
            raise CliFailure(
                f"--mcp {command!r} is not a valid command line ({error}).",
                'quote it as one argument, e.g. --mcp "python -m my_server --flag".',
                EXIT_CODES["usage"],
            ) from None
        if not parts:
            raise CliFailure(
                "--mcp needs a command.", 'e.g. --mcp "mcp-server-time"', EXIT_CODES["usage"]
            )
        await _check_command(command, parts[0])
        argvs.append(parts)
    started = time.monotonic()
    try:
        from treadle.mcp import MCPServer, atools_from
        from treadle.mcp.server import DEFAULT_CONNECT_TIMEOUT
    except ImportError:
        raise CliFailure(
            "--mcp and --mcp-url need the MCP SDK, which is not installed.",
            "install it with: pip install 'treadle[mcp]'",
            EXIT_CODES["usage"],
        ) from None
    # The wait the user asked for starts now: loading the SDK (a second or more) counts against
    # it, but the servers themselves always get at least `_LEAST_SECONDS` of it (all of it
    # when the user asked for less).
    asked = connect_timeout if connect_timeout is not None else DEFAULT_CONNECT_TIMEOUT
    loading = time.monotonic() - started
    limits: dict[str, Any] = {"connect_timeout": max(asked - loading, min(asked, _LEAST_SECONDS))}
    servers: list[MCPServer] = []
    for parts, prefix in zip(argvs, named, strict=False):
        servers.append(MCPServer.stdio(parts[0], parts[1:], prefix=prefix, **limits))
    servers.extend(
        MCPServer.http(url, prefix=prefix, **limits)
        for url, prefix in zip(urls, named[len(commands) :], strict=False)
    )
    try:
        return servers, await atools_from(*servers)
    except MCPServerError as error:
        await close_servers(servers)
        cause = _CALL_AGAIN.sub(".", str(error))
        # The link reports what ended a start by the error's type name: a server that cannot be
        # reached or does not answer exits 4 (as an unreachable endpoint does), one that cannot
        # start or does not speak MCP is misconfigured (2).
        if any(f"({name}" in cause for name in _UNREACHABLE):
            raise CliFailure(
                cause,
                "check that the server runs and the --mcp-url (host and port) is right.",
                EXIT_CODES["connection"],
            ) from None
        if "(TimeoutError" in cause:
            server = cause.split(" (TimeoutError", 1)[0]
            # The wait for an answer as granted, not the clock now: stopping a server that
            # ignores SIGTERM takes seconds more, which is not time it was given to answer.
            waited = loading + limits["connect_timeout"]
            said = f" ({loading:.1f} s of it loading the MCP SDK)" if loading >= 0.1 else ""
            raise CliFailure(
                f"{server}: no answer within {waited:.1f} s{said}.",
                "check that the --mcp command or --mcp-url is an MCP server, or give a slow one "
                "longer with --mcp-timeout SECONDS.",
                EXIT_CODES["connection"],
            ) from None
        raise CliFailure(
            cause,
            "check the --mcp command or --mcp-url, and that the server runs and speaks MCP.",
            EXIT_CODES["usage"],
        ) from None
    except BaseException:
        await close_servers(servers)
        raise


async def _check_command(command: str, program: str) -> None:
    """Refuse a `--mcp` command that is not on PATH (nor a file) before it is started: its
    failure would otherwise surface as "connection closed" after the child's own complaint."""
    import asyncio
    import shutil

    if await asyncio.to_thread(shutil.which, program) is not None:  # PATH lookup: file stats
        return
    name = program.rsplit("/", 1)[-1]
    if "/" in program:
        exists = await asyncio.to_thread(os.path.isfile, program)
        cause = f"{program} is not executable" if exists else f"there is no file {program}"
        fix = (
            f'run it with its interpreter (--mcp "python {program}") or chmod +x {program}.'
            if exists
            else "check the path (relative to the current directory)."
        )
    else:
        cause = f"no program named {program!r} on PATH"
        fix = (
            f'install it, or pass its full path (--mcp "/path/to/{name} ..."); '
            f"`which {shlex.quote(program)}` shows whether your shell finds it."
        )
    raise CliFailure(f"--mcp {command!r}: {cause}.", fix, EXIT_CODES["usage"])


async def close_servers(servers: Sequence[MCPServer]) -> None:
    """Close every server (stopping stdio server processes)."""
    for server in servers:
        await server.aclose()
