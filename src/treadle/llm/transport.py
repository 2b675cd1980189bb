"""`AiohttpTransport`: the httpx transport under Treadle's pooled client, one per event loop.

Why not httpx's own: httpcore's pool does O(connections^2) work per request, which dominates
fan-outs of thousands of passes (see docs/providers.md). Chat-completion POSTs take Treadle's
HTTP/1.1 lane (`treadle.llm.lane`, `post_buffered` / `post_stream`); any other request goes
through httpx to one `aiohttp.ClientSession` (`treadle.llm.aiohttp_parts`, imported on its first
use). Both behave like httpx's transport: errors surface as httpx's exception classes, streamed
bodies arrive incrementally, a cancelled request's connection is closed (never pooled). Nothing
blocks the event loop; connections are made inside the running loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

import httpx

from treadle.llm.lane import Lane, LaneBody

if TYPE_CHECKING:
    import aiohttp

__all__ = ["DEFAULT_CONNECTION_LIMIT", "AiohttpTransport"]

DEFAULT_CONNECTION_LIMIT = 1000
"""Default cap on open connections: an unbounded pool made a busy loop time itself out."""


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx transport bound to the event loop of its first request.

    `limit` caps open connections of each of its two pools (None: unlimited; not recommended
    for fan-outs).
    """

    def __init__(
        self,
        *,
        limit: int | None = DEFAULT_CONNECTION_LIMIT,
        keepalive_timeout: float = 30.0,
    ) -> None:
        self._limit = limit
        self._keepalive_timeout = keepalive_timeout
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._lane: Lane | None = None

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The aiohttp session, once the first request other than a completion created it."""
        return self._session

    def _bind(self) -> None:
        """Check this transport is used on its own loop (binding it on first use)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            if self._closed:
                raise RuntimeError("This AiohttpTransport is closed; create a new client.")
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(
                "This AiohttpTransport belongs to another event loop; create one per loop "
                "(treadle.llm.get_client does this for you)."
            )
        elif self._closed:
            raise RuntimeError("This AiohttpTransport is closed; create a new client.")

    def _get_session(self) -> aiohttp.ClientSession:
        session = self._session
        if session is None:
            self._bind()
            from treadle.llm.aiohttp_parts import new_session

            session = self._session = new_session(self._limit, self._keepalive_timeout)
        elif asyncio.get_running_loop() is not self._loop:
            self._bind()  # raises
        return session

    def _get_lane(self) -> Lane:
        lane = self._lane
        if lane is None:
            self._bind()
            lane = self._lane = Lane(limit=self._limit, keepalive_timeout=self._keepalive_timeout)
        elif asyncio.get_running_loop() is not self._loop:
            self._bind()  # raises
        return lane

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send `request` over aiohttp; return a buffered or streamed `httpx.Response`."""
        from treadle.llm.aiohttp_parts import send

        return await send(self._get_session(), request)

    async def post_buffered(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: httpx.Timeout
    ) -> tuple[int, Mapping[str, str], bytes]:
        """POST `body` and read the whole reply: `(status, headers, content)`, decompressed.

        The hot path of `ModelClient.complete` when Treadle owns the client: Treadle's own
        HTTP/1.1 lane (`treadle.llm.lane`), no httpx or aiohttp objects per request (together
        about half of a round's CPU). Failures surface as the same httpx exceptions
        `handle_async_request` raises.
        """
        return await self._get_lane().post_buffered(url, body, headers, timeouts)

    async def post_stream(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: httpx.Timeout
    ) -> tuple[int, Mapping[str, str], LaneBody]:
        """POST `body` and return `(status, headers, body stream)` as soon as the headers arrive.

        The streaming twin of `post_buffered`. The caller must `aclose()` the stream; closing
        it before the end closes the connection instead of returning it to the pool.
        """
        return await self._get_lane().post_stream(url, body, headers, timeouts)

    async def aclose(self) -> None:
        """Close the aiohttp session and every pooled connection."""
        self._closed = True
        lane, self._lane = self._lane, None
        if lane is not None:
            lane.close()
            await asyncio.sleep(0)  # the transports finish closing (no unclosed-socket warnings)
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    def close_now(self) -> None:
        """Best-effort synchronous close, for a loop that can no longer run coroutines."""
        self._closed = True
        lane, self._lane = self._lane, None
        if lane is not None:
            lane.close()
        session, self._session = self._session, None
        if session is not None:
            from treadle.llm.aiohttp_parts import close_session_now

            close_session_now(session)
