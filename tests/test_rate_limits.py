"""Learned rate limits: header parsing, the pacing mirror, the probe, and the fake server's limits.

Pacing logic runs on a virtual clock (time moves only when the limiter sleeps); the HTTP tests
count the 429s the fake server sent, never how long anything took.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from pydantic_core import to_json

from clock_helpers import VirtualClock
from treadle.errors import ConfigurationError
from treadle.llm import EndpointLimiter, Provider, build_request_body, get_client
from treadle.llm import limiter as endpoint_limiter
from treadle.llm.learned_limits import LearnedLimits, parse_duration
from treadle.llm.limiter import Permit
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_limits import RateLimits, format_duration


def _headers(limit: int, remaining: int, reset: str, kind: str = "requests") -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(limit),
        f"x-ratelimit-remaining-{kind}": str(remaining),
        f"x-ratelimit-reset-{kind}": reset,
    }


# -- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("20ms", 0.02),
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("1h2m3.5s", 3723.5),
        ("17.345s", 17.345),
        ("0.5", 0.5),
        (" 2 ", 2.0),
        ("250us", 0.00025),
    ],
)
def test_reset_durations_parse(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "1x", "s", "1s2", "-1", "inf", "nan", "1 s"])
def test_bad_reset_durations_are_none(text: str) -> None:
    assert parse_duration(text) is None


@pytest.mark.parametrize("seconds", [0.02, 0.0004, 1.0, 1.5, 59.999, 360.0, 3723.5])
def test_fake_server_durations_round_trip(seconds: float) -> None:
    parsed = parse_duration(format_duration(seconds))
    assert parsed is not None
    assert parsed == pytest.approx(seconds, abs=1e-3)


def test_replies_without_headers_teach_nothing() -> None:
    learned = LearnedLimits()
    assert learned.observe({"content-type": "application/json"}, 0.0) is False
    assert not learned.known
    assert learned.wait(100, 0.0) == 0.0


@pytest.mark.parametrize(
    "headers",
    [
        {"x-ratelimit-limit-requests": "abc", "x-ratelimit-remaining-requests": "1"},
        {"x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "-3"},
        {"x-ratelimit-limit-requests": "0", "x-ratelimit-remaining-requests": "0"},
        {"x-ratelimit-remaining-requests": "0"},  # `remaining` only, and no size to infer
    ],
)
def test_malformed_headers_are_ignored(headers: dict[str, str]) -> None:
    learned = LearnedLimits()
    assert learned.observe(headers, 0.0) is False
    assert not learned.known


# -- the mirror ---------------------------------------------------------------------------------


def test_rate_is_learned_from_limit_remaining_and_reset() -> None:
    learned = LearnedLimits()
    # 100 per minute as a continuously refilling bucket: 1 used, full again in 600 ms.
    assert learned.observe(_headers(100, 99, "600ms"), 0.0)
    bucket = learned.requests
    assert bucket is not None
    assert bucket.limit == 100
    assert bucket.rate == pytest.approx(100 / 60)
    for _ in range(99):
        assert learned.wait(1, 0.0) == 0.0
        learned.take(1)
    assert learned.wait(1, 0.0) == pytest.approx(0.6)
    assert learned.wait(1, 0.6) == 0.0


def test_the_most_drained_reply_sets_the_rate() -> None:
    learned = LearnedLimits()
    learned.observe(_headers(1000, 999, "20ms"), 0.0)  # rounded: 1/0.02 = 50/s, really 16.7/s
    learned.observe(_headers(1000, 400, "36s"), 0.1)  # 600 used, 36 s to refill: 16.67/s
    learned.observe(_headers(1000, 990, "1ms"), 0.2)  # a small deficit is less precise: ignored
    assert learned.requests is not None
    assert learned.requests.rate == pytest.approx(1000 / 60)


def test_the_level_follows_the_server_down_counting_requests_in_flight() -> None:
    learned = LearnedLimits()
    learned.observe(_headers(100, 99, "600ms"), 0.0)
    marks = [learned.take(1) for _ in range(10)]  # level 99 -> 89
    # The first of them reached the server when 50 were left (another client used the rest);
    # nine more were sent after it and are not in that count yet.
    learned.observe(_headers(100, 50, "30s"), 0.0, sent=0.0, mark=marks[0])
    assert learned.requests is not None
    assert learned.requests.level == pytest.approx(41)


def test_refill_is_not_counted_for_requests_still_on_their_way() -> None:
    # A server bucket that is full while a burst is still in transit does not fill further.
    learned = LearnedLimits()
    learned.observe(_headers(10, 9, "100ms"), 0.0)  # 10 per second
    for _ in range(9):
        learned.take(1)
    learned.hold(9)
    assert learned.wait(1, 5.0) == 0.0  # five seconds on, only one slot is surely there
    learned.take(1)
    assert learned.wait(1, 5.0) > 0.0
    learned.hold(0)  # the replies came back: the server has seen them all
    assert learned.wait(1, 6.0) == 0.0


def test_tokens_bucket_paces_large_requests() -> None:
    learned = LearnedLimits()
    learned.observe(_headers(1000, 1000, "0s", kind="tokens"), 0.0)
    learned.take(900)
    assert learned.wait(200, 0.0) > 0.0
    assert learned.wait(100, 0.0) == 0.0
    learned.correct(900, 950)  # the server reported more than the estimate
    assert learned.wait(100, 0.0) > 0.0


def test_share_paces_a_worker_at_its_part() -> None:
    learned = LearnedLimits(share=0.25)
    learned.observe(_headers(100, 99, "600ms"), 0.0)
    assert learned.requests is not None
    assert learned.requests.limit == 25
    assert learned.requests.rate == pytest.approx(100 / 60 / 4)
    with pytest.raises(ValueError, match="share"):
        LearnedLimits(share=0)


def test_a_429_pauses_everyone_and_an_unforeseen_one_slows_the_rate() -> None:
    learned = LearnedLimits()
    learned.observe(_headers(100, 99, "600ms"), 0.0)
    learned.refused(2.0, 0.0)  # the mirror had room: someone else uses the key
    assert learned.wait(1, 0.0) == pytest.approx(2.0)
    assert learned.penalty == pytest.approx(0.9)
    assert learned.requests is not None
    assert learned.requests.rate == pytest.approx(100 / 60 * 0.9)
    for _ in range(100):
        learned.observe(_headers(100, 50, "30s"), 3.0)
    assert learned.penalty == pytest.approx(1.0)


def test_a_429_with_retry_after_0_paces_from_a_millisecond_not_a_second() -> None:
    # `Retry-After: 0` is "retry now": it used to be read as a missing header (a 1 s pace), so a
    # test's two 429s cost seconds. No header still paces at one request a second.
    for retry_after, first_wait in ((0.0, 1e-3), (None, 1.0), (0.25, 0.25)):
        learned = LearnedLimits()
        learned.refused(retry_after, 10.0)
        assert learned.wait(1, 10.0) == pytest.approx(first_wait), retry_after
    learned = LearnedLimits()
    learned.refused(0.0, 10.0)
    learned.refused(0.0, 10.0005)  # a second 429 at once: slower, still far below a second
    assert 0.0 < learned.wait(1, 10.0005) < 0.01


# -- the limiter --------------------------------------------------------------------------------


async def test_a_first_wave_of_one_probes_alone_then_the_rest_are_paced() -> None:
    clock = VirtualClock()
    limiter = EndpointLimiter(100, learn=True, first_wave=1, clock=clock, sleep=clock.sleep)
    probe = await limiter.acquire(10)
    assert probe.probe
    waiting = asyncio.ensure_future(limiter.acquire(10))
    await asyncio.sleep(0)
    assert not waiting.done()  # nobody else goes before the probe's reply
    limiter.observe(probe, _headers(3, 2, "20s"))
    limiter.release(probe)
    second = await waiting
    assert not second.probe
    third = await limiter.acquire(10)
    started = clock.now
    fourth = await limiter.acquire(10)  # the bucket of 3 is empty: one refill step
    assert clock.now - started == pytest.approx(20.0)
    for permit in (second, third, fourth):
        limiter.release(permit)


async def test_the_first_wave_goes_at_once_and_the_rest_wait_for_the_first_reply() -> None:
    clock = VirtualClock()
    limiter = EndpointLimiter(100, learn=True, first_wave=16, clock=clock, sleep=clock.sleep)
    wave = [await limiter.acquire(10) for _ in range(16)]
    assert all(p.probe for p in wave) and limiter.active == 16
    waiting = asyncio.ensure_future(limiter.acquire(10))
    await asyncio.sleep(0)
    assert not waiting.done()  # the 17th waits for a reply that says what the limits are
    limiter.observe(wave[0], _headers(100, 80, "60s"))
    limiter.release(wave[0])
    after = await asyncio.wait_for(waiting, 10)
    assert not after.probe and after.mark is not None
    # The wave's other 15 are still unanswered: the mirror counts them as possibly unseen by the
    # server, so the learned bucket does not hand out their room twice.
    assert limiter.learned is not None and limiter.learned.requests is not None
    assert limiter.learned.requests.held == 16
    for permit in wave[1:]:
        limiter.observe(permit, _headers(100, 79, "60s"))
        limiter.release(permit)
    limiter.release(after)
    assert limiter.active == 0 and limiter._wave_out == 0


async def test_the_first_waves_replies_leave_room_for_what_its_requests_cost() -> None:
    # 400 tokens per 0.5 s. Each request is estimated at 17 tokens from its body and charged 19
    # (its reply's tokens too). The wave of 16 leaves the server 400 - 16 x 19 = 96: five more
    # fit at once. Seen on a loaded machine: the 15 replies still out were counted at 17 each,
    # and each later reply of the wave gave back room the requests sent after it had taken, so
    # seven went at once and two were refused.
    clock = VirtualClock()
    server = RateLimits(None, 400, window=0.5, now=clock.now)
    replies: list[tuple[Permit, dict[str, str]]] = []

    def answer_one() -> None:
        permit, headers = replies.pop(0)
        limiter.observe(permit, headers)
        limiter.release(permit, 19)

    async def sleep(seconds: float) -> None:  # while time passes, the rest of the wave answers
        while replies:
            answer_one()
        await clock.sleep(seconds)

    limiter = EndpointLimiter(100, learn=True, first_wave=16, clock=clock, sleep=sleep)
    for _ in range(16):
        permit = await limiter.acquire(17)
        admitted, headers, _ = server.take(19, clock.now)
        assert admitted
        replies.append((permit, dict(headers)))
    answer_one()
    sent_at_once = 0
    for _ in range(6):  # (later ones meet the refill's rounding: the mirror paces at 800/s too)
        permit = await limiter.acquire(17)
        assert permit.mark is not None
        sent_at_once += clock.now == 1000.0
        admitted, _, _ = server.take(19, clock.now)
        assert admitted, f"refused {clock.now - 1000.0:.4f} s in, {sent_at_once} sent at once"
        if replies:  # the wave's replies keep coming in between
            answer_one()
    assert sent_at_once == 5
    assert server.rejected == 0


async def test_a_probe_without_reply_hands_probing_on() -> None:
    limiter = EndpointLimiter(100, learn=True, first_wave=1)
    probe = await limiter.acquire()
    waiting = asyncio.ensure_future(limiter.acquire())
    await asyncio.sleep(0)
    limiter.release(probe)  # a transport error: no headers seen
    nxt = await asyncio.wait_for(waiting, 10)
    assert nxt.probe
    limiter.observe(nxt, {})
    limiter.release(nxt)
    free = await limiter.acquire()  # an endpoint without limits: the fast path again
    assert not free.probe
    limiter.release(free)


async def test_a_429_without_headers_pauses_paces_then_returns_to_the_fast_path() -> None:
    clock = VirtualClock()
    limiter = EndpointLimiter(100, learn=True, first_wave=1, clock=clock, sleep=clock.sleep)
    probe = await limiter.acquire()
    limiter.observe(probe, {"retry-after": "3"}, refused=True)
    limiter.release(probe)
    started = clock.now
    permit = await limiter.acquire()
    assert clock.now - started == pytest.approx(3.0)
    # From then on evenly paced (no burst to storm the endpoint again), a little faster with
    # every answer.
    waits = []
    for _ in range(5):
        limiter.observe(permit, {})
        limiter.release(permit)
        started = clock.now
        permit = await limiter.acquire()
        waits.append(clock.now - started)
    assert all(w > 0 for w in waits)
    assert waits == sorted(waits, reverse=True)
    clock.now += 61.0  # a minute without a 429: the endpoint was only busy for a while
    limiter.observe(permit, {})
    limiter.release(permit)
    permit = await limiter.acquire()
    limiter.observe(permit, {})
    limiter.release(permit)
    assert limiter._fast


# -- the fake server and end to end ------------------------------------------------------------


def test_fake_limits_enforce_requests_and_tokens() -> None:
    limits = RateLimits(10, 1000, window=1.0, now=0.0)
    for _ in range(10):
        admitted, headers, _ = limits.take(50, 0.0)
        assert admitted
    admitted, headers, wait = limits.take(50, 0.0)
    assert not admitted
    assert wait == pytest.approx(0.1)
    assert dict(headers)["x-ratelimit-remaining-requests"] == "0"
    assert dict(headers)["x-ratelimit-remaining-tokens"] == "500"
    assert limits.rejected == 1
    admitted, headers, _ = limits.take(700, 0.1)  # a request slot, but 600 tokens, not 700
    assert not admitted
    admitted, headers, _ = limits.take(600, 0.1)
    assert admitted
    assert parse_duration(dict(headers)["x-ratelimit-reset-requests"]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="window"):
        RateLimits(10, None, window=0)
    with pytest.raises(ValueError, match="positive"):
        RateLimits(0, None)


def test_fake_server_answers_429_with_retry_after_and_headers() -> None:
    with FakeOpenAIServer("echo", requests_per_minute=3) as server:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        replies = [httpx.post(server.base_url + "/chat/completions", json=body) for _ in range(4)]
    assert [r.status_code for r in replies] == [200, 200, 200, 429]
    assert replies[0].headers["x-ratelimit-limit-requests"] == "3"
    assert replies[0].headers["x-ratelimit-remaining-requests"] == "2"
    assert int(replies[3].headers["retry-after"]) >= 1
    assert int(replies[3].headers["retry-after-ms"]) > 0
    assert replies[3].json()["error"]["code"] == "rate_limit_exceeded"
    assert server.limits is not None and server.limits.rejected == 1


async def _fan_out(server: FakeOpenAIServer, provider: Provider, n: int) -> int:
    client = get_client(provider)
    body = build_request_body(provider, [to_json({"role": "user", "content": "x"})], stream=False)
    results = await asyncio.gather(
        *(client.complete(provider, body) for _ in range(n)), return_exceptions=True
    )
    return sum(isinstance(r, BaseException) for r in results)


@pytest.fixture
def replies_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first wave stays one wave until the first reply, however late it comes.

    Its growth after `WAVE_SILENCE` (50 ms) of silence is a bet on a slow endpoint; on a loaded
    machine the fake server's thread alone can take longer to answer, the wave grows to 64 and
    that burst, not the learning these tests are about, meets the bucket of 20 (seen: 2-10 429s).
    """
    monkeypatch.setattr(endpoint_limiter, "WAVE_SILENCE", 3600.0)


@pytest.mark.usefixtures("replies_in_time")
async def test_passes_learn_the_limit_and_stay_under_it() -> None:
    # 20 requests per 0.5 s (a time-scaled minute), 80 requests at once, nothing configured.
    with FakeOpenAIServer("echo", requests_per_minute=20, rate_window=0.5) as server:
        provider = Provider(model="m", base_url=server.base_url, max_retries=20)
        assert await _fan_out(server, provider, 80) == 0
        assert server.limits is not None
        assert server.limits.rejected <= 1  # the mirror may round one refill step early


async def test_without_learning_the_same_fan_out_meets_429s() -> None:
    with FakeOpenAIServer("echo", requests_per_minute=20, rate_window=0.5) as server:
        provider = Provider(
            model="m", base_url=server.base_url, max_retries=20, learn_rate_limits=False
        )
        await _fan_out(server, provider, 80)
        assert server.limits is not None
        assert server.limits.rejected > 20


def test_rate_limit_share_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="rate_limit_share"):
        Provider(model="m", rate_limit_share=1.5)


def test_backend_workers_pace_at_their_part_of_learned_limits() -> None:
    from treadle.distributed.spec import AgentSpec

    spec = AgentSpec(model="m", base_url="http://127.0.0.1:9/v1")
    agent = spec.build_agent(share=0.25)
    assert agent.provider.rate_limit_share == 0.25
    assert agent.provider.learn_rate_limits
    assert spec.build_agent().provider.rate_limit_share == 1.0


@pytest.mark.usefixtures("replies_in_time")
async def test_token_limits_are_learned_too() -> None:
    # Only tokens are limited: 400 per 0.5 s, about 20 tokens a request, 60 requests at once.
    with FakeOpenAIServer("echo", tokens_per_minute=400, rate_window=0.5) as server:
        provider = Provider(model="m", base_url=server.base_url, max_retries=20)
        assert await _fan_out(server, provider, 60) == 0
        assert server.limits is not None
        assert server.limits.rejected <= 1


@pytest.mark.usefixtures("replies_in_time")
async def test_streamed_requests_learn_from_their_headers() -> None:
    with FakeOpenAIServer("echo", requests_per_minute=20, rate_window=0.5) as server:
        provider = Provider(model="m", base_url=server.base_url, max_retries=20, stream=True)
        client = get_client(provider)
        body = build_request_body(
            provider, [to_json({"role": "user", "content": "x"})], stream=True
        )

        async def one() -> int:
            return len([chunk async for chunk in client.stream(provider, body)])

        chunks = await asyncio.gather(*(one() for _ in range(60)))
        assert all(chunks)
        assert server.limits is not None
        assert server.limits.rejected <= 1
        learned = client.limiter(provider).learned
        assert learned is not None and learned.known


@pytest.mark.parametrize("wave", [0, -1, 1.5, True, "16"])
def test_first_wave_is_checked(wave: object) -> None:
    with pytest.raises(ConfigurationError, match="first_wave"):
        Provider(model="m", first_wave=wave)  # type: ignore[arg-type]
