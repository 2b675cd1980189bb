"""Worker sandbox roots named after their owner process, and the janitor that removes orphans.

Each worker keeps its pass sandboxes under one root, `<base>/treadle-worker-<host>-<pid>-<tag>`.
A worker killed mid-pass cannot delete its sandboxes, so every worker, when it starts, removes
the roots on its own host whose owner process is gone. This module must never delete a root whose
owner is alive, nor one made on another host (bases may be on shared storage).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
from pathlib import Path

__all__ = ["ROOT_PREFIX", "clean_orphans", "default_sandbox_base", "make_sandbox_root", "owner_of"]

#: Directory name prefix of a worker's sandbox root.
ROOT_PREFIX = "treadle-worker-"


def default_sandbox_base() -> Path:
    """Where worker sandbox roots go by default: `<tempdir>/treadle-sandboxes`."""
    return Path(tempfile.gettempdir()) / "treadle-sandboxes"


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def make_sandbox_root(base: str | os.PathLike[str] | None = None) -> Path:
    """Create this process's sandbox root under `base` and return it."""
    base_path = Path(base) if base is not None else default_sandbox_base()
    base_path.mkdir(parents=True, exist_ok=True)
    root = base_path / f"{ROOT_PREFIX}{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
    root.mkdir()
    return root


def owner_of(root: Path) -> tuple[str, int] | None:
    """`(host, pid)` of a sandbox root's owner, or None when the name is not a worker root."""
    name = root.name
    if not name.startswith(ROOT_PREFIX):
        return None
    parts = name[len(ROOT_PREFIX) :].rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_orphans(base: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the sandbox roots under `base` left by dead workers of this host; return them."""
    base_path = Path(base) if base is not None else default_sandbox_base()
    try:
        entries = list(base_path.iterdir())
    except FileNotFoundError:
        return []
    host = _host()
    removed = []
    for entry in entries:
        owner = owner_of(entry)
        if owner is None or owner[0] != host or owner[1] == os.getpid() or _alive(owner[1]):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed
