"""`LimitBroker`: one endpoint's learned limits, leased to the workers of a map in small batches.

The process and Ray backends run a map on N workers, each with its own limiter. Paced at a static
1/N of what they learned, unevenly loaded workers waste the limit (idle ones keep their part) and
a 429 one of them meets does not slow the others. The broker is the one place (the driver process,
or a named Ray actor) that holds the learned buckets at the endpoint's full size: workers send it
what their replies taught (headers, 429s with `Retry-After`, reported token use) and lease
permits from it, a few at a time, so a request costs a round trip only once per batch. A 429
empties the buckets and pauses every lease until its `Retry-After` passed.

Leases are short-lived: a worker gives back what it did not use within `LEASE_TTL` seconds, and a
worker that died (or that nobody heard from for `STALE_SECONDS`) is forgotten with everything it
held, so capacity is never lost for longer than that. Pure bookkeeping on the caller's clock; the
messages are JSON-able dicts, the same over a pipe or a Ray call.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from treadle.llm.learned_limits import LearnedLimits
from treadle.llm.retry import parse_retry_after

__all__ = ["LEASE_SECONDS", "LEASE_TTL", "MAX_LEASE", "STALE_SECONDS", "LimitBroker",
           "rate_headers"]  # fmt: skip

MAX_LEASE = 16
"""Most permits one lease carries."""
LEASE_SECONDS = 0.25
"""A lease carries at most this many seconds of the learned request rate (at least one permit)."""
LEASE_TTL = 1.0
"""Seconds a worker may keep unused leased permits; after that it gives them back."""
STALE_SECONDS = 30.0
"""A worker not heard from for this long is forgotten, with the requests it had out."""


def rate_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers of a reply the broker learns from (rate limits and `Retry-After`)."""
    return {
        name: value
        for name, value in headers.items()
        if name.startswith(("x-ratelimit-", "retry-after"))
    }


@dataclass(slots=True)
class _Worker:
    seen: float
    out: int = 0
    """Permits leased and neither answered nor given back: maybe not at the server yet."""


@dataclass(slots=True)
class _Endpoint:
    learned: LearnedLimits = field(default_factory=LearnedLimits)
    workers: dict[str, _Worker] = field(default_factory=dict)


class LimitBroker:
    """The learned limits of every endpoint a map's workers call, leased out in batches.

    `lease(request)` is the one message: it carries a worker's reports and asks for permits.
    `forget(worker)` drops a dead worker's leases. Not thread-safe: call it from one thread (the
    driver's event loop, or a Ray actor).
    """

    def __init__(self, workers: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.workers = workers
        """Workers of the map: each one not heard from yet may have its probe on the way."""
        self._clock = clock
        self._endpoints: dict[str, _Endpoint] = {}
        self.leases = 0
        """Lease messages handled (the round trips the workers paid)."""
        self.refusals = 0
        """429s the workers reported."""

    def learned(self, endpoint: str) -> LearnedLimits | None:
        """What the broker learned about `endpoint` (None: no worker reported on it yet)."""
        state = self._endpoints.get(endpoint)
        return state.learned if state is not None else None

    def out(self, endpoint: str) -> dict[str, int]:
        """Permits each worker has leased for `endpoint` and not yet answered or given back."""
        state = self._endpoints.get(endpoint)
        return {} if state is None else {name: w.out for name, w in state.workers.items()}

    def forget(self, worker: str) -> None:
        """`worker` is gone: what it held no longer counts as in flight."""
        for state in self._endpoints.values():
            if state.workers.pop(worker, None) is not None:
                self._hold(state)

    def lease(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Take in a worker's reports, then grant up to `want` permits.

        The request: `worker`, `endpoint`, `want` (permits), `tokens` (estimated tokens of each),
        `returned` (`[permits, tokens, refilled]` unused from earlier leases), `reports` (`[age,
        mark, headers, refused]` per reply: seconds since its request went, the `[requests, tokens]`
        mark its permit carried or None, its rate headers, True for a 429) and `corrections`
        (`[estimated, actual]` tokens per answered request). The reply: `granted` permits of
        `tokens` each, numbered after `mark` (None: not counted), permit i to go `due[i]` seconds
        from now and within `ttl` seconds after that; `pause` is the seconds left of a 429's
        pause (0.0: none) and `known` whether the broker learned limits for the endpoint.
        """
        now = self._clock()
        self.leases += 1
        endpoint = str(request["endpoint"])
        state = self._endpoints.get(endpoint)
        if state is None:
            state = self._endpoints[endpoint] = _Endpoint()
        learned = state.learned
        name = str(request["worker"])
        worker = state.workers.get(name)
        if worker is None:
            worker = state.workers[name] = _Worker(now)
        worker.seen = now
        self._take_back(state, worker, request.get("returned"))
        for age, mark, headers, refused in request.get("reports", ()):
            sent = now - max(0.0, float(age))
            if mark is not None:
                learned.observe(headers, now, sent=sent, mark=(int(mark[0]), int(mark[1])))
                worker.out = max(0, worker.out - 1)
            else:
                learned.observe(headers, now)
            if refused:
                self.refusals += 1
                learned.refused(parse_retry_after(headers), now, sent=sent)
            elif learned.probing is not None:
                learned.answered(now)
        for estimated, actual in request.get("corrections", ()):
            if learned.known:
                learned.correct(int(estimated), int(actual))
        for other, record in list(state.workers.items()):
            if now - record.seen > STALE_SECONDS:  # died without a word (e.g. a lost Ray actor)
                del state.workers[other]
        self._hold(state)
        pause = max(0.0, learned.paused_until - now)
        reply: dict[str, Any] = {"granted": 0, "tokens": 0, "mark": None, "due": [],
                                 "ttl": LEASE_TTL, "pause": pause,
                                 "known": learned.known}  # fmt: skip
        want = int(request.get("want", 0))
        if want <= 0:
            return reply
        tokens = max(0, int(request.get("tokens", 0)))
        if not learned.known:  # nothing learned (a pause at most): nothing to count
            wait = learned.wait(tokens, now)
            reply.update(granted=want, due=[wait] * want)
            return reply
        most = MAX_LEASE
        if learned.requests is not None and learned.requests.rate > 0:
            most = min(most, max(1, math.ceil(learned.requests.rate * LEASE_SECONDS)))
        # Permits are reserved ahead: each is due when the buckets (their level already less the
        # ones before it) have room, up to `LEASE_SECONDS` ahead; a paced worker pays one round
        # trip per batch, not one per request.
        mark = [learned.taken_requests, learned.taken_tokens]
        due: list[float] = []
        while len(due) < min(want, most):
            wait = learned.wait(tokens, now)
            if due and wait > LEASE_SECONDS:
                break
            learned.take(tokens)
            due.append(wait)
        worker.out += len(due)
        self._hold(state)
        reply.update(granted=len(due), tokens=tokens, mark=mark, due=due)
        return reply

    def _take_back(self, state: _Endpoint, worker: _Worker, returned: Any) -> None:
        """Unused permits come back to the buckets (never above what they hold when full)."""
        if not returned:
            return
        # [permits no longer out, tokens back, permits back]: void permits (dropped after a 429)
        # are out no more but do not refill the emptied buckets.
        requests, tokens = int(returned[2]), float(returned[1])
        worker.out = max(0, worker.out - int(returned[0]))
        learned = state.learned
        for bucket, amount in ((learned.requests, requests), (learned.tokens, tokens)):
            if bucket is not None and amount > 0:
                bucket.level = min(bucket.limit, bucket.level + amount)

    def _hold(self, state: _Endpoint) -> None:
        unheard = max(0, self.workers - len(state.workers))  # their probes count as in flight
        state.learned.hold(sum(w.out for w in state.workers.values()) + unheard)
