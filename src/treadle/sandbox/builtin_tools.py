"""The built-in workspace tools offered whenever a session has a sandbox placement.

`run_shell_command`, `write_workspace_file`, `read_workspace_file` and `list_workspace_files`
all work through the calling session's sandbox, so they inherit its confinement, timeouts, output
caps and scrubbed environment. This module must never touch the filesystem directly: every
operation goes to the opened sandbox's backend (straight to it, one hop less on every call).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from treadle.errors import ToolTimeoutError
from treadle.sandbox.opening import Sandbox
from treadle.sandbox.process import DEFAULT_COMMAND_TIMEOUT
from treadle.tools.tool import FunctionTool, Tool, tool

__all__ = [
    "MAX_MODEL_TIMEOUT",
    "MIN_MODEL_TIMEOUT",
    "clamp_model_timeout",
    "global_system_tools",
    "list_workspace_files",
    "read_workspace_file",
    "run_shell_command",
    "write_workspace_file",
]


def _path_key(arguments: Mapping[str, Any]) -> str:
    return f"workspace-path:{arguments.get('path')}"


#: The shortest timeout a model may ask `run_shell_command` for, in seconds.
MIN_MODEL_TIMEOUT = 1.0
#: The longest, when the sandbox sets no limit of its own (otherwise the sandbox's limit).
MAX_MODEL_TIMEOUT = 600.0


def clamp_model_timeout(requested: float | None, sandbox_limit: float | None) -> float | None:
    """The timeout a model's request gets: within [`MIN_MODEL_TIMEOUT`, the sandbox's limit].

    None (or NaN) means the sandbox's own limit. The model can shorten a command's time but
    never lengthen it past what the user configured (`MAX_MODEL_TIMEOUT` when nothing is).
    """
    ceiling = sandbox_limit if sandbox_limit is not None else MAX_MODEL_TIMEOUT
    if requested is None or math.isnan(requested):
        return sandbox_limit
    return min(max(requested, MIN_MODEL_TIMEOUT), max(ceiling, MIN_MODEL_TIMEOUT))


def _partial_output(stdout: str, stderr: str) -> str:
    return f"stdout so far:\n{stdout}\nstderr so far:\n{stderr}"


@tool
async def run_shell_command(
    sandbox: Sandbox,
    cmd: str,
    timeout: float | None = None,  # noqa: ASYNC109 (reported)
) -> dict[str, Any]:
    """Run a shell command (`/bin/sh -c`) in the workspace directory and return its output.

    Args:
        cmd: The command line, e.g. `ls -la` or `python script.py`.
        timeout: Seconds before the command and everything it started are killed, at least 1
            and at most the sandbox's limit (default: the sandbox's limit).
    """
    limit = getattr(sandbox.backend, "command_timeout", DEFAULT_COMMAND_TIMEOUT)
    applied = clamp_model_timeout(timeout, limit)
    result = await sandbox.backend.run_command(cmd, timeout=applied)
    if result.timed_out:
        raise ToolTimeoutError(
            f"the command ran past its {applied:g} s timeout; it and everything it started "
            "were killed. Run something shorter, or in the background writing to a file.",
            detail=_partial_output(result.stdout, result.stderr),
        )
    body: dict[str, Any] = {
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "elapsed_ms": result.elapsed_ms,
    }
    if timeout is not None and applied != timeout:
        body["timeout_note"] = f"timeout {timeout:g} s was clamped to {applied:g} s"
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
