"""The built-in workspace tools offered whenever a session has a sandbox placement.

`run_shell_command`, `write_workspace_file`, `read_workspace_file` and `list_workspace_files`
all work through the calling session's sandbox, so they inherit its confinement, timeouts, output
caps and scrubbed environment. This module must never touch the filesystem directly: every
operation goes to the opened sandbox's backend (straight to it, one hop less on every call).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from treadle.sandbox.opening import Sandbox
from treadle.tools.tool import FunctionTool, Tool, tool

__all__ = [
    "global_system_tools",
    "list_workspace_files",
    "read_workspace_file",
    "run_shell_command",
    "write_workspace_file",
]


def _path_key(arguments: Mapping[str, Any]) -> str:
    return f"workspace-path:{arguments.get('path')}"


@tool
async def run_shell_command(
    sandbox: Sandbox,
    cmd: str,
    timeout: float | None = None,  # noqa: ASYNC109 (reported)
) -> dict[str, Any]:
    """Run a shell command (`/bin/sh -c`) in the workspace directory and return its output.

    Args:
        cmd: The command line, e.g. `ls -la` or `python script.py`.
        timeout: Seconds before the command and everything it started are killed
            (default: the sandbox's limit).
    """
    result = await sandbox.backend.run_command(cmd, timeout=timeout)
    body: dict[str, Any] = {
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "elapsed_ms": result.elapsed_ms,
    }
    if result.timed_out:
        body["timed_out"] = True
    return body


@tool(resource_key=_path_key)
async def write_workspace_file(sandbox: Sandbox, path: str, content: str) -> dict[str, Any]:
    """Create or replace a text file in the workspace (parent directories are created).

    Args:
        path: The file path, relative to the workspace root.
        content: The full text to write.
    """
    written = await sandbox.backend.write_file(path, content.encode())
    return {"path": path, "bytes_written": written}


@tool(resource_key=_path_key)
async def read_workspace_file(sandbox: Sandbox, path: str) -> dict[str, Any]:
    """Read a text file from the workspace.

    Args:
        path: The file path, relative to the workspace root.
    """
    content = await sandbox.backend.read_file(path)
    body: dict[str, Any] = {"path": content.path, "data": content.data.decode(errors="replace")}
    if content.truncated:
        body["size"] = content.size
        body["truncated"] = True
    return body


@tool
async def list_workspace_files(sandbox: Sandbox, path: str = ".") -> dict[str, Any]:
    """List the entries of a workspace directory (name, type, size in bytes).

    Args:
        path: The directory, relative to the workspace root.
    """
    entries = await sandbox.backend.list_files(path)
    return {
        "path": path,
        "entries": [{"name": e.name, "type": e.type, "size": e.size} for e in entries],
    }


_BUILTINS: tuple[FunctionTool, ...] = (
    run_shell_command,
    write_workspace_file,
    read_workspace_file,
    list_workspace_files,
)


def global_system_tools() -> tuple[Tool, ...]:
    """The built-in workspace tools (shared, stateless `Tool` objects)."""
    return _BUILTINS
