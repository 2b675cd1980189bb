"""A worker's side of the map's shared learned limits: permits leased from a `LimitBroker`.

A backend worker (process or Ray) calls `install_shared_limits(call, worker)` once, with `call`
sending one lease message to the map's broker and returning its reply. From then on every
limiter of that process that learns an endpoint's limits (`EndpointLimiter(learn=True)`) takes
its permits from a `SharedEndpoint`: from the ones in hand when it has some (no round trip),
else by one lease that also carries what the replies since the last one taught. A 429 is
reported at once and drops the permits in hand; the broker pauses every worker, and a backend
that can push (the process pool) tells the others at once with `pause_shared`.

When the broker cannot be reached (`call` raises or times out), the endpoint falls back for good
to the limiter's own learned limits, paced at the worker's static share. Nothing here blocks the
event loop; background report flushes belong to their endpoint and end with the process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from treadle.llm.limit_broker import MAX_LEASE, rate_headers

__all__ = ["LeaseCall", "SharedEndpoint", "install_shared_limits", "pause_shared",
           "shared_endpoint", "uninstall_shared_limits"]  # fmt: skip

log = logging.getLogger("treadle.llm")

LeaseCall = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""Sends one lease message to the broker and returns its reply (raises when it cannot)."""

_FLUSH_REPORTS = 64
"""Reports kept before they are sent without waiting for the next lease."""
FLUSH_SECONDS = 0.1
"""Reports wait at most this long for a lease to carry them (then they go on their own)."""


class SharedEndpoint:
    """One endpoint's permits in this worker, leased from the broker in small batches."""

    def __init__(self, call: LeaseCall, worker: str, endpoint: str) -> None:
        self._call = call
        self.worker = worker
        self.endpoint = endpoint
        self.broken = False
        """True once the broker could not be reached: the limiter paces on its own share."""
        self.paused_until = 0.0
        self.leases = 0
        """Lease round trips made (for tests and benchmarks)."""
        self._due: deque[float] = deque()  # when each permit in hand may go
        self._each = 0  # tokens each of them was charged
        self._ttl = 0.0  # seconds after its time a permit in hand is void
        self._next: tuple[int, int] | None = None  # the mark of the last permit used
        self._returned = [0, 0, 0]
        self._reports: list[list[Any]] = []
        self._corrections: list[list[int]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._clock: Callable[[], float] = time.monotonic
        self._timer: asyncio.TimerHandle | None = None
        self._batch = 1  # permits a lease asks for at least: grows while all get used

    async def take(
        self,
        tokens: int,
        want: int,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[object]],
    ) -> tuple[int, tuple[int, int] | None]:
        """Wait for one permit for a request of about `tokens` tokens, `want` being the callers
        waiting here (a lease asks for that many). Returns the tokens it was charged and its mark
        (None: nothing counted), or raises `ConnectionError` when the broker is out of reach."""
        self._clock = clock
        while True:
            now = clock()
            if now < self.paused_until:
                await sleep(self.paused_until - now)
                continue
            due = self._due
            if due and (now > due[0] + self._ttl or tokens > self._each * 1.5 + 16):
                self._give_back()  # stale, or charged for much smaller requests: ask afresh
            if not self._due:
                reply = await self._lease(max(want, self._batch), tokens)
                now = clock()
                if reply["pause"] > 0.0:
                    self.paused_until = max(self.paused_until, now + reply["pause"])
                self._due = deque(now + wait for wait in reply["due"])
                self._each, self._ttl = int(reply["tokens"]), float(reply["ttl"])
                mark = reply["mark"]
                self._next = None if mark is None else (int(mark[0]), int(mark[1]))
                continue
            at = self._due.popleft()
            if not self._due:  # all used: a busy worker asks for more at a time
                self._batch = min(MAX_LEASE, self._batch * 2)
            mark = None
            if self._next is not None:
                mark = self._next = (self._next[0] + 1, self._next[1] + self._each)
            if at > now:
                await sleep(at - now)
                if clock() < self.paused_until:  # a 429 meanwhile: this permit is void
                    self._returned[0] += mark is not None
                    continue
            return (self._each if mark is not None else tokens), mark

    def _give_back(self, void: bool = False) -> None:
        """Hand the permits in hand back (`void`: a 429 emptied the buckets, they count as
        neither used nor refilled)."""
        if self._due and self._next is not None:
            self._returned[0] += len(self._due)
            if not void:
                self._returned[1] += len(self._due) * self._each
                self._returned[2] += len(self._due)
                self._batch = max(1, self._batch // 2)  # more than it needed
        self._due.clear()

    async def _lease(self, want: int, tokens: int) -> dict[str, Any]:
        message = {
            "worker": self.worker,
            "endpoint": self.endpoint,
            "want": want,
            "tokens": tokens,
            "returned": self._returned,
            "reports": self._reports,
            "corrections": self._corrections,
        }
        self._returned, self._reports, self._corrections = [0, 0, 0], [], []
        if self._timer is not None:  # this message carries them
            self._timer.cancel()
            self._timer = None
        self.leases += 1
        try:
            return await self._call(message)
        except Exception as err:
            if not self.broken:
                log.warning(
                    "the map's shared rate limits are out of reach (%s: %s); this worker paces "
                    "at its own share of the limits from now on",
                    type(err).__name__,
                    err,
                )
            self.broken = True
            raise ConnectionError("the shared rate limits are out of reach") from err

    def report(
        self,
        age: float,
        mark: tuple[int, int] | None,
        headers: Mapping[str, str],
        refused: bool,
        now: float,
        retry_after: float | None,
    ) -> None:
        """Keep what one reply taught for the next lease; a 429 goes at once and pauses here."""
        self._reports.append([age, mark, rate_headers(headers), refused])
        if refused:
            self._give_back(void=True)  # the buckets are empty: permits in hand would meet 429s
            if retry_after is not None:
                self.paused_until = max(self.paused_until, now + retry_after)
        if refused or len(self._reports) >= _FLUSH_REPORTS:
            self._flush()
        elif self._timer is None:  # a worker that went quiet still tells what came back
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(FLUSH_SECONDS, self._flush)

    def correct(self, estimated: int, actual: int) -> None:
        """The server reported `actual` tokens for a request charged as `estimated`."""
        if actual != estimated:
            self._corrections.append([estimated, actual])

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._due and self._due[0] < self._clock() - FLUSH_SECONDS:
            self._give_back()  # nobody took them when due: this worker went quiet
        if self.broken or not (self._reports or self._corrections or any(self._returned)):
            return
        task = asyncio.get_running_loop().create_task(self._send_reports())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_reports(self) -> None:
        try:
            reply = await self._lease(0, 0)
        except ConnectionError:
            return
        if reply["pause"] > 0.0:
            self.paused_until = max(self.paused_until, self._clock() + reply["pause"])

    def pause(self, seconds: float) -> None:
        """Another worker met a 429: send nothing for `seconds`, drop the permits in hand."""
        self._give_back(void=True)
        self.paused_until = max(self.paused_until, self._clock() + seconds)


class _Hub:
    def __init__(self, call: LeaseCall, worker: str) -> None:
        self.call = call
        self.worker = worker
        self.endpoints: dict[str, SharedEndpoint] = {}


_hub: _Hub | None = None


def install_shared_limits(call: LeaseCall, worker: str) -> None:
    """Make every learning limiter of this process lease from the map's broker via `call`."""
    global _hub
    _hub = _Hub(call, worker)


def uninstall_shared_limits() -> None:
    """Back to each limiter learning on its own (limiters made before keep their endpoint)."""
    global _hub
    _hub = None


def shared_endpoint(endpoint: str) -> SharedEndpoint | None:
    """This process's shared permits for `endpoint` (None: no broker installed)."""
    hub = _hub
    if hub is None:
        return None
    shared = hub.endpoints.get(endpoint)
    if shared is None or shared.broken:
        shared = hub.endpoints[endpoint] = SharedEndpoint(hub.call, hub.worker, endpoint)
    return shared


def pause_shared(endpoint: str, seconds: float) -> None:
    """The broker says a 429 paused `endpoint` for `seconds` (pushed by the process pool)."""
    hub = _hub
    shared = hub.endpoints.get(endpoint) if hub is not None else None
    if shared is not None:
        shared.pause(seconds)
