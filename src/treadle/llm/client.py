"""`ModelClient`: chat completions (whole and SSE-streamed) with retries and limits.

Requests go through one `Transport` (`treadle.llm.transport`): Treadle's own pool, or the user's
`httpx.AsyncClient` behind the same two calls. A failure is classified once
(`treadle.llm.attempt.classify`) and retried in one loop (`ModelClient._send`).

`get_client(provider)` returns the pooled client of the running event loop for the provider's
endpoint; every pass on that loop shares it (keep-alive connections, one limiter per endpoint and
limits). This is the only retry loop in Treadle (a turn restarts only a stream torn after its
first events, on the same budget: `treadle.llm.turn.request_turn`). It never blocks the event
loop, never logs or raises the API key, and closes its connections when the loop shuts down
(`aclose_clients`, or automatically when `loop.shutdown_asyncgens()` runs, as `asyncio.run` and
runners do).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError
from pydantic_core import from_json

from treadle._http.errors import HTTPError, StaleConnection
from treadle._http.reply import Timeouts
from treadle.errors import MalformedResponse, ProviderError, clean_id
from treadle.llm.attempt import (
    OpenStream,
    StatusError,
    TornStream,
    Tries,
    classify,
    named_status,
    wire_timeouts,
)
from treadle.llm.chunk_parse import parse_chunk
from treadle.llm.http_errors import (
    error_from_payload,
    html_reply_error,
    is_certificate_failure,
    malformed,
)
from treadle.llm.inband import status_in, with_retries
from treadle.llm.limiter import EndpointLimiter, Permit, estimate_tokens
from treadle.llm.provider import Provider
from treadle.llm.registry import aclose_clients, close_all_clients_for_loop, get_client
from treadle.llm.retry import backoff_delay, is_retryable_error
from treadle.llm.sse import DONE
from treadle.llm.wire import ChatCompletion, ChatCompletionChunk
from treadle.telemetry import current_pass

if TYPE_CHECKING:
    import httpx

    from treadle.llm.transport import Transport

__all__ = ["ModelClient", "aclose_clients", "close_all_clients_for_loop", "get_client"]

logger = logging.getLogger("treadle.llm")


_T = TypeVar("_T")
_Parse = Callable[[bytes, str | None, str | None], tuple[_T, int | None, bool]]
"""A stream payload parser: `(data, api_key, request_id) -> (item, usage total, finished)`."""
_Prepared = tuple[Provider, Provider, str, dict[str, str], Timeouts, EndpointLimiter]
"""(provider, resolved, URL, headers, timeouts, limiter): `ModelClient._prepare`."""
_MAX_PREPARED = 256
_USER_AGENT = "treadle"


class ModelClient:
    """Sends chat-completion bodies to one endpoint; obtain it with `get_client(provider)`."""

    def __init__(self, transport: Transport, *, http: httpx.AsyncClient | None = None) -> None:
        self.transport = transport
        """The two calls every request goes through."""
        self.http = http
        """The user's `httpx.AsyncClient` carrying the requests (None: Treadle's own pool)."""
        self._wire_headers: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
        self._limiters: dict[
            tuple[int, int | None, int | None, bool, float, int], EndpointLimiter
        ] = {}
        # Per provider object: what every request to it needs, worked out once (not per request).
        self._prepared: dict[int, _Prepared] = {}
        self.closed = False
        """True once `aclose` ran."""

    def limiter(self, provider: Provider) -> EndpointLimiter:
        """The limiter shared by requests to this endpoint with `provider`'s limits."""
        key = (
            provider.max_concurrent_requests,
            provider.requests_per_minute,
            provider.tokens_per_minute,
            provider.learn_rate_limits,
            provider.rate_limit_share,
            provider.first_wave,
        )
        limiter = self._limiters.get(key)
        if limiter is None:
            limiter = self._limiters[key] = EndpointLimiter(
                *key[:3],
                learn=key[3],
                share=key[4],
                first_wave=key[5],
                endpoint=" ".join(provider.endpoint_key),
            )
        return limiter

    def _prepare(self, provider: Provider) -> _Prepared:
        prepared = self._prepared.get(id(provider))
        if prepared is None or prepared[0] is not provider:
            resolved = provider.resolve()
            if len(self._prepared) >= _MAX_PREPARED:  # many short-lived provider values
                self._prepared.clear()
            prepared = self._prepared[id(provider)] = (
                provider,
                resolved,
                resolved.chat_completions_url,
                self._headers_for(resolved.request_headers()),
                wire_timeouts(resolved),
                self.limiter(resolved),
            )
        return prepared

    async def complete(
        self, provider: Provider, body: bytes, tries: Tries | None = None
    ) -> ChatCompletion:
        """POST `body` (non-streaming) and return the parsed completion, retrying per policy.

        `tries` (optional) receives the retries spent and the reply's `x-request-id`.
        """
        _, provider, url, headers, timeouts, limiter = self._prepare(provider)
        tries = Tries() if tries is None else tries
        (result, reply_headers), permit = await self._send(
            provider,
            limiter,
            body,
            self._complete_once,
            (url, body, headers, timeouts),
            "chat completion",
            tries,
        )
        used: int | None = None
        tries.request_id = clean_id(reply_headers.get("x-request-id")) or None
        try:
            limiter.observe(permit, reply_headers)
            if result.usage is not None:
                used = result.usage.total_tokens
            return result
        finally:
            limiter.release(permit, used)

    async def _complete_once(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
    ) -> tuple[ChatCompletion, Mapping[str, str]]:
        """One non-streamed attempt, parsed. A 200 whose body is an error naming an HTTP status
        (`{"error": {"code": 429, ...}}`) is a `StatusError` of that status, so the one retry
        loop treats it as the status it names."""
        content, reply_headers = await self._post_whole(url, body, headers, timeouts)
        request_id = reply_headers.get("x-request-id")
        try:
            result = _parse_completion(content, request_id)
        except MalformedResponse as exc:
            page = html_reply_error(url, reply_headers, content)
            if page is not None:
                raise page from exc
            raise
        except ProviderError as exc:  # a 200 whose body is {"error": ...}
            status = named_status(exc.body)
            if status is not None:
                raise StatusError(status, reply_headers, content) from None
            raise
        extra = result.model_extra
        if extra and extra.get("error"):
            status = status_in(extra["error"])
            if status is not None:
                raise StatusError(status, reply_headers, content)
        return result, reply_headers

    async def stream(self, provider: Provider, body: bytes) -> AsyncGenerator[ChatCompletionChunk]:
        """POST `body` with `"stream": true` and yield chunks as they arrive.

        Retries only until the first event has arrived (nothing yielded yet); a stream torn after
        that raises `MalformedResponse`. Use it inside `contextlib.aclosing(...)` when you may
        stop early.
        """
        batches = self.stream_batches(provider, body, parse_chunk)
        try:
            async with contextlib.aclosing(batches):
                async for batch in batches:
                    for chunk in batch:
                        yield chunk
        except TornStream as torn:  # only a turn restarts a torn stream; here it is final
            raise torn.error from torn.__cause__

    async def stream_batches(
        self, provider: Provider, body: bytes, parse: _Parse[_T], tries: Tries | None = None
    ) -> AsyncGenerator[list[_T]]:
        """`stream`, yielding the events of each network read at once, parsed by `parse`.

        `parse` is `chunk_parse.parse_chunk` (typed chunks) or `parse_event` (validated dicts,
        what the turn folds in); one yield per read, not per event, saves a generator step per
        event. Same retries, errors and limiter accounting as `stream`, except that a failure
        after the first events (a lost connection, an in-band error) raises `TornStream`, which
        the turn may restart with the same `tries`.
        """
        _, provider, url, headers, timeouts, limiter = self._prepare(provider)
        api_key = provider.api_key
        tries = Tries() if tries is None else tries
        opened, permit = await self._send(
            provider,
            limiter,
            body,
            self._open_stream,
            (url, body, headers, timeouts),
            "streamed chat completion",
            tries,
            (parse, api_key),
        )
        used, done, finished = opened.used, opened.done, opened.finished
        tries.request_id = request_id = opened.request_id
        try:
            limiter.observe(permit, opened.headers)
            chunks, decoder = opened.chunks, opened.decoder
            first: list[_T] = opened.parsed
            if first:
                yield first
            if opened.failure is not None:  # the events before a bad one reached the caller
                raise opened.failure
            while not (done or opened.ended):
                try:  # inline, not a helper: this runs once per network read
                    raw = await chunks.__anext__()
                except StopAsyncIteration:
                    opened.ended = True
                    events = decoder.flush()
                except HTTPError as exc:
                    raise opened.torn(exc, url) from exc
                else:
                    events = decoder.feed(raw)
                batch: list[_T] = []
                for data in events:
                    if data == DONE:
                        done = True
                        break
                    try:
                        item, total, ends = parse(data, api_key, request_id)
                    except ProviderError as exc:
                        if batch:  # the events before a bad one still reach the caller first
                            yield batch
                        raise TornStream(
                            exc,
                            retryable=is_retryable_error(exc),
                            remake=functools.partial(with_retries, exc, api_key=api_key),
                        ) from None
                    if total is not None:
                        used = total
                    finished = finished or ends
                    batch.append(item)
                if batch:
                    yield batch
            if not done and not finished:
                page = html_reply_error(url, opened.headers)
                if page is not None:
                    raise page
                raise malformed(
                    "the stream ended without [DONE] or a finish_reason", request_id=request_id
                )
        finally:
            try:
                await opened.aclose()
            finally:
                limiter.release(permit, used)

    async def _send(
        self,
        provider: Provider,
        limiter: EndpointLimiter,
        body: bytes,
        attempt: Callable[..., Awaitable[_T]],
        args: tuple[str, bytes, dict[str, str], Timeouts],
        what: str,
        tries: Tries,
        extra: tuple[Any, ...] = (),
    ) -> tuple[_T, Permit]:
        """The one retry loop of whole and streamed completions: `attempt(*args)` until it succeeds.

        Each try holds a limiter permit; the successful one is returned with the attempt's result
        and the caller releases it once the reply is consumed. Raises the classified error when
        the failure cannot succeed on retry or `max_retries` are used up. A reused keep-alive
        connection the server had closed just as the request was written (`StaleConnection`: it
        never saw the request) is re-sent once at once, not counted as a retry, but only when
        `max_retries` allows any re-send at all: `max_retries=0` always means one send.
        Retries are counted in `tries`, shared with the turn that may restart a torn stream.
        """
        estimate = estimate_tokens(body)
        trace = current_pass()  # None unless the application traces passes
        stale_resent = False
        while True:
            if trace is None:
                permit = await limiter.acquire(estimate)
            else:
                waited = time.monotonic()
                permit = await limiter.acquire(estimate)
                trace.note_limiter_wait(time.monotonic() - waited)
            try:
                return await attempt(*args, *extra), permit
            except (HTTPError, StatusError) as exc:
                if isinstance(exc, StatusError):  # a 429 pauses every pass on the endpoint
                    limiter.observe(permit, exc.headers, refused=exc.status == 429)
                limiter.release(permit)
                if (
                    isinstance(exc, StaleConnection)
                    and not stale_resent
                    and provider.max_retries > 0
                ):
                    stale_resent = True
                    continue
                failure: HTTPError | StatusError = exc
            except BaseException:
                limiter.release(permit)
                raise
            spent = tries.spent
            error, retry_after = classify(provider, failure, 0)
            if (
                not isinstance(error, ProviderError)
                or not is_retryable_error(error)
                or (isinstance(failure, HTTPError) and is_certificate_failure(failure))
                or spent >= provider.max_retries
            ):
                if spent:  # the final error says how many retries were spent
                    error, _ = classify(provider, failure, spent)
                raise error from (failure if isinstance(failure, HTTPError) else None)
            delay = backoff_delay(spent, provider.retry_base_delay, retry_after)
            logger.info("retrying %s (%s) in %.2fs, attempt %d/%d", what, error.message, delay,
                        spent + 1, provider.max_retries)  # fmt: skip
            if trace is not None:
                trace.note_retry(spent + 1, error.message, delay)
            await asyncio.sleep(delay)
            tries.spent = spent + 1

    async def _post_whole(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
    ) -> tuple[bytes, Mapping[str, str]]:
        """One non-streamed POST: `(content, headers)` of a 200 reply, else `StatusError`."""
        reply = await self.transport.post(url, body, headers, timeouts)
        if reply.status != 200:
            raise StatusError(reply.status, reply.headers, reply.content)
        return reply.content, reply.headers

    async def _open_stream(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        timeouts: Timeouts,
        parse: _Parse[Any],
        api_key: str | None,
    ) -> OpenStream:
        """One streamed POST, read and parsed until its first SSE events (or its end) arrived.

        A non-200 reply is read whole and raised as `StatusError`; so is an in-band error among
        the first events that names a status: nothing was handed on yet, so the request loop
        retries it like the same status in the reply's head.
        """
        reply = await self.transport.post_stream(url, body, headers, timeouts)
        opened = OpenStream(reply.body.__aiter__(), reply.body.aclose, reply.headers)
        await opened.start(reply.status)
        try:
            opened.parse_first(parse, api_key)
        except BaseException:
            await opened.aclose()
            raise
        return opened

    def _headers_for(self, headers: dict[str, str]) -> dict[str, str]:
        """The provider's headers, offering only the encodings the pool decodes (a user's
        client sends its own defaults, then these)."""
        if self.http is not None:
            return headers
        key = tuple(headers.items())
        merged = self._wire_headers.get(key)
        if merged is None:
            merged = {"accept-encoding": "gzip, deflate", "user-agent": _USER_AGENT, **headers}
            self._wire_headers[key] = merged
        return merged

    async def aclose(self) -> None:
        """Close the pooled connections (a user-supplied `http_client` is left open)."""
        self.closed = True
        await self.transport.aclose()

    def close_now(self) -> None:
        """Synchronous best-effort close for a loop that cannot run coroutines any more."""
        self.closed = True
        self.transport.close_now()


def _parse_completion(content: bytes, request_id: str | None) -> ChatCompletion:
    try:
        # The validator itself: `model_validate_json` adds keyword passing (about 3 µs a reply).
        result: ChatCompletion = ChatCompletion.__pydantic_validator__.validate_json(content)
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
