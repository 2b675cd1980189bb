"""The per-event-loop registry of `ModelClient`s: `get_client`, `aclose_clients`.

`get_client(provider)` returns the running loop's client for the provider's endpoint (created on
first use, shared by every pass on that loop); the clients of a loop are closed together when it
shuts down (`loop.shutdown_asyncgens()`), or at once with `aclose_clients()`, or from another
thread with `close_all_clients_for_loop(loop)`. `treadle.llm.client` re-exports the three.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.llm.client import ModelClient
    from treadle.llm.provider import Provider

__all__ = ["aclose_clients", "close_all_clients_for_loop", "get_client"]

_CLOSE_TIMEOUT_SECONDS = 10.0


# --- the per-loop registry -------------------------------------------------------------------

_ClientKey = tuple[str, str, int, object]


class _LoopClients:
    """The clients of one event loop, closed together when that loop shuts down."""

    def __init__(self) -> None:
        self.clients: dict[_ClientKey, ModelClient] = {}
        self.closer: Any = None  # an async generator the loop finalises at shutdown_asyncgens()


_registry: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopClients] = (
    weakref.WeakKeyDictionary()
)


async def _closer(loop_clients: _LoopClients) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await _aclose_all(loop_clients)


async def _aclose_all(loop_clients: _LoopClients) -> None:
    clients = list(loop_clients.clients.values())
    loop_clients.clients.clear()
    for client in clients:
        await client.aclose()


def _new_client(provider: Provider) -> ModelClient:
    from treadle._http.pool import DEFAULT_MAX_CONNECTIONS
    from treadle.llm.client import ModelClient  # imported here: client re-exports this module
    from treadle.llm.transport import HttpxTransport, PoolTransport

    user_http = provider.http_client
    if user_http is not None:
        return ModelClient(HttpxTransport(user_http), http=user_http)
    # The endpoint limiter gates requests first; the pool must not be the narrower gate.
    limit = max(DEFAULT_MAX_CONNECTIONS, provider.max_concurrent_requests)
    return ModelClient(PoolTransport(provider.network_options, max_connections=limit))


def get_client(provider: Provider) -> ModelClient:
    """The running loop's pooled `ModelClient` for `provider`'s endpoint (created on first use).

    Must be called inside a running event loop. When `provider.http_client` is set, that client
    carries the requests (Treadle never closes it).
    """
    loop = asyncio.get_running_loop()
    cached = provider._cache.get("client")  # (loop, client) weakly: the last one used
    if cached is not None and cached[0]() is loop:
        client: ModelClient | None = cached[1]()
        if client is not None and not client.closed:
            return client
    client = _registered_client(loop, provider)
    provider._cache["client"] = (weakref.ref(loop), weakref.ref(client))
    return client


def _registered_client(loop: asyncio.AbstractEventLoop, provider: Provider) -> ModelClient:
    loop_clients = _registry.get(loop)
    if loop_clients is None:
        loop_clients = _registry[loop] = _LoopClients()
    resolved = provider.resolve()
    base_url, key_digest = resolved.endpoint_key
    user_http = resolved.http_client
    network = resolved.network_options if user_http is None else None
    key = (base_url, key_digest, id(user_http) if user_http is not None else 0, network)
    client = loop_clients.clients.get(key)
    if client is None or client.closed:
        client = _new_client(resolved)
        loop_clients.clients[key] = client
        if loop_clients.closer is None:
            # The loop's asyncgen hooks track this generator; shutdown_asyncgens() finalises it,
            # which closes the clients before the loop closes (no unclosed-session warnings).
            closer = _closer(loop_clients)
            loop_clients.closer = closer
            first: Any = closer.__anext__()
            with contextlib.suppress(StopIteration):
                first.send(None)
    return client


async def aclose_clients() -> None:
    """Close every pooled client of the running loop (new ones are created on next use)."""
    loop_clients = _registry.get(asyncio.get_running_loop())
    if loop_clients is not None:
        await _aclose_all(loop_clients)


def close_all_clients_for_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close `loop`'s pooled clients from outside it (e.g. a runtime shutdown hook).

    Runs the close on `loop` when it is running in another thread or can still run; if the loop
    is already closed, drops the connections without awaiting. Never call it from inside `loop`
    (await `aclose_clients()` there).
    """
    loop_clients = _registry.get(loop)
    if loop_clients is None or not loop_clients.clients:
        return
    if loop.is_closed():
        for client in loop_clients.clients.values():
            client.close_now()
        loop_clients.clients.clear()
        return
    if loop.is_running():
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("close_all_clients_for_loop() was called inside its own loop.")
        future = asyncio.run_coroutine_threadsafe(_aclose_all(loop_clients), loop)
        try:
            future.result(_CLOSE_TIMEOUT_SECONDS)
        except concurrent.futures.TimeoutError:
            future.cancel()
        return
    loop.run_until_complete(_aclose_all(loop_clients))
