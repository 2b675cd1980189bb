"""`RateLimits`: the fake server's requests and tokens per window, enforced as providers do.

Two token buckets (requests and tokens) that start full and refill continuously at
`limit / window` per second, the behaviour OpenAI documents ("the time until the rate limit resets
to its initial state"). Every chat reply carries the `x-ratelimit-*` headers providers send; a
request over either limit is answered 429 with `Retry-After` and `retry-after-ms`. `window` is 60
for per-minute limits; benchmarks and tests shrink it (a time-scaled minute) and the reported reset
times shrink with it. `headers` picks what the replies tell, as some providers tell less: `"full"`
(limit, remaining and reset), `"remaining"` (only `x-ratelimit-remaining-*`) or `"none"` (no rate
headers at all: only the 429s' `Retry-After`). Pure arithmetic on a clock the caller passes in:
nothing here sleeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["RATE_HEADER_MODES", "RateHeaders", "RateLimits", "format_duration"]

RateHeaders = Literal["full", "remaining", "none"]
"""What the replies tell about the limits (see the module docstring)."""
RATE_HEADER_MODES = ("full", "remaining", "none")


def format_duration(seconds: float) -> str:
    """A reset time as providers write it: `"20ms"`, `"1.5s"`, `"6m0s"`, `"1h2m3s"`."""
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    hours, rest = divmod(seconds, 3600.0)
    minutes, secs = divmod(rest, 60.0)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{text}"
    if minutes >= 1:
        return f"{int(minutes)}m{text}"
    return text


@dataclass(slots=True)
class _Bucket:
    limit: int
    rate: float  # units per second
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(float(self.limit), self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def headers(self, kind: str) -> list[tuple[str, str]]:
        remaining = max(0, math.floor(self.level))
        reset = (self.limit - self.level) / self.rate
        return [
            (f"x-ratelimit-limit-{kind}", str(self.limit)),
            (f"x-ratelimit-remaining-{kind}", str(remaining)),
            (f"x-ratelimit-reset-{kind}", format_duration(max(reset, 0.0))),
        ]


class RateLimits:
    """Requests and tokens per `window` seconds for one fake endpoint (either may be None)."""

    def __init__(
        self,
        requests: int | None,
        tokens: int | None,
        *,
        window: float = 60.0,
        now: float = 0.0,
        headers: RateHeaders = "full",
    ) -> None:
        if headers not in RATE_HEADER_MODES:
            raise ValueError(f"rate headers must be one of {RATE_HEADER_MODES}, got {headers!r}")
        self.header_mode = headers
        for name, value in (("requests", requests), ("tokens", tokens)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} per window must be a positive integer or None.")
        if not (window > 0 and math.isfinite(window)):
            raise ValueError(f"the rate window must be a positive number of seconds: {window!r}")
        self.window = window
        self._requests = None if requests is None else _Bucket(requests, requests / window,
                                                                float(requests), now)  # fmt: skip
        self._tokens = None if tokens is None else _Bucket(tokens, tokens / window,
                                                            float(tokens), now)  # fmt: skip
        self.rejected = 0
        """Requests answered 429 so far."""
        self.admitted = 0
        """Requests let through so far."""
        self.admitted_tokens = 0
        """Tokens charged for the requests let through."""

    def take(self, tokens: int, now: float) -> tuple[bool, list[tuple[str, str]], float]:
        """Admit one request costing `tokens` at time `now`?

        Returns `(admitted, headers, retry_after)`: the `x-ratelimit-*` headers after the decision
        and, when refused, the seconds until the request would fit (0.0 when admitted).
        """
        wait = 0.0
        buckets = [(b, cost) for b, cost in ((self._requests, 1), (self._tokens, tokens)) if b]
        for bucket, cost in buckets:
            bucket.refill(now)
            need = min(cost, bucket.limit)  # a request larger than the quota waits for a full one
            if bucket.level < need:
                wait = max(wait, (need - bucket.level) / bucket.rate)
        if wait == 0.0:
            for bucket, cost in buckets:
                bucket.level -= cost
            self.admitted += 1
            self.admitted_tokens += tokens
        else:
            self.rejected += 1
        headers: list[tuple[str, str]] = []
        if self._requests is not None:
            headers += self._requests.headers("requests")
        if self._tokens is not None:
            headers += self._tokens.headers("tokens")
        if self.header_mode == "remaining":
            headers = [h for h in headers if h[0].startswith("x-ratelimit-remaining-")]
        elif self.header_mode == "none":
            headers = []
        return wait == 0.0, headers, wait

    def stats(self) -> dict[str, float]:
        """Counts and limits, for `GET /stats` (benchmarks compare runs against the ideal)."""
        out: dict[str, float] = {"window": self.window, "admitted": self.admitted,
                                 "admitted_tokens": self.admitted_tokens,
                                 "rate_limited": self.rejected}  # fmt: skip
        if self._requests is not None:
            out["requests_limit"] = self._requests.limit
        if self._tokens is not None:
            out["tokens_limit"] = self._tokens.limit
        return out

    @staticmethod
    def refusal_headers(wait: float) -> list[tuple[str, str]]:
        """`Retry-After` (whole seconds, rounded up) and the exact `retry-after-ms`."""
        return [
            ("retry-after", str(max(1, math.ceil(wait)))),
            ("retry-after-ms", str(max(1, math.ceil(wait * 1000)))),
        ]
