"""`CallbackPump`: delivers a pass's stream deltas to a user callback without stalling the loop.

Sync callbacks run in a worker thread, in batches, in order; async callbacks are awaited by the
pump's own task. A slow callback therefore delays only its own pass (which waits for the pump at
each round's end so events stay ordered before the row they describe), and a raising callback
ends only its own pass: the error is re-raised at the next round boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable
from typing import Any

from treadle.runtime.threads import run_user_code

__all__ = ["CallbackPump"]


class CallbackPump:
    """An ordered, owned delivery queue from one pass to one callback."""

    def __init__(self, callback: Callable[[Any], Any]) -> None:
        self._callback = callback
        # Callable objects with an `async def __call__` count as async too.
        self._is_async = inspect.iscoroutinefunction(callback) or inspect.iscoroutinefunction(
            type(callback).__call__
        )
        self._buffer: list[Any] = []
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None

    def put(self, item: Any) -> None:
        """Queue `item` for the callback (dropped once the callback has failed)."""
        if self.error is not None:
            return
        self._buffer.append(item)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._buffer and self.error is None:
            batch, self._buffer = self._buffer, []
            try:
                if self._is_async:
                    for item in batch:
                        await self._callback(item)
                else:
                    await run_user_code(_deliver, self._callback, batch)
            except asyncio.CancelledError:
                raise
            except BaseException as err:  # SystemExit too: the callback ends its pass, not others
                self.error = err
                self._buffer.clear()

    async def drain(self) -> None:
        """Wait until every queued item was delivered; re-raise the callback's error."""
        task = self._task
        if task is not None:
            await asyncio.shield(task)
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        """Stop delivering (used when the pass ends by an error or cancellation)."""
        self._buffer.clear()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            # The pass is already ending; the pump's own outcome has nothing left to report.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _deliver(callback: Callable[[Any], Any], batch: list[Any]) -> None:
    for item in batch:
        callback(item)
