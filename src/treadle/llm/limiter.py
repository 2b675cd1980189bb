"""`EndpointLimiter`: a per-endpoint cap on concurrent requests, requests/min and tokens/min.

One limiter is shared by every pass that calls the same endpoint with the same limits (per event
loop: passes share the runtime loop). Waiting callers are admitted first-in first-out. Tokens are
estimated from the request size (`len(body) / 4`) and corrected once the server reports usage.

Without configuration it also learns the endpoint's own limits (`learn=True`, see
`learned_limits`): the first requests to an endpoint go as one wave of at most `first_wave`
(`DEFAULT_FIRST_WAVE`, 16) and the first reply says
whether the endpoint reports rate limits; if it does, every later request waits for room in the
learned buckets, and a 429 pauses every caller for its `Retry-After`. A fan-out to a new endpoint
so starts at once instead of waiting one whole round trip for a lone probe. An endpoint that
reports nothing costs one header lookup per reply after the first. Never blocks the event loop; a
cancelled waiter leaves no trace.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping

from treadle.llm.learned_limits import LearnedLimits
from treadle.llm.provider import DEFAULT_FIRST_WAVE
from treadle.llm.retry import parse_retry_after
from treadle.llm.shared_limits import shared_endpoint

__all__ = ["BYTES_PER_TOKEN", "EndpointLimiter", "Permit", "estimate_tokens"]

BYTES_PER_TOKEN = 4
"""Rough bytes of request JSON per prompt token, for the tokens-per-minute estimate."""
MAX_NAP = 0.25
"""Longest sleep between looks at the learned limits while waiting for room."""
WAVE_GROWTH = 4
"""The first wave grows to this many times `first_wave` once the endpoint stayed silent for
`WAVE_SILENCE` seconds after it: no refusal came back, and a refusal comes back within a round
trip (servers check limits on arrival), while a completion takes the model's time."""
WAVE_SILENCE = 0.05
"""Seconds without any reply after the first wave filled before it grows (see `WAVE_GROWTH`)."""


def estimate_tokens(body: bytes) -> int:
    """A rough token count of a request body (refined later by the server's reported usage)."""
    return len(body) // BYTES_PER_TOKEN + 1


class Permit:
    """One admitted request; give it back with `EndpointLimiter.release`."""

    __slots__ = ("leased", "mark", "probe", "started", "tokens")

    def __init__(
        self,
        started: float,
        tokens: int,
        mark: tuple[int, int] | None = None,
        probe: bool = False,
    ) -> None:
        self.started = started
        self.tokens = tokens
        self.mark = mark
        """The learned limits' admission counts with this request (None: none learned yet)."""
        self.probe = probe
        """True for a request of the first wave to an endpoint, sent before any reply came."""
        self.leased = False
        """True when the permit came from the map's shared limits (`mark` is the broker's)."""


class EndpointLimiter:
    """FIFO admission under up to three caps; `None` disables a cap.

    `window` is the rate window in seconds (60 for "per minute"; tests shrink it). `learn`
    turns on learning the endpoint's limits from its replies (report each reply with `observe`),
    with at most `first_wave` requests out before the first reply (one in a map's worker), paced
    at `share` of them, or, in a backend worker, leased from the map's shared limits for
    `endpoint` (see `shared_limits`). `clock` and `sleep` are injectable so the logic can be
    tested without wall-clock assertions.
    """

    def __init__(
        self,
        max_concurrent: int,
        requests_per_window: int | None = None,
        tokens_per_window: int | None = None,
        *,
        window: float = 60.0,
        learn: bool = False,
        share: float = 1.0,
        first_wave: int = DEFAULT_FIRST_WAVE,
        endpoint: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.max_concurrent = max_concurrent
        self.requests_per_window = requests_per_window
        self.tokens_per_window = tokens_per_window
        self.window = window
        self._clock = clock
        self._sleep = sleep
        self._gate = asyncio.Lock()
        self._freed = asyncio.Event()
        self._active = 0
        self._recent: deque[Permit] = deque()
        self._rated = requests_per_window is not None or tokens_per_window is not None
        self.learned = LearnedLimits(share) if learn else None
        """What the endpoint's replies taught (None when not learning)."""
        self._probing = learn  # until the first reply arrived, at most `first_wave` at a time
        self._probes_out = 0  # first-wave requests out while probing (their replies unseen)
        self._wave_out = 0  # first-wave requests whose reply has not come (counted as unseen)
        self._fast = not self._rated and not learn  # admission needs no clock and no lock
        self._unanswered: list[int] = []  # admission numbers of learned-mode requests in flight
        self._answered = 0  # the latest admission number a reply came back for
        self._shared = shared_endpoint(endpoint) if learn and endpoint is not None else None
        # A map's worker sharing the learned limits probes alone, as before: the driver's
        # mirror leases permits without knowing of other workers' unanswered first requests.
        self._first_wave = 1 if self._shared is not None else max(1, first_wave)
        self._waiting = 0  # callers in the slow path (a shared lease asks for that many)
        self._growth: asyncio.Task[None] | None = None  # the wave's silence watch (once)
        self.peak_active = 0
        """Highest number of requests in flight seen (for tests and metrics)."""

    @property
    def active(self) -> int:
        """Requests admitted and not yet released."""
        return self._active

    def _admit(self, now: float, tokens: int) -> Permit:
        self._active += 1
        if self._active > self.peak_active:
            self.peak_active = self._active
        permit = Permit(now, tokens)
        if self._rated:
            self._recent.append(permit)
        return permit

    async def acquire(self, tokens: int = 0) -> Permit:
        """Wait for a turn (FIFO) under every cap, then count the request in."""
        if self._fast and self._active < self.max_concurrent and not self._gate.locked():
            return self._admit(0.0, tokens)
        self._waiting += 1
        try:
            return await self._acquire_slow(tokens)
        finally:
            self._waiting -= 1

    async def _acquire_slow(self, tokens: int) -> Permit:
        async with self._gate:
            while self._active >= self.max_concurrent or self._probes_out >= self._first_wave:
                if self._probing and self._growth is None and self._first_wave > 1:
                    self._growth = asyncio.ensure_future(self._grow_after_silence())
                self._freed.clear()
                await self._freed.wait()
            if self._rated:
                await self._wait_for_rate(tokens)
            learned = self.learned
            if learned is None or not (learned.known or learned.paused_until > 0.0):
                permit = self._admit(self._clock() if self._rated else 0.0, tokens)
                self._count_probe(permit)
                return permit
            shared = self._shared
            if shared is not None and not shared.broken:
                try:
                    charged, mark = await shared.take(
                        tokens, self._waiting, self._clock, self._sleep
                    )
                except ConnectionError:  # out of reach: on this worker's share from now on
                    pass
                else:
                    permit = self._admit(self._clock(), charged)
                    permit.mark, permit.leased = mark, True
                    self._count_probe(permit)
                    return permit
            # The first wave's unanswered requests may have reached the server after the reply
            # the mirror learned from: leave room for them until their own replies say.
            while (wait := learned.wait(tokens, self._clock(), ahead=self._wave_out)) > 0.0:
                # In naps: a reply may show room sooner (a measured rate, a level that followed
                # the server up) than the wait worked out now.
                await self._sleep(min(wait, MAX_NAP))
            permit = self._admit(self._clock(), tokens)
            permit.mark = mark = learned.take(tokens) if learned.known else None
            if mark is not None:
                self._unanswered.append(mark[0])
                learned.hold(self._unseen())
            if not learned.known:  # only a pause, now over: back to the fast path
                learned.paused_until = 0.0
                self._fast = not self._rated and not self._probing
            self._count_probe(permit)
            return permit

    async def _grow_after_silence(self) -> None:
        """Let the first wave grow once the endpoint stayed silent after it (`WAVE_GROWTH`)."""
        loop = asyncio.get_running_loop()
        while self._probing:
            armed = loop.time()
            await asyncio.sleep(WAVE_SILENCE)
            for _ in range(3):  # replies already read reach `observe` first
                await asyncio.sleep(0)
            if not self._probing:
                return
            if loop.time() - armed > WAVE_SILENCE * 1.5:
                # This loop lags (a starved machine): a reply may be waiting unread, and silence
                # proves nothing. Watch again.
                continue
            self._first_wave *= WAVE_GROWTH
            self._freed.set()
            return

    def _count_probe(self, permit: Permit) -> None:
        if self._probing:
            permit.probe = True
            self._probes_out += 1
            self._wave_out += 1

    def _wave_answered(self, permit: Permit) -> None:
        """`permit` was of the first wave and has its reply (or never will): count it out."""
        permit.probe = False
        self._wave_out -= 1

    def observe(self, permit: Permit, headers: Mapping[str, str], *, refused: bool = False) -> None:
        """Learn from the reply to `permit`'s request (`refused`: it was a 429)."""
        learned = self.learned
        if learned is None:
            return
        if permit.probe:
            self._wave_answered(permit)
        if self._probing:  # the first reply: learning is settled, the others may go
            self._probing = False
            self._probes_out = 0
            if self._growth is not None:  # the silence watch has nothing left to do
                self._growth.cancel()
            self._freed.set()
        if not (learned.known or refused or "x-ratelimit-remaining-requests" in headers
                or "x-ratelimit-remaining-tokens" in headers):  # fmt: skip
            self._fast = not self._rated  # the usual case: the endpoint reports no limits
            return
        now = self._clock()
        mark = permit.mark
        shared = self._shared
        if shared is not None and not shared.broken:  # the broker learns from every reply
            retry_after = parse_retry_after(headers) if refused else None
            age = now - permit.started if permit.leased else 0.0
            shared.report(age, mark if permit.leased else None, headers, refused, now, retry_after)
        sent: float | None = None
        if permit.leased:  # the broker paces; this mirror only stands by (its share)
            mark = None
        elif mark is not None:
            sent = permit.started
            self._answered = max(self._answered, mark[0])
        else:
            # Sent before anything was counted (the first wave): every request counted so far
            # went after it, so none of them is in its reply's `remaining`. Taken as current,
            # its reply would give back room those requests took.
            mark = (0, 0)
        if learned.observe(headers, now, sent=sent, mark=mark):
            self._fast = False
        if refused:
            learned.refused(parse_retry_after(headers), now, sent=permit.started or None)
            self._fast = False
        elif learned.probing is not None:
            learned.answered(now)

    def _unseen(self) -> int:
        """Requests in flight that may not have reached the server: those sent after the latest
        one answered (the earlier ones were, give or take reordering on new connections), and the
        first wave's still unanswered (sent before anything was learned: counted, to be safe)."""
        unanswered = self._unanswered
        return len(unanswered) - bisect.bisect_right(unanswered, self._answered) + self._wave_out

    async def _wait_for_rate(self, tokens: int) -> None:
        recent = self._recent
        while True:
            now = self._clock()
            horizon = now - self.window
            while recent and recent[0].started <= horizon:
                recent.popleft()
            wait = 0.0
            rpw = self.requests_per_window
            if rpw is not None and len(recent) >= rpw:
                wait = recent[len(recent) - rpw].started - horizon
            tpw = self.tokens_per_window
            if tpw is not None and recent:
                used = sum(p.tokens for p in recent)
                # A request larger than the whole quota goes alone once the window is empty.
                if used + tokens > tpw:
                    budget = used + tokens - tpw
                    for permit in recent:
                        budget -= permit.tokens
                        if budget <= 0:
                            wait = max(wait, permit.started - horizon)
                            break
                    else:
                        wait = max(wait, recent[-1].started - horizon)
            if wait <= 0:
                return
            await self._sleep(wait)

    def release(self, permit: Permit, actual_tokens: int | None = None) -> None:
        """Count the request out; `actual_tokens` (reported usage) replaces the estimate."""
        self._active -= 1
        if permit.leased:
            if actual_tokens is not None and self._shared is not None:
                self._shared.correct(permit.tokens, actual_tokens)
        elif permit.mark is not None:
            unanswered = self._unanswered
            at = bisect.bisect_left(unanswered, permit.mark[0])
            if at < len(unanswered) and unanswered[at] == permit.mark[0]:
                del unanswered[at]
            if self.learned is not None:
                self.learned.hold(self._unseen())
        if permit.probe:  # a first-wave request that got no reply
            self._wave_answered(permit)
            if self._probing:  # another may go in its place
                self._probes_out -= 1
        if actual_tokens is not None:
            learned = self.learned
            if learned is not None and learned.known and not permit.leased:
                # A first-wave reply (no mark) teaches the cost too: its siblings still out are
                # counted at that cost while the mirror hands out room.
                learned.correct(permit.tokens, actual_tokens, counted=permit.mark is not None)
            permit.tokens = actual_tokens
        self._freed.set()
