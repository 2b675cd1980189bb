"""A chat web service on a conversation store: Starlette, served by uvicorn.

    POST /chat/{key}      {"message": "..."}            a pass, streamed as server-sent events
    POST /approve/{key}   {"approvals": {"<call id>": true}}   resume a pass waiting for approval
    GET  /conversations/{key}                          the stored conversation, as JSON
    GET  /                                             a small chat page that uses the above

Each request continues conversation `key` from the store (`Store.sqlite` by default: any app
server process with the same store can answer any request). The pass runs while the response
streams; if the client disconnects, Starlette cancels the response and with it the pass, at once
(nothing is committed; the store lists it as a cancelled pending pass; if its commit was already
on its way, the store finishes it, whole or not at all, and lists the pass as cancelled exactly
when its turn did not land: `GET /conversations/{key}` shows which). A tool marked `needs_approval`
stops the pass with its calls listed in an `approval` event; a later `/approve` request, in this
process or another, resumes it. Two requests on one conversation at once: the second to finish
gets a `ConflictError`, sent as an `error` event (nothing of it is written).

Run it against the fake model: `python examples/chat_service/app.py` and open the printed URL.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from treadle import Provider, Session, stream_session_loop, tool
from treadle.errors import ConfigurationError, ConflictError, TreadleError
from treadle.loop.events import AssistantRowEvent, PassStopped, TextDelta, ToolStarted
from treadle.stores import PendingPass, Store
from treadle.stores.records import check_key

PAGE = (Path(__file__).with_name("page.html")).read_text()

#: The longest message the service accepts (a web endpoint bounds what it reads).
MAX_MESSAGE_CHARS = 16_000
#: The largest request body it reads: checked against Content-Length before reading, and
#: counted while reading (a chunked body has no Content-Length), so it never holds more.
MAX_BODY_BYTES = 64 * 1024


class BadRequest(Exception):
    """A request the service answers with an error status and message (400, 413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    def response(self) -> JSONResponse:
        """The error as a JSON response."""
        return JSONResponse({"error": str(self)}, status_code=self.status)


async def read_json(request: Request, limit: int = MAX_BODY_BYTES) -> Any:
    """The request's JSON body, read up to `limit` bytes; `BadRequest` (413 too large, 400 not
    JSON) otherwise."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise BadRequest(400, f"Content-Length {length[:40]!r} is not a number of bytes")
        if int(length) > limit:
            raise BadRequest(413, f"the body is {length} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:  # stop reading: the rest is never buffered
            raise BadRequest(413, f"the body is over the limit of {limit} bytes")
    try:
        return json.loads(body)
    except ValueError as err:  # json.JSONDecodeError, or bytes that are not UTF-8
        raise BadRequest(400, f"the body is not JSON: {err}") from None
    except RecursionError:  # nested deeper than the parser's stack: no sane request is
        raise BadRequest(400, "the body is not JSON this service reads: nested too deep") from None


def checked_key(request: Request) -> str:
    """The path's conversation key, or `BadRequest` (400) saying why no store can hold it (a
    NUL, a lone surrogate, too long); checked before any response starts streaming."""
    key: str = request.path_params["key"]
    try:
        return check_key(key)
    except ConfigurationError as err:
        raise BadRequest(400, str(err)) from None


def checked_text(text: str) -> str:
    """`text` if it is valid Unicode (no lone surrogate, which JSON's "\\ud800" escapes can
    carry), else `BadRequest` (400)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(400, "the message must be valid Unicode text (a lone surrogate)") from None
    return text


class PassResponse(StreamingResponse):
    """A pass streamed as server-sent events whose generator is always closed when the
    response ends, however it ends: a client that disconnects while an event is being written
    cancels the pass at once (it is recorded as `cancelled`, not left `running` until the
    garbage collector finds the abandoned generator)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            body = self.body_iterator
            if hasattr(body, "aclose"):
                with anyio.CancelScope(shield=True):  # the request task may be cancelled too
                    await body.aclose()


@tool(needs_approval=True)
def deploy(target: str) -> str:
    """Deploy the service to `target` (an operator approves each call)."""
    return f"deployed to {target}"


def _sse(event: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def create_app(
    store: Store,
    provider: Provider,
    *,
    instructions: str = "You are a helpful operator. Use tools when asked.",
    tools: Iterable[Any] = (deploy,),
    max_body_bytes: int = MAX_BODY_BYTES,
) -> Starlette:
    """The web app: conversations in `store`, the model at `provider`, these `tools`; request
    bodies over `max_body_bytes` are refused (413) without being read whole."""
    agent = Session.from_agent_prompt(instructions)
    toolset = list(tools)

    async def stream(user: Session, conversation: str | PendingPass, **options: Any) -> Response:
        async def events() -> AsyncIterator[bytes]:
            passes = stream_session_loop(
                user,
                agent,
                provider=provider,
                tools=toolset,
                store=store,
                conversation=conversation,
                **options,
            )
            try:
                # aclosing: closing this generator (PassResponse does) closes the pass's
                # stream, which cancels the pass and records it as cancelled.
                async with aclosing(passes):
                    async for event in passes:
                        if isinstance(event, TextDelta):
                            yield _sse("delta", {"text": event.text})
                        elif isinstance(event, AssistantRowEvent) and event.row.content:
                            yield _sse("message", {"text": str(event.row.content)})
                        elif isinstance(event, ToolStarted):
                            yield _sse("tool", {"name": event.name, "arguments": event.arguments})
                        elif isinstance(event, PassStopped):
                            out = event.session
                            assert out is not None
                            if out.pending_approvals:
                                yield _sse("approval", {"calls": out.pending_approvals})
                            yield _sse(
                                "done",
                                {
                                    "stop_reason": event.stop_reason,
                                    "version": out.metadata["version"],
                                },
                            )
            except ConflictError as err:
                yield _sse("error", {"kind": "conflict", "message": str(err)})
            except TreadleError as err:
                yield _sse("error", {"kind": type(err).__name__, "message": str(err)})

        return PassResponse(
            events(), media_type="text/event-stream", headers={"cache-control": "no-store"}
        )

    async def chat(request: Request) -> Response:
        try:
            key = checked_key(request)
            body = await read_json(request, max_body_bytes)
            message = body.get("message") if isinstance(body, dict) else None
            if not isinstance(message, str) or not message.strip():
                raise BadRequest(400, 'send {"message": "..."}')
            if len(message) > MAX_MESSAGE_CHARS:
                raise BadRequest(413, "the message is too long")
            checked_text(message)
        except BadRequest as err:
            return err.response()
        return await stream(Session.from_user_message(message), key)

    async def approve(request: Request) -> Response:
        try:
            key = checked_key(request)
            body = await read_json(request, max_body_bytes)
        except BadRequest as err:
            return err.response()
        decisions = body.get("approvals") if isinstance(body, dict) else None
        if not isinstance(decisions, dict) or not all(
            isinstance(v, bool | str) for v in decisions.values()
        ):
            return JSONResponse({"error": 'send {"approvals": {"<id>": true}}'}, status_code=400)
        pending = await store.apending(key)
        waiting = [p for p in pending if p.pending_approvals]
        if not waiting:
            return JSONResponse({"error": "nothing is waiting for approval"}, status_code=409)
        return await stream(Session(), waiting[-1], approvals=decisions)

    async def conversation(request: Request) -> Response:
        try:
            key = checked_key(request)
        except BadRequest as err:
            return err.response()
        convo = await store.conversation(key)
        return JSONResponse(
            {
                "version": convo.metadata["version"],
                "messages": convo.to_messages(),
                "pending_approvals": convo.pending_approvals,
            }
        )

    async def page(request: Request) -> Response:
        return HTMLResponse(PAGE)

    return Starlette(
        routes=[
            Route("/", page),
            Route("/chat/{key}", chat, methods=["POST"]),
            Route("/approve/{key}", approve, methods=["POST"]),
            Route("/conversations/{key}", conversation),
        ]
    )


def fake_model(request: dict[str, Any]) -> Any:
    """The offline model of the demo: "deploy X" calls the deploy tool, anything else echoes."""
    from treadle.testing import Reply

    last = request["messages"][-1]
    if last["role"] == "tool":
        return Reply.text(f"Done: {json.loads(last['content']).get('result', last['content'])}")
    text = str(last.get("content") or "")
    if text.startswith("deploy "):
        return Reply.tool_call("deploy", {"target": text.removeprefix("deploy ").strip()})
    return Reply.text(f"You said: {text}")


def main(argv: list[str]) -> None:
    """Serve on 127.0.0.1:8000 (or the port given) against the fake model."""
    import uvicorn

    from treadle.testing import FakeOpenAIServer

    port = int(argv[0]) if argv else 8000
    with FakeOpenAIServer(script=fake_model) as model, Store.sqlite() as store:
        provider = Provider(model="fake", base_url=model.base_url, api_key="sk-test")
        print(f"open http://127.0.0.1:{port}/", flush=True)
        uvicorn.run(create_app(store, provider), host="127.0.0.1", port=port)


if __name__ == "__main__":
    main(sys.argv[1:])
