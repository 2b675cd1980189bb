"""A user's own `httpx.AsyncClient` (`Provider(http_client=...)`) on the lazy path and on theirs."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from treadle import ConfigurationError, Provider, Session, run_session_loop
from treadle.loop import arun_session_loop
from treadle.runtime import get_runtime
from treadle.testing import FakeOpenAIServer, Reply

AGENT = Session.from_agent_prompt("Answer.")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_bound_to_another_loop_is_a_configuration_error(stream: bool) -> None:
    users_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=users_loop.run_forever, daemon=True)
    thread.start()

    def on_users_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, users_loop).result(30)

    try:
        with FakeOpenAIServer() as server:
            client = on_users_loop(_make_client())

            async def warm() -> int:  # the user's loop pools a connection
                response = await client.get(server.base_url[: -len("/v1")] + "/health")
                return response.status_code

            assert on_users_loop(warm()) == 200
            server.enqueue(Reply.text("served"))
            provider = Provider(
                model="m", base_url=server.base_url, api_key="k", http_client=client, stream=stream
            )
            out = run_session_loop(Session.from_user_message("x"), AGENT, agent_provider=provider)
            # Either httpx manages (its pooled connection was already gone) or the pass says
            # how to pass a client; never a bare "bound to a different event loop" RuntimeError.
            try:
                assert out.synchronize(timeout=30).final_text == "served"
            except ConfigurationError as err:
                assert "another event loop" in str(err) and "arun_session_loop" in str(err)
            on_users_loop(client.aclose())
    finally:
        users_loop.call_soon_threadsafe(users_loop.stop)
        thread.join(30)
        users_loop.close()


async def _make_client() -> httpx.AsyncClient:
    return httpx.AsyncClient()


def test_a_fresh_client_works_on_the_lazy_path() -> None:
    with FakeOpenAIServer() as server:
        server.enqueue(Reply.text("hello"))
        client = httpx.AsyncClient()
        provider = Provider(model="m", base_url=server.base_url, api_key="k", http_client=client)
        out = run_session_loop(Session.from_user_message("x"), AGENT, agent_provider=provider)
        assert out.synchronize(timeout=30).final_text == "hello"
        assert server.requests[-1].headers.get("authorization") == "Bearer k"
        get_runtime().run(client.aclose(), timeout=30)  # it lives on the runtime loop now


def test_a_client_made_in_your_coroutine_works_with_arun() -> None:
    with FakeOpenAIServer() as server:
        server.enqueue(Reply.text("a"), Reply.text("b"))

        async def main() -> list[str | None]:
            async with httpx.AsyncClient() as client:
                provider = Provider(
                    model="m", base_url=server.base_url, api_key="k", http_client=client
                )
                first = await arun_session_loop(
                    Session.from_user_message("x"), AGENT, agent_provider=provider
                )
                second = await arun_session_loop(
                    first.add_user_message("y"), AGENT, agent_provider=provider
                )
                return [first.final_text, second.final_text]

        assert asyncio.run(main()) == ["a", "b"]
