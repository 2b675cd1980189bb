"""Serving from a background thread: what the fake server and the fake proxy share.

Synchronous tests (and the command line) run a fake endpoint on its own event loop in a daemon
thread; `start()` returns once it listens (or raises what stopped it from listening), `stop()`
stops the loop, lets the endpoint close its connections and joins the thread.
"""

from __future__ import annotations

import abc
import asyncio
import threading
from typing import Self

__all__ = ["BackgroundServing"]


class BackgroundServing(abc.ABC):
    """Mixin: `start()`/`stop()` and a `with` block over `start_serving()`/`stop_serving()`.

    The class that mixes it in sets `_loop` in `start_serving()` (the loop it serves on), starts
    with `_thread = None`, and names its thread with `_thread_name`.
    """

    _thread_name = "treadle-fake"
    _loop: asyncio.AbstractEventLoop | None
    _thread: threading.Thread | None

    @abc.abstractmethod
    async def start_serving(self) -> None:
        """Listen on the current loop (the class that mixes this in says how)."""

    @abc.abstractmethod
    async def stop_serving(self) -> None:
        """Stop listening and close every connection (the class that mixes this in says how)."""

    def start(self) -> Self:
        """Serve from a background thread with its own event loop; returns once listening."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(self.start_serving())
            except BaseException as exc:
                errors.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
                loop.run_until_complete(self.stop_serving())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name=self._thread_name, daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        """Stop the background endpoint and join its thread."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
        self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
