"""`FakeOpenAIServer`: a fast OpenAI-compatible HTTP server on 127.0.0.1 for tests and benchmarks.

A minimal HTTP/1.1 keep-alive server on `asyncio.Protocol` (see `fake_http`; no framework: it
must sustain thousands of concurrent passes on a small machine). It serves
`POST /v1/chat/completions` (whole and SSE), `GET /v1/models` and `GET /health`, answers from a
queue of `Reply`s or a script, injects faults on request and can enforce rate limits. It runs in
its own thread and event loop (context manager), or from a shell:
`python -m treadle.testing.fake_server --port 8000 --latency-ms 50 --script echo`.
It must never block its loop: latency is a timer, not a sleep, and scripts must be quick.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import from_json, to_json

from treadle.testing.fake_http import Connection
from treadle.testing.fake_http import head as http_head
from treadle.testing.fake_limits import RateHeaders, RateLimits
from treadle.testing.fake_replies import (
    Reply,
    Script,
    get_script,
    render_completion,
    render_stream,
    usage_of,
)
from treadle.testing.fake_thread import BackgroundServing

__all__ = ["FakeOpenAIServer", "FaultRule", "RecordedRequest", "main"]


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """A request the server received (bodies of chat completions parsed as JSON)."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: Any
    """Parsed JSON body (None when empty or not JSON)."""
    size: int
    """Body size in bytes."""


@dataclass(slots=True)
class FaultRule:
    """Answer `reply` when `when(request)` holds, with `probability`, at most `times` times."""

    reply: Reply | Callable[[dict[str, Any]], Reply]
    probability: float = 1.0
    when: Callable[[dict[str, Any]], bool] | None = None
    times: int | None = None
    used: int = field(default=0)


class FakeOpenAIServer(BackgroundServing):
    """An OpenAI-compatible server on 127.0.0.1, scripted and fault-injectable.

    ```text
    with FakeOpenAIServer(script="echo", latency_ms=5) as server:
        Provider(model="fake-model", base_url=server.base_url)
    ```

    Replies come from, in order: fault rules (`add_fault`), the queue (`enqueue`), then
    `script` (a built-in name or a function of the request dict returning a `Reply`). With
    `api_key`, a chat request that does not carry it as a bearer token gets a 401, as a real
    endpoint would.
    With `requests_per_minute` / `tokens_per_minute` it enforces those limits as providers do (see
    `RateLimits`; `rate_window` seconds stand for the minute; `rate_headers` `"remaining"` or
    `"none"` tells less, as some providers do) and counts refusals in `rate_limited`.
    """

    _thread_name = "treadle-fake-openai"

    def __init__(
        self,
        script: str | Script = "echo",
        *,
        replies: list[Reply] | None = None,
        latency_ms: float = 0.0,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = "fake-model",
        rounds: int = 3,
        seed: int | None = 0,
        max_recorded: int = 1000,
        api_key: str | None = None,
        requests_per_minute: int | None = None,
        tokens_per_minute: int | None = None,
        rate_window: float = 60.0,
        rate_headers: RateHeaders = "full",
    ) -> None:
        self.script: Script = (
            get_script(script, rounds=rounds) if isinstance(script, str) else script
        )
        self.latency_ms = latency_ms
        """Default delay before each response, in milliseconds."""
        self.host = host
        self.port = port
        self.model = model
        self.api_key = api_key
        """When set, chat requests without `Authorization: Bearer <api_key>` get a 401."""
        self.requests: deque[RecordedRequest] = deque(maxlen=max_recorded)
        """The most recent requests received (bounded by `max_recorded`)."""
        self.request_count = 0
        """Chat-completion requests received (including faulted ones)."""
        self.in_flight = 0
        """Chat-completion requests received and not yet answered."""
        self.max_in_flight = 0
        """Highest `in_flight` seen: the concurrency clients really achieved."""
        self.connections_opened = 0
        """TCP connections accepted so far (shows whether clients reuse pooled connections)."""
        self._queue: deque[Reply] = deque(replies or ())
        self._faults: list[FaultRule] = []
        self._rng = random.Random(seed)
        self._connections: set[Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._ids = 0
        self.limits: RateLimits | None = None
        """The enforced rate limits (None: unlimited); `limits.rejected` counts the 429s."""
        if requests_per_minute is not None or tokens_per_minute is not None:
            self.limits = RateLimits(requests_per_minute, tokens_per_minute, window=rate_window,
                                     now=time.monotonic(), headers=rate_headers)  # fmt: skip

    # -- scripting -------------------------------------------------------------------------------

    def enqueue(self, *replies: Reply) -> None:
        """Queue replies; each chat request takes the next one (before the script)."""
        self._queue.extend(replies)

    def add_fault(
        self,
        reply: Reply | Callable[[dict[str, Any]], Reply],
        *,
        probability: float = 1.0,
        when: Callable[[dict[str, Any]], bool] | None = None,
        times: int | None = None,
    ) -> FaultRule:
        """Answer with `reply` (e.g. `Reply.rate_limited()`) per the rule; returns the rule."""
        rule = FaultRule(reply, probability, when, times)
        self._faults = [*self._faults, rule]
        return rule

    def clear_faults(self) -> None:
        """Remove every fault rule."""
        self._faults = []

    def reset_stats(self) -> None:
        """Forget recorded requests and counters."""
        self.requests.clear()
        self.request_count = 0
        self.max_in_flight = self.in_flight

    def _pick(self, request: dict[str, Any]) -> Reply:
        for rule in self._faults:
            if rule.times is not None and rule.used >= rule.times:
                continue
            if rule.when is not None and not rule.when(request):
                continue
            if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                continue
            rule.used += 1
            return rule.reply if isinstance(rule.reply, Reply) else rule.reply(request)
        if self._queue:
            try:
                return self._queue.popleft()
            except IndexError:
                pass
        return self.script(request)

    # -- serving ---------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:PORT/v1`, the value for `Provider(base_url=...)`."""
        return f"http://{self.host}:{self.port}/v1"

    def _done_one(self) -> None:
        self.in_flight -= 1

    def _handle(
        self, conn: Connection, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> None:
        path, mark, query = path.partition("?")  # a query (Azure's api-version) is no route
        if path.startswith("/v1/"):
            path = path[3:]
        if method == "POST" and path == "/chat/completions":
            self._chat(conn, headers, body, query=mark + query)
        elif method == "GET" and path == "/models":
            models = {"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "treadle"}
            ]}  # fmt: skip
            conn.send(200, to_json(models), [("content-type", "application/json")])
        elif method == "GET" and path == "/stats":  # what benchmarks read between runs
            stats = {"requests": self.request_count,
                     **(self.limits.stats() if self.limits is not None else {})}  # fmt: skip
            conn.send(200, to_json(stats), [("content-type", "application/json")])
        elif method == "GET" and path == "/health":
            conn.send(200, b'{"status":"ok"}', [("content-type", "application/json")])
        else:
            error = {"error": {"message": f"No route for {method} {path}", "type": "not_found"}}
            conn.send(404, to_json(error), [("content-type", "application/json")])

    def _chat(
        self, conn: Connection, headers: dict[str, str], body: bytes, *, query: str = ""
    ) -> None:
        try:
            request = from_json(body)
        except ValueError:
            request = None
        self.requests.append(RecordedRequest("POST", f"/v1/chat/completions{query}", headers,
                                             request, len(body)))  # fmt: skip
        self.request_count += 1
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
            error = {
                "error": {
                    "message": "The body must be a JSON object with `messages`.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            }
            conn.send(400, to_json(error), [("content-type", "application/json")])
            return
        if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
            reply = Reply.unauthorized()
        else:
            reply = self._pick(request)
        extra: list[tuple[str, str]] = []
        if self.limits is not None:  # charged as the reply will report it, at admission
            cost = usage_of(reply, len(body))["total_tokens"]
            admitted, extra, wait = self.limits.take(cost, time.monotonic())
            if not admitted:
                refused = Reply.rate_limited()
                extra += RateLimits.refusal_headers(wait)
                conn.send(429, refused.body or b"", [("content-type", "application/json"), *extra])
                return
        self.in_flight += 1
        if self.in_flight > self.max_in_flight:
            self.max_in_flight = self.in_flight
        latency = (reply.latency_ms if reply.latency_ms is not None else self.latency_ms) / 1000.0
        args = (conn, reply, request, len(body), extra)
        if latency > 0:
            assert self._loop is not None
            conn.timer = self._loop.call_later(latency, self._respond, *args)
        else:
            self._respond(*args)

    def _respond(
        self,
        conn: Connection,
        reply: Reply,
        request: dict[str, Any],
        size: int,
        extra: list[tuple[str, str]],
    ) -> None:
        conn.timer = None
        self.in_flight -= 1
        if conn.transport is None:
            return
        if reply.drop:
            conn._close()
            return
        self._ids += 1
        request_id = f"req_{self._ids:08d}"
        common = [("x-request-id", request_id), *reply.headers, *extra]
        if reply.body is not None or reply.status != 200:
            payload = reply.body if reply.body is not None else b"{}"
            conn.send(reply.status, payload, [("content-type", reply.content_type), *common])
            return
        model = str(request.get("model") or self.model)
        created = int(time.time())
        completion_id = f"chatcmpl-{request_id[4:]}"
        if request.get("stream"):
            options = request.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            events = render_stream(reply, model=model, completion_id=completion_id,
                                   created=created, request_bytes=size,
                                   include_usage=include_usage)  # fmt: skip
            head = http_head(200, [("content-type", "text/event-stream"),
                                   ("cache-control", "no-cache"),
                                   ("transfer-encoding", "chunked"), *common])  # fmt: skip
            self._write_stream(conn, head, events, reply)
            return
        payload = render_completion(reply, model=model, completion_id=completion_id,
                                    created=created, request_bytes=size)  # fmt: skip
        if reply.tear_after is None and reply.stall_ms is None:
            conn.send(200, payload, [("content-type", "application/json"), *common])
            return
        half = len(payload) // 2
        head = http_head(200, [("content-type", "application/json"),
                           ("content-length", str(len(payload))), *common])  # fmt: skip
        conn._write(head + payload[:half])
        if reply.tear_after is not None:
            conn._close()
            return
        self._later(conn, reply.stall_ms or 0.0, payload[half:])

    def _later(self, conn: Connection, ms: float, data: bytes) -> None:
        def write() -> None:
            conn.timer = None
            self.in_flight -= 1
            if conn._write(data):
                conn.finish()

        assert self._loop is not None
        self.in_flight += 1  # balanced in write() or connection_lost()
        conn.timer = self._loop.call_later(ms / 1000.0, write)

    def _write_stream(
        self, conn: Connection, head: bytes, events: list[bytes], reply: Reply
    ) -> None:
        def chunk(parts: list[bytes]) -> bytes:
            data = b"".join(parts)
            return b"%x\r\n%s\r\n" % (len(data), data) if data else b""

        if reply.tear_after is not None:
            conn._write(head + chunk(events[: reply.tear_after]))
            conn._close()
            return
        if reply.stall_ms is not None and len(events) > 1:
            conn._write(head + chunk(events[:1]))
            self._later(conn, reply.stall_ms, chunk(events[1:]) + b"0\r\n\r\n")
            return
        conn._write(head + chunk(events) + b"0\r\n\r\n")
        conn.finish()

    # -- lifecycle -------------------------------------------------------------------------------

    async def start_serving(self) -> None:
        """Start listening on the current loop (the port is known afterwards)."""
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(
            lambda: Connection(self), self.host, self.port, backlog=4096, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop_serving(self) -> None:
        """Stop listening and close every connection."""
        if self._server is not None:
            self._server.close()
        # Python 3.11's Server.wait_closed() returns at once after close(), and abort() only
        # schedules the transport's teardown: turn the loop until every connection is gone, so
        # no socket outlives the server (a ResourceWarning otherwise).
        for _ in range(100):
            for conn in list(self._connections):
                if conn.transport is not None:
                    conn.transport.abort()
            await asyncio.sleep(0)
            if not self._connections:
                break
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def serve_forever(self) -> None:
        """Serve on the current loop until cancelled, printing the base URL once listening."""
        await self.start_serving()
        print(self.base_url, flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop_serving()


def main(argv: list[str] | None = None) -> None:
    """Command line: serve until killed, printing the base URL first."""
    parser = argparse.ArgumentParser(description="Fake OpenAI-compatible server for Treadle.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--script", default="echo", help="echo, file_worker or tool_loop")
    parser.add_argument("--rounds", type=int, default=3, help="tool rounds of tool_loop")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--rpm", type=int, default=None, help="requests per rate window")
    parser.add_argument("--tpm", type=int, default=None, help="tokens per rate window")
    parser.add_argument("--rate-window", type=float, default=60.0, help="seconds (60: a minute)")
    parser.add_argument(
        "--api-key", default=None, help="answer 401 to chat requests without this bearer token"
    )
    args = parser.parse_args(argv)
    server = FakeOpenAIServer(args.script, latency_ms=args.latency_ms, host=args.host,
                              port=args.port, rounds=args.rounds, model=args.model,
                              requests_per_minute=args.rpm, tokens_per_minute=args.tpm,
                              rate_window=args.rate_window, api_key=args.api_key)  # fmt: skip
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(server.serve_forever())


if __name__ == "__main__":
    main()
