"""Confine user-given paths to a workspace directory.

`resolve_in_workspace` turns a model-supplied path into an absolute path inside the workspace or
raises `PathViolation`: `..` that climbs out, absolute paths elsewhere and symlinks pointing out
are all refused, as are NUL bytes and absurdly long paths. It touches the filesystem (to follow
symlinks), so call it on a worker thread. This module must never create, change or delete files.
"""

from __future__ import annotations

import os
from pathlib import Path

from treadle.errors import PathViolation

__all__ = ["MAX_PATH_CHARS", "relative_name", "resolve_in_workspace", "workspace_parts"]

#: Longest path accepted from a tool call (longer ones are refused before touching the disk).
MAX_PATH_CHARS = 4096


def _check_text(path: object) -> None:
    if not isinstance(path, str):
        raise PathViolation(f"a path must be a string, got {type(path).__name__}.")
    if "\x00" in path:
        raise PathViolation("the path contains a NUL byte; use a plain relative path.")
    if len(path) > MAX_PATH_CHARS:
        raise PathViolation(
            f"the path is {len(path)} characters long (limit {MAX_PATH_CHARS}); use a shorter one."
        )


def resolve_in_workspace(root: Path, path: str) -> Path:
    """The real absolute path `path` names inside `root` (symlinks followed).

    `root` must already be a real path. Raises `PathViolation` when the result is outside it.
    """
    _check_text(path)
    candidate = Path(path) if os.path.isabs(path) else root / (path or ".")
    try:
        real = Path(os.path.realpath(candidate))
    except (OSError, ValueError) as e:
        raise PathViolation(f"the path {path!r} cannot be resolved ({e}).") from None
    if real != root and root not in real.parents:
        raise PathViolation(
            f"the path {path!r} leaves the workspace; use a path relative to the workspace root "
            "without '..' or links that point outside it."
        )
    return real


def relative_name(root: Path, real: Path) -> str:
    """`real` relative to `root`, as the model should see it (`"."` for the root)."""
    return real.relative_to(root).as_posix() or "."


def workspace_parts(root: Path, path: str) -> tuple[str, ...]:
    """`path` as plain names below `root` (`()` for the root itself), without touching the disk.

    `..` is resolved by the names alone (nothing is followed, so that is what the kernel would do
    too); an absolute path must lie inside `root`. Raises `PathViolation` otherwise.
    """
    _check_text(path)
    if os.path.isabs(path):
        rest = os.path.relpath(os.path.normpath(path), root)
    else:
        rest = os.path.normpath(path or ".")
    if rest == ".":
        return ()
    if rest == ".." or rest.startswith("../") or os.path.isabs(rest):
        raise PathViolation(
            f"the path {path!r} leaves the workspace; use a path relative to the workspace root "
            "without '..'."
        )
    return tuple(rest.split("/"))
