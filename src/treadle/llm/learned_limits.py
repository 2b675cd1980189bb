"""Rate limits learned from an endpoint's replies: the `x-ratelimit-*` headers and its 429s.

Providers report, on every reply, `x-ratelimit-limit-requests` (the bucket's size),
`x-ratelimit-remaining-requests` (what is left) and `x-ratelimit-reset-requests` (the time until it
is full again, e.g. `"20ms"`, `"1.5s"`, `"6m0s"`), and the same for `-tokens`. OpenAI documents the
reset as "the time until the rate limit resets to its initial state": a bucket refilling
continuously, so its refill rate is `(limit - remaining) / reset`. This module keeps, per resource,
a mirror of that bucket (size, rate, current level) that `EndpointLimiter` draws from before each
request: the level is pulled down to what the server reports, so traffic the mirror did not see
(other processes on the same key) is accounted for, and it never refills above the bucket's size
less the requests that may still be on their way (a full server bucket does not fill further while
a burst is in transit). A 429 empties the mirror and slows the learned rate a little (recovering
as replies show room again). Pure arithmetic on the caller's clock.

Endpoints that report less are paced too. With only `x-ratelimit-remaining-*` (no limit, no reset)
the bucket's size is taken as the most ever seen remaining, the mirror follows the reported level,
and the refill rate is measured between replies (what the level gained plus what was sent in
between, over the time between). With only 429s and `Retry-After` (no headers at all), requests are
paced evenly at a rate that starts from the pause, creeps up by `PROBE_STEP` a reply, and falls to
`PROBE_BACKOFF` of the throughput measured since the previous 429 at each new one.

`share` (0-1] is this process's part of the endpoint: workers of the process and Ray backends pace
at 1/N when the map's shared broker (`limit_broker`) cannot be reached.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LearnedBucket", "LearnedLimits", "parse_duration"]

FALLBACK_WINDOW_SECONDS = 60.0
"""Refill period assumed until a reset time showed the rate ("per minute", as providers mean)."""
PENALTY_STEP = 0.9
"""A 429 the mirror did not foresee multiplies the paced rate by this."""
PENALTY_FLOOR = 0.25
"""The paced rate never drops below this part of the learned one."""
PENALTY_RECOVERY = 0.002
"""Each reply that shows room left gives back this much of the rate."""
MEASURE_SPAN = 0.1
"""Seconds between two `remaining`-only replies before a refill rate is measured from them."""
MEASURE_MARGIN = 0.9
"""A measured refill rate is paced at this part of what was measured."""
PROBE_STEP = 1.001
"""Without headers, each answered request raises the paced rate by this factor."""
PROBE_FORGET = 60.0
"""Without headers, seconds without a 429 after which requests are no longer paced."""
PROBE_BACKOFF = 0.9
"""Without headers, a 429 sets the paced rate to this part of the throughput since the last one."""

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|us|µs|ns|h|m|s)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_duration(text: str) -> float | None:
    """Seconds of a reset time: `"20ms"`, `"1s"`, `"6m0s"`, `"1h2m3.5s"` or a bare number of
    seconds; None when it is not one of those."""
    text = text.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        pos, total = 0, 0.0
        for match in _DURATION.finditer(text):
            if match.start() != pos:
                return None
            total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
            pos = match.end()
        return total if pos == len(text) and pos > 0 else None
    return value if math.isfinite(value) and value >= 0 else None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(float(text.strip()))
    except (ValueError, OverflowError):
        return None
    return value if value >= 0 else None


class LearnedBucket:
    """The mirror of one of the server's buckets (requests or tokens), scaled by `share`."""

    __slots__ = ("anchor", "deficit_seen", "held", "learned_rate", "level", "limit", "measured",
                 "rate", "share", "stamp")  # fmt: skip

    def __init__(self, share: float, now: float) -> None:
        self.share = share
        self.limit = 0.0
        """This process's part of the bucket's size."""
        self.learned_rate = 0.0
        """This process's part of the refill rate the headers showed, per second."""
        self.rate = 0.0
        """The refill rate paced at: `learned_rate` times the limiter's penalty."""
        self.level = 0.0
        self.stamp = now
        self.deficit_seen = 0
        """The largest `limit - remaining` a rate was computed from (the most precise one)."""
        self.held = 0.0
        """What this process has in flight: maybe not at the server yet."""
        self.measured = False
        """True when the server sends no reset: the rate is measured, the level followed."""
        self.anchor: tuple[float, float, float] | None = None
        """(arrival, remaining, mark) of the reply the next rate is measured from."""

    def refill(self, now: float) -> None:
        """Add what the refill rate gave since the last look.

        Never above the bucket's size less what is in flight: a server bucket that is full
        while requests are still on their way does not fill further, so that refill is lost.
        """
        if now > self.stamp:
            self.level = min(self.limit - self.held, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def observe(
        self,
        limit: int,
        remaining: int,
        reset: float | None,
        now: float,
        *,
        age: float = 0.0,
        since: float = 0.0,
    ) -> None:
        """Take in one reply's `limit`, `remaining` and `reset` (seconds; None when absent).

        The server counted `remaining` when the request arrived, at most `age` seconds ago;
        `since` is what this process has taken from the mirror after that request.
        """
        self.refill(now)
        share = self.share
        if limit * share != self.limit:  # a new or changed limit: learn the rate afresh
            self.limit, self.deficit_seen = limit * share, 0
            if self.learned_rate == 0.0:
                self.level = remaining * share
                self.learned_rate = self.rate = limit * share / FALLBACK_WINDOW_SECONDS
        deficit = limit - remaining
        if reset is not None and reset > 0 and deficit > 0 and deficit >= self.deficit_seen:
            scale = self.rate / self.learned_rate
            self.learned_rate = deficit / reset * share
            self.rate = self.learned_rate * scale
            self.deficit_seen = deficit
        # Never above what the server can have left now: what it had when this request
        # arrived (at the earliest when it was admitted, `age` ago), plus the refill since,
        # less what was sent after it. That catches traffic the mirror did not see (other
        # processes on the same key); the mirror's own bookkeeping keeps it below the server.
        server = remaining * share + age * self.learned_rate - since
        # With a measured rate the mirror follows the server up too: a rate measured too low
        # would otherwise keep the level (and the next measurement) low for good.
        self.level = (
            min(server, self.limit - self.held) if self.measured else min(self.level, server)
        )

    def measure(self, remaining: int, arrived: float, mark: float) -> None:
        """Refill rate from two replies without a reset: what the server's level gained plus what
        was sent in between (`mark` counts what was sent), over the time between arrivals."""
        anchor = self.anchor
        if anchor is None or arrived - anchor[0] < MEASURE_SPAN or mark <= anchor[2]:
            if anchor is None or mark < anchor[2]:
                self.anchor = (arrived, remaining, mark)
            return
        gained = remaining - anchor[1] + (mark - anchor[2])
        self.anchor = (arrived, remaining, mark)
        if gained <= 0:
            return
        # Paced a little below the measurement: a request's arrival is taken as its admission,
        # and one held up on its way makes the refill look faster than it is.
        measured = gained / (arrived - anchor[0]) * self.share * MEASURE_MARGIN
        if remaining >= self.limit / self.share - 1:  # it may have been full: at least that much
            measured = max(measured, self.learned_rate)
        scale = self.rate / self.learned_rate if self.learned_rate > 0 else 1.0
        self.learned_rate = measured
        self.rate = measured * scale

    def wait(self, need: float, now: float) -> float:
        """Seconds until `need` units are available (0.0: now)."""
        self.refill(now)
        need = min(need, self.limit)  # a request larger than the bucket waits for a full one
        if self.level >= need - 1e-9:  # (rounding must not leave a wait too small to pass)
            return 0.0
        return (need - self.level) / self.rate if self.rate > 0 else FALLBACK_WINDOW_SECONDS


@dataclass(slots=True)
class _Probing:
    """Pacing an endpoint that sends no rate headers, since its latest 429."""

    since: float
    """When the pause of that 429 ended."""
    bucket: LearnedBucket
    rate: float
    """The rate paced at right after that 429."""
    slow_start: bool
    ok: int = 0
    """Requests answered (not refused) since."""


class LearnedLimits:
    """What one endpoint's replies taught: request and token buckets, and pauses after 429s.

    `taken_requests` / `taken_tokens` count what was admitted so far: a reply's headers are as old
    as its request, so the limiter passes the counts at admission to `observe`.
    """

    __slots__ = ("paused_until", "penalty", "probing", "requests", "share", "taken_requests",
                 "taken_tokens", "tokens", "unseen_tokens", "usage_seen")  # fmt: skip

    def __init__(self, share: float = 1.0) -> None:
        if not (0.0 < share <= 1.0):
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        self.share = share
        self.requests: LearnedBucket | None = None
        self.tokens: LearnedBucket | None = None
        self.paused_until = 0.0
        self.penalty = 1.0
        """The part of the learned rates paced at (lowered by unforeseen 429s)."""
        self.taken_requests = 0
        self.taken_tokens = 0
        self.unseen_tokens = 0.0
        """Average tokens a request is charged beyond its estimate (its reply): added up front."""
        self.usage_seen = False
        """True once a reply's usage corrected an estimate (`unseen_tokens` is measured)."""
        self.probing: _Probing | None = None
        """Without rate headers, after a 429: (when, taken_requests, the paced bucket)."""

    @property
    def known(self) -> bool:
        """True once a reply carried rate-limit headers."""
        return self.requests is not None or self.tokens is not None

    def observe(
        self,
        headers: Mapping[str, str],
        now: float,
        *,
        sent: float | None = None,
        mark: tuple[int, int] | None = None,
    ) -> bool:
        """Learn from one reply's headers; False when it carried none (the usual, cheap case).

        `sent` is when its request was admitted (None: unknown, so no refill is credited since)
        and `mark` the `(taken_requests, taken_tokens)` counts just after it: what was taken
        since is not in the reply's `remaining` yet. None treats the reply as current; `(0, 0)`
        is a request sent before anything was counted (the first wave): all of it came after.
        """
        got = False
        age = 0.0 if sent is None else max(0.0, now - sent)
        for kind in ("requests", "tokens"):
            remaining = _int(headers.get(f"x-ratelimit-remaining-{kind}"))
            if remaining is None:
                continue
            raw_limit = headers.get(f"x-ratelimit-limit-{kind}")
            limit = _int(raw_limit)
            raw_reset = headers.get(f"x-ratelimit-reset-{kind}")
            reset = parse_duration(raw_reset) if raw_reset is not None else None
            bucket = self.requests if kind == "requests" else self.tokens
            if raw_limit is None and raw_reset is None:  # `remaining` only: size it, measure
                if bucket is not None and bucket.measured:
                    limit = max(round(bucket.limit / self.share), remaining + 1)
                elif bucket is None and remaining > 0:
                    limit = remaining + 1
            if limit is None or limit == 0:
                continue
            got = True
            if bucket is None:
                bucket = LearnedBucket(self.share, now)
                bucket.measured = raw_limit is None and raw_reset is None
                if kind == "requests":
                    self.requests = bucket
                else:
                    self.tokens = bucket
            taken = self.taken_requests if kind == "requests" else self.taken_tokens
            since = taken - mark[0 if kind == "requests" else 1] if mark is not None else 0
            if bucket.measured and sent is not None and mark is not None:
                bucket.measure(remaining, sent, mark[0 if kind == "requests" else 1])
            bucket.observe(limit, min(remaining, limit), reset, now, age=age, since=max(since, 0))
            if remaining > 0 and self.penalty < 1.0:
                self._scale(min(1.0, self.penalty + PENALTY_RECOVERY))
        return got

    def _scale(self, penalty: float) -> None:
        self.penalty = penalty
        for bucket in (self.requests, self.tokens):
            if bucket is not None:
                bucket.rate = bucket.learned_rate * penalty

    def refused(self, retry_after: float | None, now: float, *, sent: float | None = None) -> None:
        """A 429: nobody sends until `retry_after` passed, and the mirror starts from empty.

        An endpoint that never sent rate headers is paced from then on (`probe`); `sent` is when
        the refused request was admitted (None: now).
        """
        if retry_after is not None:
            self.paused_until = max(self.paused_until, now + retry_after)
        if (self.requests is None and self.tokens is None) or self.probing is not None:
            self._probe_refused(retry_after, now if sent is None else sent)
            return
        foreseen = False
        for bucket in (self.requests, self.tokens):
            if bucket is not None:
                bucket.refill(now)
                foreseen = foreseen or bucket.level < 1.0
                bucket.level = min(bucket.level, 0.0)
        if not foreseen and self.known:
            self._scale(max(PENALTY_FLOOR, self.penalty * PENALTY_STEP))

    def _probe_refused(self, retry_after: float | None, now: float) -> None:
        """A 429 from an endpoint without rate headers: pace at what it let through."""
        probing = self.probing
        if probing is None:  # the first: one request per pause (at most 1 s), then slow start
            # `Retry-After: 0` means "now": a pause of 0 (floored at 1 ms), not the 1 s assumed
            # when the header is absent (0 is falsy: `or` would take it for a missing one).
            pause = 1.0 if retry_after is None else retry_after
            rate = 1.0 / min(max(pause, 1e-3), 1.0)
            self.requests = bucket = LearnedBucket(1.0, now)
            bucket.limit = 1.0  # evenly paced: no burst
        elif now < probing.since:  # sent before the last pause ended: the same overload
            return
        else:  # paced too fast: at a little less than what the endpoint let through since
            bucket = probing.bucket
            span = now - probing.since
            measured = probing.ok / span if span > 0 and probing.ok else bucket.learned_rate / 2
            rate = max(PROBE_BACKOFF * min(measured, bucket.learned_rate), 1e-3)
        bucket.learned_rate = bucket.rate = rate
        bucket.level = min(bucket.level, 0.0)
        # Measured from the end of the pause: nothing could be sent before.
        since = max(now, self.paused_until)
        self.probing = _Probing(since, bucket, rate, probing is None)

    def answered(self, now: float) -> None:
        """A request was answered (not refused): without headers, pace a little faster.

        Until the second 429 the rate doubles every second (slow start); then it creeps up by
        `PROBE_STEP` a reply. `PROBE_FORGET` seconds without a 429: back to unpaced.
        """
        probing = self.probing
        if probing is None:
            return
        bucket = probing.bucket
        probing.ok += 1
        if now < probing.since:
            return
        if now - probing.since > PROBE_FORGET:
            self.probing = self.requests = None
            return
        if probing.slow_start:
            rate = probing.rate * 2.0 ** min(now - probing.since, 40.0)
        else:
            rate = bucket.learned_rate * PROBE_STEP
        bucket.learned_rate = bucket.rate = rate

    def wait(self, tokens: int, now: float, *, ahead: int = 0) -> float:
        """Seconds to wait before a request of about `tokens` tokens may go (0.0: now), leaving
        room for `ahead` requests of the same size sent earlier that the server may not have
        counted in any reply seen yet."""
        wait = self.paused_until - now
        if self.requests is not None:
            wait = max(wait, self.requests.wait(1.0 + ahead, now))
        if self.tokens is not None:
            need = (tokens + self.unseen_tokens) * (1 + ahead)
            wait = max(wait, self.tokens.wait(need, now))
        return wait

    def hold(self, in_flight: int) -> None:
        """This process has `in_flight` requests out that may not have reached the server yet."""
        if self.requests is not None and self.probing is None:  # paced evenly: nothing held
            self.requests.held = in_flight
        if self.tokens is not None:
            self.tokens.held = in_flight * self.taken_tokens / max(self.taken_requests, 1)

    def take(self, tokens: int) -> tuple[int, int]:
        """Count one admitted request of about `tokens` tokens; the counts with it."""
        tokens += round(self.unseen_tokens)
        self.taken_requests += 1
        self.taken_tokens += tokens
        mark = (self.taken_requests, self.taken_tokens)
        if self.requests is not None:
            self.requests.level -= 1.0
        if self.tokens is not None:
            self.tokens.level -= tokens
        return mark

    def correct(self, estimated: int, actual: int, *, counted: bool = True) -> None:
        """The server reported `actual` tokens for a request admitted as `estimated`.

        `counted` is False for a request of the first wave, sent before anything was learned:
        it is not in the counts, and only teaches what a request costs beyond its estimate.
        """
        charged = estimated + round(self.unseen_tokens)
        if self.usage_seen:
            self.unseen_tokens += (actual - estimated - self.unseen_tokens) * 0.1
        else:
            # The first report is taken whole: from a prior of 0 the average would need about
            # ten replies to learn a reply's tokens, and until then the first wave's unanswered
            # requests (room left for each at this cost) would be under-counted, enough to be
            # refused once the mirror hands their room out.
            self.unseen_tokens = float(actual - estimated)
            self.usage_seen = True
        if not counted:
            return
        self.taken_tokens += actual - charged
        if self.tokens is not None:
            self.tokens.level -= actual - charged
