"""EndpointLimiter: FIFO admission under concurrency, request-rate and token-rate caps."""

from __future__ import annotations

import asyncio

from pydantic_core import to_json

from clock_helpers import VirtualClock
from treadle.llm import EndpointLimiter, Provider, build_request_body, get_client
from treadle.testing import FakeOpenAIServer


async def test_concurrency_cap_holds_for_500_callers_over_http() -> None:
    with FakeOpenAIServer("echo", latency_ms=2) as server:
        provider = Provider(model="m", base_url=server.base_url, max_concurrent_requests=7)
        client = get_client(provider)
        body = build_request_body(
            provider, [to_json({"role": "user", "content": "x"})], stream=False
        )
        results = await asyncio.gather(*(client.complete(provider, body) for _ in range(500)))
        assert len(results) == 500
        assert server.max_in_flight <= 7
        assert client.limiter(provider).peak_active == 7
        assert client.limiter(provider).active == 0


async def test_requests_per_window_and_fifo_order() -> None:
    clock = VirtualClock()
    limiter = EndpointLimiter(
        100, requests_per_window=5, window=10.0, clock=clock, sleep=clock.sleep
    )
    admitted: list[tuple[int, float]] = []

    async def call(i: int) -> None:
        permit = await limiter.acquire()
        admitted.append((i, clock()))
        await asyncio.sleep(0)
        limiter.release(permit)

    await asyncio.gather(*(call(i) for i in range(23)))
    assert [i for i, _ in admitted] == list(range(23))  # first come, first served
    times = [t for _, t in admitted]
    for i in range(len(times) - 5):
        assert times[i + 5] - times[i] >= 10.0  # never more than 5 starts in any window
    assert times[-1] - times[0] < 50.0  # and no needless waiting: 4 full windows


async def test_tokens_per_window_uses_estimates_then_reported_usage() -> None:
    clock = VirtualClock()
    limiter = EndpointLimiter(
        100, tokens_per_window=1000, window=60.0, clock=clock, sleep=clock.sleep
    )
    first = await limiter.acquire(600)
    limiter.release(first, actual_tokens=100)  # the server said the estimate was too high
    second = await limiter.acquire(600)
    assert clock() == 1000.0  # 100 + 600 fits: no wait
    limiter.release(second)
    third = await limiter.acquire(600)  # 700 + 600 does not fit until `first` leaves the window
    assert clock() == 1060.0
    limiter.release(third)
    huge = await limiter.acquire(5000)  # larger than the quota: admitted alone once it is empty
    assert clock() == 1120.0
    limiter.release(huge)


async def test_concurrency_waiters_are_fifo_and_cancellation_is_clean() -> None:
    limiter = EndpointLimiter(1)
    held = await limiter.acquire()
    order: list[int] = []

    async def call(i: int) -> None:
        permit = await limiter.acquire()
        order.append(i)
        limiter.release(permit)

    tasks = [asyncio.create_task(call(i)) for i in range(5)]
    await asyncio.sleep(0.01)
    tasks[2].cancel()
    limiter.release(held)
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 1, 3, 4] and limiter.active == 0


async def test_one_limiter_per_endpoint_and_limits() -> None:
    provider = Provider(model="m", base_url="http://127.0.0.1:1/v1", requests_per_minute=60)
    client = get_client(provider)
    same = provider.replace(temperature=0.3)
    assert client.limiter(provider) is client.limiter(same)
    assert client.limiter(provider.replace(requests_per_minute=30)) is not client.limiter(provider)
    assert client.limiter(provider).requests_per_window == 60
