"""The learned limits shared by real process workers, against the fake server's real limits.

Hostile cases: load spread unevenly over 2 and 4 workers, a worker killed while it holds leased
permits, and a storm of 429s. Counts only (429s, leases, what the broker holds); how long the
maps take against the limit-bound ideal is benchmark s7's process row.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from treadle.distributed import AgentSpec, PassOutcome
from treadle.distributed.driver import drive
from treadle.distributed.process import ProcessPool
from treadle.testing import FakeOpenAIServer, Reply
from treadle.testing.fake_replies import ToolCallSpec
from treadle.testing.sample_tools import shouter

LONG_ROUNDS = 10
CONCURRENCY = 8


def _uneven(request: dict[str, Any]) -> Reply:
    """`long ...` passes take LONG_ROUNDS requests, the others one."""
    messages = request.get("messages") or []
    text = str(next((m.get("content") for m in messages if m.get("role") == "user"), ""))
    rounds = sum(1 for m in messages if m.get("role") == "tool")
    if rounds + 1 >= (LONG_ROUNDS if text.startswith("long") else 1):
        return Reply.text("done")
    return Reply(tool_calls=(ToolCallSpec("shout", '{"text": "x"}', id=f"call_{rounds}"),))


def _inputs(long: int, short: int) -> list[str]:
    # The first CONCURRENCY inputs go to the first worker's slots: it gets the long passes.
    return [f"long {i}" for i in range(long)] + [f"short {i}" for i in range(short)]


async def _run(
    server: FakeOpenAIServer, workers: int, inputs: list[str], *, kill_first: bool = False
) -> tuple[ProcessPool, list[PassOutcome]]:
    spec = AgentSpec.from_agent(shouter(server.base_url, max_retries=30))
    pool = ProcessPool(spec.to_json(), size=workers)
    await pool.start()
    outcomes: list[PassOutcome] = []
    try:
        async for outcome in drive(
            pool, inputs, concurrency=CONCURRENCY, max_attempts=3, call_timeout=120
        ):
            outcomes.append(outcome)
            out = pool.broker.out(_endpoint(server))
            if kill_first and out and max(out.values()) > 0:
                kill_first = False
                # The busiest worker, while it has leased permits in hand and in flight.
                busy = max(out, key=lambda name: out[name])
                os.kill(int(busy.rsplit(":", 1)[1]), signal.SIGKILL)
                outcomes.append(PassOutcome(-1, "", "lost", 0, busy))  # marks the kill
    finally:
        await pool.close()
    return pool, outcomes


def _endpoint(server: FakeOpenAIServer) -> str:
    from treadle.llm import Provider

    return " ".join(Provider(model="m", base_url=server.base_url).endpoint_key)


@pytest.mark.parametrize("workers", [2, 4])
async def test_unevenly_loaded_workers_share_the_learned_limit(workers: int) -> None:
    # 20 requests per 0.5 s; one worker has the ten-request passes, the rest finish early.
    with FakeOpenAIServer(
        script=_uneven, latency_ms=20, requests_per_minute=20, rate_window=0.5
    ) as server:
        pool, outcomes = await _run(server, workers, _inputs(CONCURRENCY, 24))
        limits = server.limits
        assert limits is not None
    assert [o.status for o in outcomes] == ["ok"] * (CONCURRENCY + 24)
    sent = limits.admitted + limits.rejected
    assert sent >= CONCURRENCY * LONG_ROUNDS + 24
    # The goal is under 1% answered 429 (benchmark s7 measures it: 0 in its runs); with
    # about 100 requests here, one early permit under a loaded CI machine is 1%, so the unit test
    # allows 3: still far from a storm (the split without learning meets dozens).
    assert limits.rejected <= max(3, sent * 3 // 100)
    learned = pool.broker.learned(_endpoint(server))
    assert learned is not None and learned.requests is not None
    assert learned.requests.limit == 20  # the driver holds the whole limit, not 1/N of it
    # Permits go in batches: no round trip per request. Idle, a lease carries 2-4 permits; the
    # full tier at -n 3 on 2 cores measured 55 leases for 104 requests with 4 workers, so the
    # bound is one lease per 1.5 requests (one a request would be `sent`).
    assert pool.broker.leases < sent * 2 / 3


async def test_a_worker_killed_with_leased_permits_leaks_nothing() -> None:
    with FakeOpenAIServer(
        script=_uneven, latency_ms=20, requests_per_minute=20, rate_window=0.5
    ) as server:
        pool, outcomes = await _run(server, 2, _inputs(CONCURRENCY, 24), kill_first=True)
        limits = server.limits
        assert limits is not None
    killed = next(o.worker for o in outcomes if o.status == "lost")
    done = [o for o in outcomes if o.index >= 0]
    assert sorted(o.index for o in done) == list(range(CONCURRENCY + 24))
    assert {o.status for o in done} == {"ok"}
    assert any(o.attempts > 1 for o in done)  # the killed worker's passes ran again
    out = pool.broker.out(_endpoint(server))
    assert killed not in out  # what it had leased is not held for it
    assert limits.rejected <= (limits.admitted + limits.rejected) // 50


async def test_a_429_storm_pauses_every_worker_and_the_map_completes() -> None:
    storm = {"first": None}

    def refuse(request: dict[str, Any]) -> bool:
        import time

        now = time.monotonic()
        if storm["first"] is None:
            storm["first"] = now
        return now - storm["first"] < 0.5  # everything is refused for half a second

    with FakeOpenAIServer(
        script=_uneven, latency_ms=20, requests_per_minute=40, rate_window=0.5
    ) as server:
        # The storm starts after the workers learned the limits (from the 40th request on).
        rule = server.add_fault(
            Reply.rate_limited(0.2),
            when=lambda r: server.request_count > 40 and refuse(r),
        )
        pool, outcomes = await _run(server, 2, _inputs(4, 60))
    assert {o.status for o in outcomes} == {"ok"}
    assert len(outcomes) == 64
    refused = rule.used + (server.limits.rejected if server.limits else 0)
    assert pool.broker.refusals >= 1
    assert pool.pauses_pushed >= 1  # the first 429 one worker met paused the other at once
    # Measured here: 3-15 429s (28 under heavy CPU load); workers that pause only on their own
    # 429s met 20-30, without learning 38-51. The bound is loose on purpose (no timing in unit
    # tests): it catches a storm of retries, the pushed pause above is what is under test.
    assert refused < 60
