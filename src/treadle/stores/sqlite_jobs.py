"""The jobs of a SQLite database thread (`treadle.stores.sqlite_thread`) and how their outcomes
reach their callers: each job's target is settled on its caller's loop, with one thread-safe
call per loop and batch; a job submitted with `DatabaseThread.submit_here` is settled on the
database thread itself (`HERE`), whatever becomes of its caller's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

from treadle.errors import StoreError

__all__ = ["HERE", "Job", "Target", "deliver"]

#: What a job's outcome goes to on its loop: a future, or a function called with
#: `(value, error)` (no future, no callback scheduled: see `DatabaseThread.submit_then`).
Target: TypeAlias = "asyncio.Future[Any] | Callable[[Any, BaseException | None], None]"

#: A job: the function to run with the connection, the loop and target awaiting it, and whether
#: it only reads (it then needs no savepoint: there is nothing of its own to undo).
Job = tuple[Callable[[sqlite3.Connection], Any], asyncio.AbstractEventLoop, Target, bool]


class Here:
    """The "loop" of a job settled on the database thread itself (`submit_here`)."""

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)


HERE = Here()


def deliver(path: Path, outcomes: list[tuple[Job, Any, BaseException | None]]) -> None:
    """Settle each job's future on its own loop: one thread-safe call per loop."""
    if not outcomes:
        return
    first = outcomes[0][0][1]
    for job, _, _ in outcomes:
        if job[1] is not first:
            break
    else:  # every job of the batch from one loop (the common case): no grouping by loop
        settled = [(job[2], value, error) for job, value, error in outcomes]
        with contextlib.suppress(RuntimeError):  # that loop has closed: no one waits any more
            first.call_soon_threadsafe(_settle, path, settled)
        return
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Target, Any, Any]]] = {}
    for (_, loop, target, _), value, error in outcomes:
        by_loop.setdefault(loop, []).append((target, value, error))
    for loop, settled in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that loop has closed: no one waits any more
            loop.call_soon_threadsafe(_settle, path, settled)


def _settle(path: Path, settled: list[tuple[Target, Any, BaseException | None]]) -> None:
    for target, value, error in settled:
        if not isinstance(target, asyncio.Future):
            try:
                target(value, error)
            except BaseException as err:  # the other jobs of the batch are still settled
                asyncio.get_running_loop().call_exception_handler(
                    {"message": "a SQLite store job's outcome callback failed", "exception": err}
                )
            continue
        if target.done():  # its caller was cancelled (the job still ran)
            continue
        if error is not None:
            if isinstance(error, sqlite3.Error):  # what the store's callers catch
                error = StoreError(f"the SQLite store {path} failed: {error}.")
            target.set_exception(error)
        else:
            target.set_result(value)
