"""One attempt of a chat-completion request, as plain values for `ModelClient`'s one retry loop.

A non-200 reply is a `StatusError` carrying status, headers and body; `classify` turns it, or an
HTTP-layer error (`treadle._http.errors`), into the typed error and the server's `Retry-After`:
the one place a failure is classified. `OpenStream` is a streamed 200 reply read up to its first
SSE events: the point after which the request is never retried; a stream that fails later is a
`TornStream`, which only the turn may restart. `Tries` is what one request has spent: the request
loop and the turn's restart share it, so together they send at most `max_retries + 1` times.
Nothing here sleeps or retries.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic_core import from_json

from treadle._http.errors import HTTPError, PoolClosed
from treadle._http.reply import Timeouts
from treadle.errors import ProviderError, TreadleError, clean_id
from treadle.llm.http_errors import (
    after_retries,
    error_from_status,
    error_from_transport,
    malformed,
)
from treadle.llm.inband import status_in
from treadle.llm.provider import DEFAULT_POOL_TIMEOUT
from treadle.llm.retry import is_retryable_error, parse_retry_after
from treadle.llm.sse import DONE, SSEDecoder

if TYPE_CHECKING:
    from treadle.llm.client import ModelClient
    from treadle.llm.provider import Provider

__all__ = [
    "OpenStream",
    "StatusError",
    "TornStream",
    "Tries",
    "classify",
    "named_status",
    "wire_timeouts",
]


class Tries:
    """What one model request has spent: retries, the client, and the reply's `x-request-id`.

    `ModelClient`'s retry loop counts its retries here and the turn's restart of a torn stream
    counts on from there, so a turn sends at most `max_retries + 1` requests (a free re-send of
    a stale connection aside). The restart goes through the same `client` as the first attempt,
    as a retry of the request loop does: a client closed meanwhile (`aclose_clients()`) ends the
    turn with its `ConfigurationError` instead of opening new connections on a fresh client.
    """

    __slots__ = ("client", "request_id", "spent")

    def __init__(self) -> None:
        self.spent = 0
        """Retries spent so far (sends after the first)."""
        self.request_id: str | None = None
        """The `x-request-id` header of the reply that was used, cleaned (`clean_id`; None when
        it had none, or nothing printable)."""
        self.client: ModelClient | None = None
        """The client of the first attempt (None until a turn picked one)."""


class TornStream(Exception):
    """A streamed 200 reply failed after its first events were handed on.

    Never retried as a request (its events already reached the caller); the turn may restart
    when `retryable` (a lost connection, a read timeout, an in-band 429 or 5xx). `error` is the
    typed error to raise otherwise; `final(retries)` the same error saying how many retries the
    turn spent (`remake` builds it), as the request loop's final errors say.
    """

    def __init__(
        self,
        error: TreadleError,
        *,
        retryable: bool,
        remake: Callable[[int], TreadleError] | None = None,
    ) -> None:
        super().__init__(str(error))
        self.error = error
        self.retryable = retryable
        self._remake = remake

    def final(self, retries: int) -> TreadleError:
        """The error to raise once the turn spent `retries` retries ("after N retries")."""
        if not retries or self._remake is None:
            return self.error
        return self._remake(retries)


class StatusError(Exception):
    """An attempt got a non-200 reply: its status, headers and whole body, classified later."""

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.headers = headers
        """The reply's headers."""
        self.body = body


def classify(
    provider: Provider, failure: HTTPError | StatusError, retries: int
) -> tuple[TreadleError, float | None]:
    """The typed error of a failed attempt (saying `retries` were spent), and `Retry-After`."""
    url = provider.chat_completions_url
    if isinstance(failure, StatusError):
        error = error_from_status(failure.status, failure.headers, failure.body,
                                  api_key=provider.api_key, retries=retries, url=url)  # fmt: skip
        return error, parse_retry_after(failure.headers)
    return error_from_transport(failure, url=url, retries=retries), None


class OpenStream:
    """A streamed reply: its byte chunks, SSE decoder and the events read so far.

    `start` reads until the first events arrived (a failure there may still be retried); the
    caller reads on from `chunks` through `decoder`, and reports a torn connection with `torn`.
    Always `aclose` it: closing before the end closes the connection rather than pooling it.
    """

    __slots__ = (
        "_close",
        "chunks",
        "decoder",
        "done",
        "ended",
        "failure",
        "finished",
        "first",
        "headers",
        "parsed",
        "request_id",
        "used",
    )

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        close: Callable[[], Awaitable[None]],
        headers: Mapping[str, str],
    ) -> None:
        self.chunks = chunks
        """The body's byte chunks (read on by `ModelClient.stream` after `start`)."""
        self._close = close
        self.request_id = clean_id(headers.get("x-request-id")) or None
        self.headers = headers
        """The reply's headers."""
        self.decoder = SSEDecoder()
        self.first: list[bytes] = []
        """The first event payloads (empty only when the body ended without any)."""
        self.ended = False
        """True once the body has been read to its end."""
        self.parsed: list[Any] = []
        """The first events, parsed (`parse_first`)."""
        self.failure: ProviderError | None = None
        """A bad first event that names no status: raised after the events before it."""
        self.used: int | None = None
        self.done = self.finished = False

    async def start(self, status: int) -> None:
        """Read a non-200 reply whole (raising `StatusError`), or a 200 up to its first events.

        Closes the stream when it raises (including on cancellation).
        """
        try:
            if status != 200:
                content = b"".join([piece async for piece in self.chunks])
                raise StatusError(status, self.headers, content)
            while not self.first and not self.ended:
                self.first = await self._read()
        except BaseException:
            await self.aclose()
            raise

    def parse_first(
        self,
        parse: Callable[[bytes, str | None, str | None], tuple[Any, int | None, bool]],
        api_key: str | None,
    ) -> None:
        """Parse the first events; an in-band error naming a status raises `StatusError`.

        Nothing was handed on yet, so such an error is retried by the request loop like the same
        status in the head. Another bad event is kept in `failure`, raised after the events
        before it reached the caller (a retry would not help).
        """
        for data in self.first:
            if data == DONE:
                self.done = True
                return
            try:
                item, total, ends = parse(data, api_key, self.request_id)
            except ProviderError as exc:
                if exc.status_code is not None:
                    raise StatusError(exc.status_code, self.headers, data) from None
                self.failure = exc
                return
            if total is not None:
                self.used = total
            self.finished = self.finished or ends
            self.parsed.append(item)

    async def _read(self) -> list[bytes]:
        try:
            raw = await anext(self.chunks)
        except StopAsyncIteration:
            self.ended = True
            return self.decoder.flush()
        return self.decoder.feed(raw)

    def torn(self, exc: HTTPError, url: str) -> TornStream:
        """The failure of a connection lost after the first events (never retried as a request).

        A pool closed under the stream (`aclose_clients()`) is that `ConfigurationError`, not a
        torn stream: nothing on the wire went wrong and no restart would succeed.
        """
        error = error_from_transport(exc, url=url, retries=0)
        if isinstance(exc, PoolClosed):
            return TornStream(error, retryable=False)
        retryable = isinstance(error, ProviderError) and is_retryable_error(error)
        text = error.message if isinstance(error, ProviderError) else str(error)
        request_id = self.request_id

        def remake(retries: int) -> TreadleError:
            said = f"the stream was torn{after_retries(retries)} ({text})"
            return malformed(said, request_id=request_id)

        return TornStream(remake(0), retryable=retryable, remake=remake)

    async def aclose(self) -> None:
        """Close the body stream (idempotent)."""
        try:
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            await self._close()


def wire_timeouts(provider: Provider) -> Timeouts:
    """`provider.timeout` (and `pool_timeout`) as the HTTP layer's `Timeouts` (no httpx needed)."""
    cached: Timeouts | None = provider._cache.get("wire_timeouts")
    if cached is None:
        t = provider.timeout
        pool = provider.pool_timeout
        if isinstance(t, tuple):
            cached = Timeouts(float(t[0]), float(t[1]), pool)
        elif isinstance(t, int | float):
            cached = Timeouts(float(t), float(t), pool)
        else:  # an httpx.Timeout: its own pool value unless pool_timeout was changed
            wait = t.pool if pool == DEFAULT_POOL_TIMEOUT else pool
            cached = Timeouts(t.connect, t.read, wait)
        provider._cache["wire_timeouts"] = cached
    return cached


def named_status(body: str | None) -> int | None:
    """The HTTP status an in-band error body names (`code`, `status`, `status_code`), if any."""
    if not body:
        return None
    try:
        payload = from_json(body)
    except ValueError:
        return None
    return status_in(payload.get("error")) if isinstance(payload, dict) else None
