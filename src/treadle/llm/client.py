"""`ModelClient`: chat completions over httpx (whole and SSE-streamed) with retries and limits.

`get_client(provider)` returns the pooled client of the running event loop for the provider's
endpoint; every pass on that loop shares it (keep-alive connections, one limiter per endpoint and
limits). This is the only retry layer in Treadle. It never blocks the event loop, never logs or
raises the API key, and closes its connections when the loop shuts down (`aclose_clients`, or
automatically when `loop.shutdown_asyncgens()` runs, as `asyncio.run` and runners do).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import ValidationError
from pydantic_core import from_json

from treadle.errors import ProviderError
from treadle.llm.http_errors import (
    StaleConnectionError,
    error_from_payload,
    error_from_response,
    error_from_transport,
    malformed,
)
from treadle.llm.limiter import EndpointLimiter, estimate_tokens
from treadle.llm.provider import Provider
from treadle.llm.retry import backoff_delay, is_retryable_status, parse_retry_after
from treadle.llm.sse import DONE, SSEDecoder
from treadle.llm.wire import ChatCompletion, ChatCompletionChunk

if TYPE_CHECKING:  # imported on first use: aiohttp's import costs ~170 ms
    from treadle.llm.transport import AiohttpTransport

__all__ = ["ModelClient", "aclose_clients", "close_all_clients_for_loop", "get_client"]

logger = logging.getLogger("treadle.llm")

_CLOSE_TIMEOUT_SECONDS = 10.0


class _Retry(Exception):
    """Internal: this attempt failed in a retryable way."""

    def __init__(self, error: ProviderError, retry_after: float | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.retry_after = retry_after


class ModelClient:
    """Sends chat-completion bodies to one endpoint; obtain it with `get_client(provider)`."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        owns_http: bool,
        fast_transport: AiohttpTransport | None = None,
    ) -> None:
        self.http = http
        """The underlying `httpx.AsyncClient`."""
        self._owns_http = owns_http
        # Set when Treadle built `http` over its own transport: whole (non-streamed) completions
        # then skip httpx's Request/Response layer (same headers, errors and timeouts).
        self._fast = fast_transport
        self._fast_headers: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
        self._limiters: dict[tuple[int, int | None, int | None], EndpointLimiter] = {}
        self.closed = False
        """True once `aclose` ran."""

    def limiter(self, provider: Provider) -> EndpointLimiter:
        """The limiter shared by requests to this endpoint with `provider`'s limits."""
        key = (
            provider.max_concurrent_requests,
            provider.requests_per_minute,
            provider.tokens_per_minute,
        )
        limiter = self._limiters.get(key)
        if limiter is None:
            limiter = self._limiters[key] = EndpointLimiter(*key)
        return limiter

    async def complete(self, provider: Provider, body: bytes) -> ChatCompletion:
        """POST `body` (non-streaming) and return the parsed completion, retrying per policy."""
        provider = provider.resolve()
        url = provider.chat_completions_url
        headers = provider.request_headers()
        timeout = provider.httpx_timeout
        limiter = self.limiter(provider)
        estimate = estimate_tokens(body)
        attempt = 0
        stale_retried = False
        while True:
            permit = await limiter.acquire(estimate)
            used: int | None = None
            try:
                try:
                    if self._fast is not None:
                        status, reply_headers, content = await self._fast.post_buffered(
                            url, body, self._merged_headers(headers), timeout
                        )
                        if status != 200:
                            response = httpx.Response(status, headers=reply_headers.items(),
                                                      content=content)  # fmt: skip
                            self._raise_status(provider, response, attempt)
                        result = _parse_completion(content, reply_headers.get("x-request-id"))
                    else:
                        response = await self.http.post(
                            url, content=body, headers=headers, timeout=timeout
                        )
                        if response.status_code != 200:
                            self._raise_status(provider, response, attempt)
                        result = _parse_completion(
                            response.content, response.headers.get("x-request-id")
                        )
                except StaleConnectionError as exc:
                    if stale_retried:
                        raise _Retry(error_from_transport(exc, url=url, retries=attempt)) from exc
                    stale_retried = True  # a pooled connection the server had closed: once, now
                    continue
                except httpx.TransportError as exc:
                    raise _Retry(error_from_transport(exc, url=url, retries=attempt)) from exc
                if result.usage is not None:
                    used = result.usage.total_tokens
                return result
            except _Retry as retry:
                delay = _next_delay(provider, retry, attempt, "chat completion")
            finally:
                limiter.release(permit, used)
            await asyncio.sleep(delay)
            attempt += 1

    def _merged_headers(self, headers: dict[str, str]) -> dict[str, str]:
        """The headers httpx would send: the client's defaults, then the provider's."""
        key = tuple(headers.items())
        merged = self._fast_headers.get(key)
        if merged is None:
            merged = dict(self.http.headers)
            merged.update(headers)
            # Only what aiohttp itself decodes (httpx may also offer br/zstd when installed).
            merged["accept-encoding"] = "gzip, deflate"
            merged.pop("content-length", None)
            self._fast_headers[key] = merged
        return merged

    def _raise_status(self, provider: Provider, response: httpx.Response, attempt: int) -> None:
        status = response.status_code
        retryable = is_retryable_status(status) and attempt < provider.max_retries
        error = error_from_response(
            response, api_key=provider.api_key, retries=attempt if not retryable else 0
        )
        if retryable:
            raise _Retry(error, parse_retry_after(response.headers))
        raise error

    async def stream(self, provider: Provider, body: bytes) -> AsyncIterator[ChatCompletionChunk]:
        """POST `body` with `"stream": true` and yield chunks as they arrive.

        Retries only while nothing has been yielded; a stream torn after that raises
        `MalformedResponse`. Use it inside `contextlib.aclosing(...)` when you may stop early.
        """
        provider = provider.resolve()
        url = provider.chat_completions_url
        headers = provider.request_headers()
        timeout = provider.httpx_timeout
        limiter = self.limiter(provider)
        estimate = estimate_tokens(body)
        attempt = 0
        stale_retried = False
        yielded = False
        while True:
            permit = await limiter.acquire(estimate)
            used: int | None = None
            try:
                try:
                    async with self._open_stream(url, body, headers, timeout) as (
                        status,
                        reply_headers,
                        body_bytes,
                    ):
                        if status != 200:
                            content = b"".join([piece async for piece in body_bytes])
                            response = httpx.Response(
                                status, headers=list(reply_headers.items()), content=content
                            )
                            self._raise_status(provider, response, attempt)
                        request_id = reply_headers.get("x-request-id")
                        decoder = SSEDecoder()
                        done = finished = False
                        async for raw in body_bytes:
                            for data in decoder.feed(raw):
                                if data == DONE:
                                    done = True
                                    break
                                chunk = _parse_chunk(data, provider, request_id)
                                if chunk.usage is not None:
                                    used = chunk.usage.total_tokens
                                for choice in chunk.choices:
                                    if choice.finish_reason is not None:
                                        finished = True
                                yielded = True
                                yield chunk
                            if done:
                                break
                        if not done:
                            for data in decoder.flush():
                                if data == DONE:
                                    done = True
                        if not done and not finished:
                            raise malformed(
                                "the stream ended without [DONE] or a finish_reason",
                                request_id=request_id,
                            )
                    return
                except StaleConnectionError as exc:
                    if stale_retried or yielded:
                        error = error_from_transport(exc, url=url, retries=attempt)
                        if yielded:
                            raise malformed(f"the stream was torn ({error.message})") from exc
                        raise _Retry(error) from exc
                    stale_retried = True  # a pooled connection the server had closed: once, now
                    continue
                except httpx.TransportError as exc:
                    error = error_from_transport(exc, url=url, retries=attempt)
                    if yielded:
                        raise malformed(f"the stream was torn ({error.message})") from exc
                    raise _Retry(error) from exc
            except _Retry as retry:
                delay = _next_delay(provider, retry, attempt, "streamed chat completion")
            finally:
                limiter.release(permit, used)
            await asyncio.sleep(delay)
            attempt += 1

    @contextlib.asynccontextmanager
    async def _open_stream(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: httpx.Timeout
    ) -> AsyncIterator[tuple[int, Mapping[str, str], AsyncIterator[bytes]]]:
        """`(status, headers, body bytes)` of a streamed POST, closed on exit.

        When Treadle built the client, aiohttp is used directly (no httpx Request/Response per
        request, the streaming twin of `complete`'s fast path); a user's `http_client` goes
        through httpx. Leaving early closes the connection rather than pooling it.
        """
        fast = self._fast
        if fast is not None:
            status, reply_headers, stream = await fast.post_stream(
                url, body, self._merged_headers(headers), timeouts
            )
            chunks = stream.__aiter__()
            try:
                yield status, reply_headers, chunks
            finally:
                await chunks.aclose()
                await stream.aclose()
            return
        async with self.http.stream(
            "POST", url, content=body, headers=headers, timeout=timeouts
        ) as response:
            yield response.status_code, response.headers, response.aiter_bytes()

    async def aclose(self) -> None:
        """Close the pooled connections (a user-supplied `http_client` is left open)."""
        self.closed = True
        if self._owns_http:
            await self.http.aclose()

    def close_now(self) -> None:
        """Synchronous best-effort close for a loop that cannot run coroutines any more."""
        self.closed = True
        if self._owns_http:
            transport = getattr(self.http, "_transport", None)
            close_now = getattr(transport, "close_now", None)
            if callable(close_now):  # our AiohttpTransport
                close_now()


def _next_delay(provider: Provider, retry: _Retry, attempt: int, what: str) -> float:
    """Seconds to wait before the next attempt; re-raises the error when retries are used up."""
    if attempt >= provider.max_retries:
        raise retry.error from retry.__cause__
    delay = backoff_delay(attempt, provider.retry_base_delay, retry.retry_after)
    logger.info(
        "retrying %s (%s) in %.2fs, attempt %d/%d",
        what,
        retry.error.message,
        delay,
        attempt + 1,
        provider.max_retries,
    )
    return delay


def _parse_completion(content: bytes, request_id: str | None) -> ChatCompletion:
    try:
        result = ChatCompletion.model_validate_json(content)
    except ValidationError as exc:
        try:
            payload = from_json(content)
        except ValueError:
            raise malformed("the body is not JSON", content, request_id=request_id) from exc
        if isinstance(payload, dict) and "error" in payload:
            raise error_from_payload(
                None, payload, content, request_id=request_id, api_key=None
            ) from exc
        raise malformed(
            "the body does not match the schema", content, request_id=request_id
        ) from exc
    if not result.choices:
        raise malformed("the choices list is empty", content, request_id=request_id)
    return result


def _parse_chunk(data: bytes, provider: Provider, request_id: str | None) -> ChatCompletionChunk:
    try:
        return ChatCompletionChunk.model_validate_json(data)
    except ValidationError as exc:
        try:
            payload: Any = from_json(data)
        except ValueError:
            raise malformed("a stream event is not JSON", data, request_id=request_id) from exc
        if isinstance(payload, dict) and "error" in payload:
            # vLLM and OpenAI report mid-stream failures as an `{"error": ...}` event.
            raise error_from_payload(
                None, payload, data, request_id=request_id, api_key=provider.api_key
            ) from exc
        raise malformed("a stream event does not match the schema", data) from exc


# --- the per-loop registry -------------------------------------------------------------------

_ClientKey = tuple[str, str, int]


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


def _new_client() -> ModelClient:
    from treadle.llm.transport import AiohttpTransport

    transport = AiohttpTransport()
    http = httpx.AsyncClient(transport=transport, trust_env=False, follow_redirects=False)
    return ModelClient(http, owns_http=True, fast_transport=transport)


def get_client(provider: Provider) -> ModelClient:
    """The running loop's pooled `ModelClient` for `provider`'s endpoint (created on first use).

    Must be called inside a running event loop. When `provider.http_client` is set, that client
    carries the requests (Treadle never closes it).
    """
    loop = asyncio.get_running_loop()
    loop_clients = _registry.get(loop)
    if loop_clients is None:
        loop_clients = _registry[loop] = _LoopClients()
    resolved = provider.resolve()
    base_url, key_digest = resolved.endpoint_key
    user_http = resolved.http_client
    key = (base_url, key_digest, id(user_http) if user_http is not None else 0)
    client = loop_clients.clients.get(key)
    if client is None or client.closed:
        client = _new_client() if user_http is None else ModelClient(user_http, owns_http=False)
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
