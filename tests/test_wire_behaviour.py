"""What the wire does beyond parsing: the free re-send only for a connection the server closed
just as the request was written, the pool timeout, the keep-alive cap, a pool closed under
waiting requests, file-descriptor exhaustion (in a subprocess under a lowered `ulimit -n`), and a
GPUStack-style `error:` line reaching the user as the provider's message."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap

import pytest
from pydantic_core import to_json

from treadle import ConfigurationError, ProviderConnectionError, ProviderError, Session
from treadle._http import pool as pool_module
from treadle._http.errors import DecodeError, PoolClosed, PoolTimeout
from treadle._http.pool import Pool
from treadle._http.protocol import MAX_BODY_BYTES
from treadle._http.reply import Timeouts
from treadle.errors import HostNotFoundError, MalformedResponse, ProviderTimeout
from treadle.llm import Provider, build_request_body, get_client
from treadle.llm.http_errors import error_from_transport
from treadle.llm.retry import is_retryable_error
from treadle.loop import arun_session_loop
from treadle.testing import FakeOpenAIServer, Reply

AGENT = Session.from_agent_prompt("sys")
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
HEADERS = {"content-type": "application/json"}
T = Timeouts(5.0, 5.0, 5.0)


async def _pass(provider: Provider, message: str) -> str:
    out = await arun_session_loop(
        Session.from_user_message(message), AGENT, agent_provider=provider
    )
    return out.final_text or ""


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_the_server_worked_on_is_not_resent_for_free(stream: bool) -> None:
    # The server reads the request, works on it for a while, then drops the connection: it may
    # have done (and billed) the work, so with max_retries=0 it is sent exactly once.
    with FakeOpenAIServer("echo") as server:
        provider = Provider(
            model="m", base_url=server.base_url, api_key="k", max_retries=0, stream=stream
        )
        assert await _pass(provider, "warm") == "warm"  # the next request reuses the connection
        server.reset_stats()
        server.enqueue(Reply.dropped_connection().with_latency(400))
        with pytest.raises(ProviderConnectionError):
            await _pass(provider, "worked on")
        assert server.request_count == 1


async def test_a_drop_after_the_server_worked_is_a_counted_retry_not_a_free_one() -> None:
    # Two drops, each 50 ms after the request (far past the stale window): with max_retries=1
    # the first is the one counted retry, so the second ends it: two sends, not three.
    with FakeOpenAIServer("echo") as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k", max_retries=1,
                            retry_base_delay=0.001)  # fmt: skip
        assert await _pass(provider, "warm") == "warm"
        server.reset_stats()
        server.enqueue(
            Reply.dropped_connection().with_latency(50), Reply.dropped_connection().with_latency(50)
        )
        with pytest.raises(ProviderConnectionError, match="after 1 retry"):
            await _pass(provider, "worked on")
        assert server.request_count == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reply_that_cannot_be_decoded_is_not_retried(stream: bool) -> None:
    # A corrupt (or over-cap) compressed body fails the same way every time: one send, and an
    # error that says so.
    with FakeOpenAIServer("echo") as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k", max_retries=2,
                            retry_base_delay=0.001, stream=stream)  # fmt: skip
        server.enqueue(Reply.raw(b"not gzip at all", headers={"content-encoding": "gzip"}))
        with pytest.raises(MalformedResponse, match="compressed reply is corrupt"):
            await _pass(provider, "hi")
        assert server.request_count == 1


def test_an_over_cap_body_names_the_cap_and_is_not_retried() -> None:
    error = error_from_transport(
        DecodeError(f"The reply body is over {MAX_BODY_BYTES} bytes."), url="http://x/", retries=0
    )
    assert isinstance(error, MalformedResponse) and not is_retryable_error(error)
    assert str(MAX_BODY_BYTES) in str(error)


async def test_the_pool_timeout_is_a_typed_error() -> None:
    with FakeOpenAIServer("echo") as server:
        server.enqueue(Reply.text("q" * 64, chunk_chars=8).stalled(10_000))
        pool = Pool(max_connections=1)
        url = f"{server.base_url}/chat/completions"
        try:
            held = await pool.post_stream(url, BODY, HEADERS, T)  # left open: the pool is full
            with pytest.raises(PoolTimeout, match="pool_timeout"):
                await pool.post(url, BODY, HEADERS, Timeouts(5.0, 5.0, 0.2))
            await held.body.aclose()  # closed early: its connection is closed, room again
            reply = await pool.post(url, BODY, HEADERS, T)
            assert reply.status == 200
        finally:
            await pool.aclose()
    error = error_from_transport(PoolTimeout("full"), url=url, retries=0)
    assert isinstance(error, ProviderTimeout) and "pool_timeout" in error.message


def test_provider_takes_pool_timeout() -> None:
    assert Provider(model="m", pool_timeout=1.5).pool_timeout == 1.5
    with pytest.raises(ConfigurationError, match="pool_timeout"):
        Provider(model="m", pool_timeout=0)


async def test_idle_connections_beyond_the_keepalive_cap_are_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_module, "SURPLUS_IDLE_SECONDS", 0.2)
    with FakeOpenAIServer("echo") as server:
        server.latency_ms = 20
        pool = Pool(max_idle_connections=2)
        url = f"{server.base_url}/chat/completions"
        body = BODY.replace(b',"stream":true', b"")
        try:
            replies = await asyncio.gather(*(pool.post(url, body, HEADERS, T) for _ in range(10)))
            assert all(reply.status == 200 for reply in replies)
            # The burst's surplus waits a moment (requests that paused together come back
            # together), then only the cap's worth stays open.
            assert pool.idle_connections == 10 and pool.open_connections == 10
            await asyncio.sleep(0.5)
            assert pool.idle_connections == 2 and pool.open_connections == 2
        finally:
            await pool.aclose()


async def test_a_burst_that_pauses_reuses_its_connections() -> None:
    """Requests that pause together past the idle cap (passes awaiting a store's group commit)
    and then all go again reuse their connections: none is closed and opened again."""
    with FakeOpenAIServer("echo") as server:
        pool = Pool(max_idle_connections=2)
        url = f"{server.base_url}/chat/completions"
        body = BODY.replace(b',"stream":true', b"")
        try:
            for _ in range(3):
                replies = await asyncio.gather(
                    *(pool.post(url, body, HEADERS, T) for _ in range(20))
                )
                assert all(reply.status == 200 for reply in replies)
                await asyncio.sleep(0.05)  # the pause (a commit) before the next turn
            assert pool.open_connections == 20
            assert server.connections_opened == 20, server.connections_opened
        finally:
            await pool.aclose()


async def test_a_bursts_surplus_is_swept_at_its_own_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sweep that closes a burst's surplus runs once the first surplus connection's time is
    up, never before (it once ran just before and kept that connection two grace periods), and
    every sweep closes what is due, then looks again at the next deadline. No wall time is
    asserted: the deadlines are compared with the loop's own schedule."""
    monkeypatch.setattr(pool_module, "SURPLUS_IDLE_SECONDS", 0.2)
    with FakeOpenAIServer("echo") as server:
        server.latency_ms = 20
        pool = Pool(max_idle_connections=2)
        url = f"{server.base_url}/chat/completions"
        body = BODY.replace(b',"stream":true', b"")
        sweeps: list[tuple[float, int, int]] = []  # its deadline, idle before, idle after
        sweep = pool._close_expired

        def counted() -> None:
            handle = pool._sweep
            assert handle is not None
            before = pool.idle_connections
            sweep()
            sweeps.append((handle.when(), before, pool.idle_connections))

        pool._close_expired = counted  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        try:
            replies = await asyncio.gather(*(pool.post(url, body, HEADERS, T) for _ in range(10)))
            assert all(reply.status == 200 for reply in replies)
            surplus = sorted(
                conn.idle_until
                for idle in pool._idle.values()
                for conn in idle
                if conn.idle_until < loop.time() + 1
            )
            assert len(surplus) == 8
            assert pool._sweep is not None and pool._sweep.when() >= surplus[0]
            for _ in range(600):  # a deadlock guard, not a timing assertion
                if pool.open_connections == 2:
                    break
                await asyncio.sleep(0.05)
            assert pool.idle_connections == 2 and pool.open_connections == 2
            assert sweeps and all(after < before for _, before, after in sweeps), sweeps
            # Each sweep ran at or past the deadline of what it closed, and the first one
            # closed the first surplus connection.
            assert sweeps[0][0] >= surplus[0]
        finally:
            await pool.aclose()


def test_running_out_of_descriptors_closes_surplus_idle_connections_first() -> None:
    """A connect that meets EMFILE first closes the surplus idle connections of any host (kept
    past the idle cap only for a burst's pause) and tries again: a burst to host B after one to
    host A fits in the descriptors host A's surplus held. In a subprocess under a lowered
    `ulimit -n`: 20 connections to A (8 idle by the cap, 12 surplus kept a minute here), then
    15 at once to B with room for about 30 descriptors in all."""
    with FakeOpenAIServer("echo") as a, FakeOpenAIServer("echo") as b:
        b.latency_ms = 200  # B's requests hold their connections together
        script = textwrap.dedent(
            f"""
            import asyncio, os, resource
            from treadle._http import pool as pool_module
            from treadle._http.pool import Pool
            from treadle._http.reply import Timeouts

            pool_module.SURPLUS_IDLE_SECONDS = 60.0
            body = b'{{"model":"m","messages":[{{"role":"user","content":"hi"}}]}}'
            headers = {{"content-type": "application/json"}}
            t = Timeouts(10.0, 10.0, 10.0)

            async def main():
                pool = Pool(max_idle_connections=8)
                async def one(url):
                    try:
                        return (await pool.post(url + "/chat/completions", body, headers, t)).status
                    except Exception as e:
                        return type(e).__name__
                first = await asyncio.gather(*(one({a.base_url!r}) for _ in range(20)))
                print(sorted(map(str, set(first))), pool.idle_connections)
                highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
                resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 12, highest + 12))
                second = await asyncio.gather(*(one({b.base_url!r}) for _ in range(15)))
                print(sorted(map(str, set(second))), second.count(200))
                await pool.aclose()

            asyncio.run(main())
            """
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()[-2:]
    assert first == "['200'] 20"
    assert second == "['200'] 15", second


async def test_closing_the_pool_never_cancels_waiting_requests() -> None:
    with FakeOpenAIServer("echo") as server:
        server.latency_ms = 5_000
        pool = Pool(max_connections=1)
        url = f"{server.base_url}/chat/completions"
        first = asyncio.create_task(pool.post(url, BODY, HEADERS, T))
        while pool.open_connections == 0:
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(pool.post(url, BODY, HEADERS, T))
        while not pool._waiters:
            await asyncio.sleep(0.01)
        pool.close()
        results = await asyncio.gather(first, waiting, return_exceptions=True)
        assert not any(isinstance(r, asyncio.CancelledError) for r in results), results
        assert isinstance(results[1], PoolClosed) and "client was closed" in str(results[1])
        # The reply still arriving is not blamed on the server either.
        assert isinstance(results[0], PoolClosed) and "client was closed" in str(results[0])
        error = error_from_transport(results[1], url=url, retries=0)
        assert isinstance(error, ConfigurationError) and "aclose_clients" in str(error)


def test_running_out_of_file_descriptors_is_a_configuration_error_naming_ulimit() -> None:
    # A subprocess under a lowered open-files limit runs many passes at once against a server
    # that holds each reply: the connections run the process out of descriptors.
    with FakeOpenAIServer("echo") as server:
        server.latency_ms = 3_000
        script = textwrap.dedent(
            f"""
            import asyncio, resource
            from treadle import Session
            from treadle.errors import ConfigurationError
            from treadle.llm import Provider
            from treadle.loop import arun_session_loop

            async def main():
                provider = Provider(model="m", base_url={server.base_url!r}, api_key="k",
                                    max_retries=3, retry_base_delay=0.001)
                agent = Session.from_agent_prompt("s")
                # No warm-up pass: what a pass's cleanup needs (anyio's asyncio backend) must be
                # imported by the runtime itself, not first opened once descriptors ran out.
                resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
                passes = [arun_session_loop(Session.from_user_message(str(i)), agent,
                                            agent_provider=provider) for i in range(100)]
                results = await asyncio.gather(*passes, return_exceptions=True)
                errors = [r for r in results if isinstance(r, BaseException)]
                kinds = sorted({{type(e).__name__ for e in errors}})
                print(kinds)
                print(next(str(e) for e in errors if isinstance(e, ConfigurationError)))

            asyncio.run(main())
            """
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stderr
    kinds, message = done.stdout.strip().splitlines()[-2:]
    assert kinds == "['ConfigurationError']"
    assert "ulimit -n" in message
    # not retried: no pass was sent more than once (a retry would re-send the held ones too)
    assert server.request_count <= 101


async def test_a_gpustack_error_line_reaches_the_user() -> None:
    stream = (
        b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n'
        b'error: {"error": {"message": "CUDA out of memory on the worker", "code": 500}}\n\n'
    )
    with FakeOpenAIServer("echo") as server:
        server.enqueue(Reply.raw(stream, content_type="text/event-stream"))
        provider = Provider(
            model="m", base_url=server.base_url, api_key="k", stream=True, max_retries=0
        )
        with pytest.raises(ProviderError, match="CUDA out of memory on the worker"):
            await _pass(provider, "hi")


def test_network_options_with_a_users_client_are_refused() -> None:
    import httpx

    with pytest.raises(ConfigurationError, match=r"httpx\.AsyncClient"):
        Provider(model="m", http_client=httpx.AsyncClient(), verify=False)


def _dns_says_no_such_host(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 80)
    except socket.gaierror as exc:
        return exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None))
    return False


async def test_a_host_that_does_not_exist_is_not_retried() -> None:
    host = "treadle-no-such-host.invalid"  # RFC 6761: never resolves
    if not _dns_says_no_such_host(host):
        pytest.skip("this machine's resolver does not answer 'no such host' for .invalid")
    provider = Provider(model="m", base_url=f"http://{host}/v1", api_key="k", max_retries=3)
    body = build_request_body(provider, [to_json({"role": "user", "content": "x"})], stream=False)
    with pytest.raises(HostNotFoundError, match="would fail the same way") as info:
        await get_client(provider).complete(provider, body)
    assert "after" not in str(info.value)  # sent once: no retry counted
    assert not is_retryable_error(info.value)
