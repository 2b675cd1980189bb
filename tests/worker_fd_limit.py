"""A process worker's `worker_init` for tests/test_distributed_pipe.py, in a module that imports
next to nothing (importing the test module would load, among much else, what the worker must
import for itself)."""

from __future__ import annotations

import asyncio
import os
import resource


def lower_fd_limit_soon() -> None:
    """Once the worker is serving, no new file descriptor can be opened in it."""

    def lower() -> None:
        highest = max(fd for fd in range(4096) if _is_open(fd))
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
        held = []  # the free numbers below the limit, taken (kept open for the worker's life)
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                return

    asyncio.get_running_loop().call_soon(lower)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
