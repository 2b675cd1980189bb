"""`treadle run --mcp "command args"` and `--mcp-url URL`: MCP servers whose tools the pass gets.

Imported only when one of those flags is given, so `treadle run` without them never imports the
MCP SDK. A server that cannot start is reported before the pass, with the flag to check.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from treadle.cli.failures import EXIT_CODES, CliFailure
from treadle.errors import MCPServerError

if TYPE_CHECKING:
    from treadle.mcp import MCPServer

__all__ = ["close_servers", "open_servers"]


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
    `connect_timeout` bounds each server's start and first tool listing (None: the MCP default).
    """
    named = list(prefixes) + [None] * (len(commands) + len(urls) - len(prefixes))
    limits: dict[str, Any] = {}
    if connect_timeout is not None:
        limits["connect_timeout"] = connect_timeout
    try:
        from treadle.mcp import MCPServer, atools_from
    except ImportError:
        raise CliFailure(
            "--mcp and --mcp-url need the MCP SDK, which is not installed.",
            "install it with: pip install 'treadle[mcp]'",
            EXIT_CODES["usage"],
        ) from None
    servers: list[MCPServer] = []
    for command, prefix in zip(commands, named, strict=False):
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
        # The link reports its own start timeout by the error's type name: a server that does
        # not answer could not be reached (4), one that cannot start is misconfigured (2).
        if "(TimeoutError" in cause:
            from treadle.mcp.server import DEFAULT_CONNECT_TIMEOUT

            seconds = connect_timeout or DEFAULT_CONNECT_TIMEOUT
            server = cause.split(" (TimeoutError", 1)[0]
            raise CliFailure(
                f"{server}: no answer within {seconds:g} s.",
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


async def close_servers(servers: Sequence[MCPServer]) -> None:
    """Close every server (stopping stdio server processes)."""
    for server in servers:
        await server.aclose()
