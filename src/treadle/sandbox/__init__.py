"""Sandboxes: the `Backend` protocol, opening placements (`Sandbox`), the `local` and `isolated`
backends, workspace seeding and export, and the built-in workspace tools offered to sessions bound
with `session.to(...)`. The refcounted `SandboxHandle` is a value of the session layer, re-exported
here.
"""

from treadle.sandbox.backend import Backend, CommandResult, DirEntry, FileContent
from treadle.sandbox.bwrap import BOX_ENV, BOX_WORKSPACE, Isolated, ResourceLimits
from treadle.sandbox.environment import DEFAULT_ENV_ALLOW, SECRET_PATTERNS, scrubbed_environment
from treadle.sandbox.exporting import MAX_EXPORT_BYTES, export_workspace
from treadle.sandbox.isolated import IsolatedBackend
from treadle.sandbox.local import MAX_LIST_ENTRIES, MAX_READ_BYTES, SANDBOX_IO_THREADS, LocalBackend
from treadle.sandbox.opening import Sandbox, open_placement
from treadle.sandbox.paths import MAX_PATH_CHARS, resolve_in_workspace
from treadle.sandbox.process import DEFAULT_COMMAND_TIMEOUT, MAX_STREAM_BYTES
from treadle.sandbox.seeding import seed_workspace

from treadle.sandbox.builtin_tools import global_system_tools  # isort: skip (needs opening)
from treadle.session.placement import SandboxHandle

__all__ = [
    "BOX_ENV",
    "BOX_WORKSPACE",
    "DEFAULT_COMMAND_TIMEOUT",
    "DEFAULT_ENV_ALLOW",
    "MAX_EXPORT_BYTES",
    "MAX_LIST_ENTRIES",
    "MAX_PATH_CHARS",
    "MAX_READ_BYTES",
    "MAX_STREAM_BYTES",
    "SANDBOX_IO_THREADS",
    "SECRET_PATTERNS",
    "Backend",
    "CommandResult",
    "DirEntry",
    "FileContent",
    "Isolated",
    "IsolatedBackend",
    "LocalBackend",
    "ResourceLimits",
    "Sandbox",
    "SandboxHandle",
    "export_workspace",
    "global_system_tools",
    "open_placement",
    "resolve_in_workspace",
    "scrubbed_environment",
    "seed_workspace",
]
