"""`CloseOnce`: a store's first close runs; a later one (any thread, any loop) waits for it to
end instead of returning while the first still settles the writes running (bounded: its own
grace, then `AFTER_GRACE_SECONDS`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from treadle.errors import StoreError

__all__ = ["AFTER_GRACE_SECONDS", "CloseOnce"]

#: Past its grace, how long a later close still waits for the first: the server's answers to
#: a PostgreSQL close's cancels (`postgres_loops.CANCEL_SECONDS`), and a second to close.
AFTER_GRACE_SECONDS = 6.0


class CloseOnce:
    """Which close of a store runs (the first), and the end the later ones wait for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: concurrent.futures.Future[None] | None = None
        self._begun = False  # a close has begun (and ended without closing, maybe)
        self.waiters = 0
        """Later closes waiting for the first now."""

    @property
    def begun(self) -> bool:
        """A close has begun (the store takes no new call)."""
        return self._begun or self._done is not None

    def check(self, url: str) -> None:
        """A `StoreError` once a close has begun: a new call of the store's caller fails at once
        (the commits of passes already running still land, within the close's grace)."""
        if self.begun:
            raise StoreError(
                f"the store {url} was closed (its close has begun) before this call; nothing of"
                " it was written; open a new Store."
            )

    async def first(self, grace: float) -> bool:
        """True for the first close (which calls `end` once it has ended); a later one waits
        for that end (at most `grace` and `AFTER_GRACE_SECONDS` more), then False."""
        with self._lock:
            done = self._done
            if done is None:
                self._done = concurrent.futures.Future()
                return True
            self.waiters += 1
        try:
            if not done.done():  # asyncio.wait never cancels what it waits for
                ended = asyncio.wrap_future(done)
                await asyncio.wait([ended], timeout=max(0.0, grace) + AFTER_GRACE_SECONDS)
        finally:
            with self._lock:
                self.waiters -= 1
        return False

    def end(self, *, ran: bool = True) -> None:
        """The first close has ended: the later ones return. Without `ran` (it was cancelled,
        or failed, before the store was closed) the next close runs again in its place."""
        with self._lock:
            done = self._done
            if not ran:
                self._done = None
                self._begun = True  # still refusing new calls (`check`)
        if done is not None and not done.done():
            done.set_result(None)
