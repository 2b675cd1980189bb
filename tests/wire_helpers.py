"""A raw HTTP/1.1 server for the wire tests: it answers each chat completion with the request's own
user message (`echo:<message>`), and for a message naming an early exit it sends only the first
part of a streamed reply and holds the rest until the client speaks again on that connection.

That hold is the bug the invariant test hunts: a client that pools a connection with its reply
unread sends the next request on it, the server then flushes the old reply's tail first, and the
next request reads that tail as its own reply. A client that closes such a connection never sees
the tail (the server sees EOF instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPLIES = Path("/work/shared/provider-replies")


def completion(text: str) -> bytes:
    """A whole chat completion answering `text`."""
    return json.dumps(
        {
            "id": "c1",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()


def event(text: str, finish: str | None = None) -> bytes:
    """One SSE event of a streamed completion adding `text`."""
    chunk = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def chunk(data: bytes) -> bytes:
    """`data` as one HTTP chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data)


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def whole_reply(body: bytes, status: int = 200) -> bytes:
    """A complete reply with a Content-Length."""
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
        status,
        len(body),
        body,
    )


def stream_reply(events: list[bytes]) -> bytes:
    """A complete chunked SSE reply carrying `events` then `[DONE]`."""
    return (
        STREAM_HEAD + b"".join(chunk(e) for e in events) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    )


def split_recording(name: str, marker: bytes) -> tuple[bytes, bytes]:
    """A recorded SSE reply as (everything up to and including the event holding `marker`, the
    rest), each framed as HTTP chunks (the head is on the first part)."""
    raw = (REPLIES / name).read_bytes()
    at = raw.index(marker)
    end = raw.index(b"\n\n", at) + 2
    return STREAM_HEAD + chunk(raw[:end]), chunk(raw[end:]) + b"0\r\n\r\n"


@dataclass
class EchoWire:
    """What the server saw: per request, (connection number, user message)."""

    url: str = ""
    seen: list[tuple[int, str]] = field(default_factory=list)
    connections: int = 0
    held: int = 0
    """Replies whose first part was sent and whose rest waits for the client."""


def _parts(message: str, stream: bool) -> tuple[bytes, bytes | None]:
    """(what to send now, what to hold until the client speaks again) for `message`."""
    if message.startswith("inband-error"):
        return split_recording("openrouter-stream-error-chunk.sse", b'"error"')
    if message.startswith("inband-sent"):  # the whole recorded reply in one write, as it came
        raw = (REPLIES / "openrouter-stream-error-chunk.sse").read_bytes()
        events = [e + b"\n\n" for e in raw.split(b"\n\n") if e.strip()]
        return STREAM_HEAD + b"".join(chunk(e) for e in events) + b"0\r\n\r\n", None
    if message.startswith("bad-chunk"):  # a chunk that fails the schema, then more events
        bad = b'data: {"id":"c1","choices":"not a list"}\n\n'
        return STREAM_HEAD + chunk(event("a") + bad), chunk(event("b", "stop")) + b"0\r\n\r\n"
    if message.startswith("hold"):  # one event, then the rest only when asked again
        first = STREAM_HEAD + chunk(event("first "))
        if not stream:
            body = completion("late")
            head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)
            return head + body[:10], body[10:]
        rest = chunk(event("rest", "stop")) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        return first, rest
    text = f"echo:{message}"
    if stream:
        return stream_reply([event(text[:5]), event(text[5:], "stop")]), None
    return whole_reply(completion(text)), None


def _take(buf: bytearray) -> dict[str, Any] | None:
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    length = 0
    for line in bytes(buf[:end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if len(buf) < end + 4 + length:
        return None
    body = bytes(buf[end + 4 : end + 4 + length])
    del buf[: end + 4 + length]
    parsed: dict[str, Any] = json.loads(body)
    return parsed


@contextlib.asynccontextmanager
async def echo_wire() -> AsyncIterator[EchoWire]:
    """Serve on 127.0.0.1 in the running loop; yields the state with `url` (a base URL)."""
    state = EchoWire()
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        state.connections += 1
        number = state.connections
        buf = bytearray()
        held: bytes | None = None
        try:
            while True:
                data = await reader.read(65536)
                if held is not None:
                    if data:  # the client speaks again on a connection with a reply unread
                        writer.write(held)
                    held = None
                if not data:
                    return
                buf += data
                while (request := _take(buf)) is not None:
                    users = [m for m in request["messages"] if m["role"] == "user"]
                    message = str(users[-1]["content"]) if users else ""
                    state.seen.append((number, message))
                    now, later = _parts(message, bool(request.get("stream")))
                    writer.write(now)
                    if later is not None:
                        held = later
                        state.held += 1
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # cancelled only by the fixture's teardown: end quietly (asyncio logs otherwise)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        yield state
    finally:
        server.close()
        for task in handlers:  # owned here: none outlives the test's loop
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
